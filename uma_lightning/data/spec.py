"""The contract between data and model: what a batch holds, and the shapes a model is built for.

A collated training batch is a dict:

    images        uint8   [B, n_obs_steps, n_cameras, H, W, 3]  raw RGB, normalised inside the model
    obs_mask      bool    [B, n_obs_steps]     False for history steps before the episode start
                                                (those steps repeat the first frame)
    state         float32 [B, n_obs_steps, state_dim]          normalised with the dataset statistics
    actions       float32 [B, action_horizon, action_dim]      normalised with the dataset statistics
    action_mask   bool    [B, action_horizon]  False past the episode end (those steps repeat the last action)
    instruction   list[str]                    the episode's language instruction
    episode_index int64   [B]
    frame_index   int64   [B]
    sample_id     int64   [B]                  global frame index in the dataset, stable across runs
    dataset_index int64   [B]                  which dataset of a mixture the sample comes from (0 without one)

and, when every dataset records one (``environment_state_dim`` > 0):

    environment_state float32 [B, environment_state_dim]  what the simulator knew at the sample's frame
                                                (the named target's position), normalised; never a model
                                                input, only the target of an auxiliary loss
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DataSpec:
    """Shapes a model needs from its data; a data module builds one, the model consumes it."""

    cameras: tuple[str, ...]
    image_size: tuple[int, int]  # (height, width)
    state_dim: int
    action_dim: int
    n_obs_steps: int
    action_horizon: int
    fps: float
    environment_state_dim: int = 0

    def __post_init__(self) -> None:
        # YAML and JSON give lists; keep the spec hashable and comparable.
        object.__setattr__(self, "cameras", tuple(self.cameras))
        object.__setattr__(self, "image_size", tuple(self.image_size))


def example_batch(spec: DataSpec, batch_size: int, device: torch.device | str = "cpu") -> dict:
    """A batch of ``batch_size`` samples as the module docstring lays it out, every step real (the
    masks true), every other value zero and the instructions empty: what a tool traces a training
    step on when it reads no data."""
    steps, horizon = spec.n_obs_steps, spec.action_horizon
    zeros = lambda *shape, dtype=torch.float32: torch.zeros(batch_size, *shape, dtype=dtype, device=device)  # noqa: E731
    batch = {
        "images": zeros(steps, len(spec.cameras), *spec.image_size, 3, dtype=torch.uint8),
        "obs_mask": zeros(steps, dtype=torch.bool).logical_not(),
        "state": zeros(steps, spec.state_dim),
        "actions": zeros(horizon, spec.action_dim),
        "action_mask": zeros(horizon, dtype=torch.bool).logical_not(),
        "instruction": [""] * batch_size,
        **{key: zeros(dtype=torch.int64) for key in ("episode_index", "frame_index", "sample_id", "dataset_index")},
    }
    if spec.environment_state_dim:
        batch["environment_state"] = zeros(spec.environment_state_dim)
    return batch
