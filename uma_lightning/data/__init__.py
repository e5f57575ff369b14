"""Robot datasets: LeRobot v2.1/v3.0 reading and writing, the resumable loader, and the data module.

Names are imported on first use, so that models can import the data contract (``data.spec``)
without pulling in Lightning.
"""

from uma_lightning._lazy import lazy_exports

_EXPORTS = {
    "DataSpec": "spec",
    "DatasetSource": "datamodule",
    "RobotDataModule": "datamodule",
    "split_episodes": "datamodule",
    "FrameDataset": "dataset",
    "NormMode": "dataset",
    "Normalizer": "dataset",
    "Window": "dataset",
    "BatchStream": "loader",
    "RobotDataLoader": "loader",
    "EpochOrder": "order",
    "OrderConfig": "order",
    "DevicePrefetcher": "prefetch",
    "ShardCache": "storage",
    "Storage": "storage",
    "StorageError": "storage",
    "compute_stats": "stats",
    "CAMERA": "generate",
    "default_cache_dir": "generate",
    "ensure_dataset": "generate",
    "DatasetError": "lerobot",
    "EpisodeData": "lerobot",
    "EpisodeInfo": "lerobot",
    "LeRobotMetadata": "lerobot",
    "LeRobotWriter": "writer",
    "VideoError": "video",
    "VideoReader": "video",
    "decode_frames_at": "video",
    "decode_video": "video",
    "encode_video": "video",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
