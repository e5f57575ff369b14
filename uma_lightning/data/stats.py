"""Feature statistics in the LeRobot layout (mean, std, min, max, q01, q99, count), and the fast pass that
computes them for a whole dataset.

Low-dimensional features get one value per dimension. Cameras get one per channel in [0, 1], shaped
[3, 1, 1] as LeRobot does, computed from exact 8-bit histograms so per-episode histograms add up.
The pass over a dataset reads only the parquet columns it needs; it decodes video only when asked
for camera statistics, and then only every `frame_stride`-th frame.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

QUANTILES = {"q01": 0.01, "q99": 0.99}


def array_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """Per-dimension statistics of a [N, D] array, computed in float64."""
    values = np.asarray(values, dtype=np.float64)
    stats = {
        "mean": values.mean(axis=0),
        "std": values.std(axis=0),
        "min": values.min(axis=0),
        "max": values.max(axis=0),
    }
    stats.update({name: np.quantile(values, q, axis=0) for name, q in QUANTILES.items()})
    stats["count"] = np.array([len(values)])
    return stats


def channel_histogram(frames: np.ndarray) -> np.ndarray:
    """Per-channel counts of each uint8 value, [3, 256]; histograms add up across episodes exactly."""
    return np.stack([np.bincount(frames[..., c].ravel(), minlength=256) for c in range(frames.shape[-1])])


def histogram_stats(histogram: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel statistics in [0, 1], shaped [3, 1, 1], from a [3, 256] value histogram.

    Quantiles use the inverted empirical CDF, exact for 8-bit pixels."""
    values = np.arange(histogram.shape[1]) / 255.0
    count = histogram.sum(axis=1)
    mean = histogram @ values / count
    variance = np.maximum(histogram @ values**2 / count - mean**2, 0.0)
    cdf = np.cumsum(histogram, axis=1) / count[:, None]
    present = histogram > 0
    stats = {
        "mean": mean,
        "std": np.sqrt(variance),
        "min": values[present.argmax(axis=1)],
        "max": values[len(values) - 1 - present[:, ::-1].argmax(axis=1)],
    }
    stats.update({name: values[(cdf >= q).argmax(axis=1)] for name, q in QUANTILES.items()})
    stats = {name: value.reshape(-1, 1, 1) for name, value in stats.items()}
    stats["count"] = np.array([int(count[0])])
    return stats


def stats_to_json(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, list]]:
    return {key: {name: np.asarray(value).tolist() for name, value in s.items()} for key, s in stats.items()}


def stats_from_json(stats: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, np.ndarray]]:
    """Numeric statistics per feature. Writers add their own (LeRobot: quantiles q01 to q99, image
    statistics nested [3, 1, 1]); any that is not a numeric array is left out, since normalisation
    names a statistic it needs and does not find."""
    if not isinstance(stats, Mapping) or not all(isinstance(s, Mapping) for s in stats.values()):
        raise ValueError("expected an object of features, each an object of statistics")
    return {key: dict(_numeric_items(s)) for key, s in stats.items()}


def _numeric_items(stats: Mapping[str, Any]):
    for name, value in stats.items():
        try:
            array = np.asarray(value)
        except ValueError:  # ragged nested lists
            continue
        if array.dtype.kind in "biuf":
            yield name, array


def compute_stats(
    metadata: Any,
    keys: Sequence[str] | None = None,
    cameras: bool = False,
    frame_stride: int = 1,
    progress_every_s: float = 5.0,
) -> dict[str, dict[str, np.ndarray]]:
    """Statistics of a whole dataset (a `LeRobotMetadata`), one episode at a time.

    `keys`: low-dimensional features (default: every float feature). `cameras`: also decode video
    for per-channel image statistics, using every `frame_stride`-th frame of each episode.
    """
    from uma_lightning.data.video import VideoReader

    floats = [k for k, f in metadata.features.items() if f["dtype"].startswith("float") and k != "timestamp"]
    keys = list(keys) if keys is not None else floats
    columns: dict[str, list[np.ndarray]] = {key: [] for key in keys}
    histograms = {camera: np.zeros((3, 256), dtype=np.int64) for camera in (metadata.cameras if cameras else ())}
    start = last_report = time.perf_counter()
    n = len(metadata.episodes)
    for position, episode in enumerate(metadata.episodes):
        values = metadata.read_columns(episode.index, keys)
        for key in keys:
            columns[key].append(values[key].reshape(len(values[key]), -1))
        if histograms:
            times = metadata.read_episode(episode.index).timestamp[::frame_stride].astype(np.float64)
            for camera in histograms:
                reader = VideoReader(metadata.video_path(episode.index, camera))
                try:
                    frames = reader.frames_at(times + episode.videos[camera][1], tolerance_s=1e-4)
                finally:
                    reader.close()
                histograms[camera] += channel_histogram(frames)
        now = time.perf_counter()
        if now - last_report >= progress_every_s or position + 1 == n:
            logger.info("statistics: %d/%d episodes (%.1fs)", position + 1, n, now - start)
            last_report = now
    stats = {key: array_stats(np.concatenate(parts)) for key, parts in columns.items()}
    stats.update({camera: histogram_stats(h) for camera, h in histograms.items()})
    return stats
