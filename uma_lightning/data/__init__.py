"""Robot datasets: the LeRobot v2.1 format, the embedded planar-arm dataset, and the data module."""

from uma_lightning.data.datamodule import RobotDataModule, split_episodes
from uma_lightning.data.dataset import DecodedVideoCache, FrameDataset, NormMode, Normalizer
from uma_lightning.data.generate import CAMERA, default_cache_dir, ensure_dataset
from uma_lightning.data.lerobot import DatasetError, EpisodeData, EpisodeInfo, LeRobotMetadata, LeRobotWriter
from uma_lightning.data.spec import DataSpec
from uma_lightning.data.video import DecodedVideo, VideoError, decode_frames_at, decode_video, encode_video

__all__ = [
    "CAMERA",
    "DataSpec",
    "DatasetError",
    "DecodedVideo",
    "DecodedVideoCache",
    "EpisodeData",
    "EpisodeInfo",
    "FrameDataset",
    "LeRobotMetadata",
    "LeRobotWriter",
    "NormMode",
    "Normalizer",
    "RobotDataModule",
    "VideoError",
    "decode_frames_at",
    "decode_video",
    "default_cache_dir",
    "encode_video",
    "ensure_dataset",
    "split_episodes",
]
