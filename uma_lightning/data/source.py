"""How a new data format comes in: converted to LeRobot, once, by an ``EpisodeSource``.

The order, the loader, the frame store and ``uma data`` read one format, LeRobot v2.1/v3.0
(``lerobot.py``). Another format (HDF5 from a teleoperation rig, RLDS, a simulator's own logs) is
not read in place: a small class yields its episodes as arrays, and ``write_lerobot`` writes them
with ``LeRobotWriter``, statistics and videos included. Conversion costs one pass; reading in place
would make every reader, cache and check learn each format. The embedded planar-arm data, the
realistic benchmark data and ``uma data convert`` are sources too::

    class MyRigEpisodes:
        layout = SourceLayout(fps=30, cameras=("observation.images.wrist",), image_size=(224, 224),
                              state_names=[...], action_names=[...])

        def __len__(self):
            return len(self.files)

        def __iter__(self):
            for path in self.files:
                ...  # read one episode of the rig's files
                yield Episode({"observation.images.wrist": frames}, state, action, "pick up the cup")

    write_lerobot(MyRigEpisodes(files), "datasets/my_rig", version="v3.0")
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from uma_lightning.data.writer import LeRobotWriter, Version
from uma_lightning.progress import Progress

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceLayout:
    """What every episode of a source holds: the dataset's features, as ``LeRobotWriter`` declares them."""

    fps: float
    cameras: tuple[str, ...]
    image_size: tuple[int, int]  # (height, width) of every camera's frames
    state_names: Sequence[str]
    action_names: Sequence[str]
    environment_state_names: Sequence[str] = ()
    robot_type: str = "unknown"


@dataclass(frozen=True)
class Episode:
    """One episode as arrays: per-camera uint8 frames [T, H, W, 3], state [T, S], action [T, A], its
    instruction, and the environment state [T, E] where the layout names one."""

    frames: Mapping[str, np.ndarray]
    state: np.ndarray
    action: np.ndarray
    task: str
    environment_state: np.ndarray | None = None


class EpisodeSource(Protocol):
    """Episodes of another format, in the order they should be written."""

    layout: SourceLayout

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Episode]: ...


def write_lerobot(
    source: EpisodeSource,
    root: str | Path,
    *,
    version: Version = "v2.1",
    progress_label: str = "episodes",
    all_ranks: bool = False,
    **writer_options: Any,
) -> Path:
    """Write every episode of ``source`` as a LeRobot dataset at ``root``, which appears whole or not at
    all (``LeRobotWriter``). ``writer_options``: the writer's encoding and file-size settings."""
    layout = dataclasses.asdict(source.layout)
    with (
        LeRobotWriter(root, version=version, **layout, **writer_options) as writer,
        Progress(len(source), progress_label, "episode", logger=logger, all_ranks=all_ranks) as progress,
    ):
        for episode in source:
            writer.add_episode(episode.frames, episode.state, episode.action, episode.task, episode.environment_state)
            progress.advance(1)
        return writer.finalize()
