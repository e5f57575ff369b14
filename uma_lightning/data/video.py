"""H.264 mp4 encoding of uint8 RGB episodes and decoding with timestamp checks (PyAV only)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import VideoReformatter


class VideoError(RuntimeError):
    """A video file is missing, unreadable, or lacks a requested frame."""


@dataclass(frozen=True)
class DecodedVideo:
    """Every frame of one video file, with presentation timestamps in seconds."""

    path: Path
    frames: np.ndarray  # uint8 [T, H, W, 3]
    timestamps: np.ndarray  # float64 [T]

    @property
    def nbytes(self) -> int:
        return self.frames.nbytes + self.timestamps.nbytes

    def frames_at(self, timestamps: np.ndarray, tolerance_s: float) -> np.ndarray:
        """Frames whose timestamps match `timestamps` within `tolerance_s`, uint8 [N, H, W, 3].

        A timestamp without a frame that close is an error, never the nearest frame: a silent
        substitution would pair an observation with the wrong state and action.
        """
        query = np.asarray(timestamps, dtype=np.float64).reshape(-1)
        nearest = np.abs(query[:, None] - self.timestamps[None, :]).argmin(axis=1)
        error = np.abs(self.timestamps[nearest] - query)
        bad = np.flatnonzero(error > tolerance_s)
        if bad.size:
            missing = query[bad[0]]
            raise VideoError(
                f"{self.path}: no frame at timestamp {missing:.6f}s (nearest is "
                f"{self.timestamps[nearest[bad[0]]]:.6f}s, tolerance {tolerance_s}s, "
                f"video has {len(self.timestamps)} frames)"
            )
        return self.frames[nearest]


def encode_video(
    frames: np.ndarray,
    path: str | Path,
    fps: float,
    crf: int = 20,
    gop: int = 2,
    preset: str = "fast",
) -> None:
    """Write uint8 RGB frames [T, H, W, 3] to an H.264 (yuv420p) mp4 at `path`.

    A short GOP keeps random access cheap; a single encoder thread and no B-frames make the output
    bytes a pure function of the input, so regenerating a dataset reproduces the same files.
    """
    path = Path(path)
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise ValueError(f"{path}: frames must be uint8 [T, H, W, 3] with T >= 1, got {frames.dtype} {frames.shape}")
    height, width = frames.shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(f"{path}: yuv420p needs even height and width, got {height}x{width}")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf), "g": str(gop), "bf": "0", "preset": preset, "threads": "1"}
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = index, 1 / rate
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def decode_video(path: str | Path) -> DecodedVideo:
    """Decode every frame of a video file to RGB."""
    path = Path(path)
    frames, timestamps = [], []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_count = 1  # tiny frames: threads cost more than they save, and loader workers run in parallel
            # One reformatter for the whole file reuses its colour-conversion context; a fresh one per
            # frame (what `frame.to_ndarray(format=...)` does) is ~20x slower on small frames.
            to_rgb = VideoReformatter()
            for frame in container.decode(stream):
                frames.append(to_rgb.reformat(frame, format="rgb24").to_ndarray())
                timestamps.append(float(frame.pts * frame.time_base))
    except (av.FFmpegError, OSError, IndexError) as error:
        raise VideoError(f"cannot decode video {path}: {error}") from error
    if not frames:
        raise VideoError(f"video {path} has no frames")
    return DecodedVideo(path, np.stack(frames), np.asarray(timestamps))


def decode_frames_at(path: str | Path, timestamps: np.ndarray, tolerance_s: float = 1e-4) -> np.ndarray:
    """Frames of a video file at the given timestamps (seconds), uint8 [N, H, W, 3]."""
    return decode_video(path).frames_at(timestamps, tolerance_s)
