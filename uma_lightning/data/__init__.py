"""Robot datasets: the LeRobot v2.1 format, the embedded planar-arm dataset, and the data module.

Names are imported on first use, so that models can import the data contract (``data.spec``)
without pulling in Lightning.
"""

from uma_lightning._lazy import lazy_exports

_EXPORTS = {
    "DataSpec": "spec",
    "RobotDataModule": "datamodule",
    "split_episodes": "datamodule",
    "DecodedVideoCache": "dataset",
    "FrameDataset": "dataset",
    "NormMode": "dataset",
    "Normalizer": "dataset",
    "CAMERA": "generate",
    "default_cache_dir": "generate",
    "ensure_dataset": "generate",
    "DatasetError": "lerobot",
    "EpisodeData": "lerobot",
    "EpisodeInfo": "lerobot",
    "LeRobotMetadata": "lerobot",
    "LeRobotWriter": "lerobot",
    "DecodedVideo": "video",
    "VideoError": "video",
    "decode_frames_at": "video",
    "decode_video": "video",
    "encode_video": "video",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
