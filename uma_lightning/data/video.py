"""H.264 mp4 encoding of uint8 RGB frames, and decoding at requested timestamps, with PyAV.

Why PyAV and not torchcodec: torchcodec 0.17's PyPI wheel links the CUDA build of torch
(libtorch_cuda.so, libnvrtc.so.13) and a system FFmpeg (libavcodec.so.61); next to the CPU torch
wheel it fails to load, so it could not be measured here. PyAV bundles FFmpeg and installs anywhere.
A `VideoReader` keeps its file open and decodes forward from the last frame when the next request
is close ahead, seeking only when it must. Measured on the embedded dataset (64x64, GOP 2): 5.6k
frames/s decoding episodes in order, 4.7k frames/s seeking to every frame in random order with the
file kept open, and ~1 ms to open a file, which is why readers stay open in an LRU rather than
being opened per sample.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from av.video.reformatter import VideoReformatter

_REFORMATTERS: dict[int, VideoReformatter] = {}


def _to_rgb() -> VideoReformatter:
    """This process's reformatter. One per process reuses its colour-conversion context across frames
    and files (a fresh one per frame, as `frame.to_ndarray(format=...)` makes, costs ~1 ms on small
    frames). Never one inherited through fork: its conversion threads did not survive the fork, and
    using it there hangs."""
    pid = os.getpid()
    if pid not in _REFORMATTERS:  # an inherited one stays referenced: freeing it would wait on its lost threads
        _REFORMATTERS[pid] = VideoReformatter()
    return _REFORMATTERS[pid]


class VideoError(RuntimeError):
    """A video file is missing, unreadable, or lacks a requested frame."""


# BT.601 limited range (what decoders assume for an untagged stream), in units of 1/2**16.
_Y_FROM_RGB = (16829, 33039, 6416)
_CB_FROM_RGB = (-9714, -19070, 28784)
_CR_FROM_RGB = (28784, -24103, -4681)


def _weighted(rgb: np.ndarray, weights: tuple[int, int, int]) -> np.ndarray:
    return weights[0] * rgb[..., 0] + weights[1] * rgb[..., 1] + weights[2] * rgb[..., 2]


def rgb_to_yuv420p(images: np.ndarray) -> np.ndarray:
    """uint8 RGB [..., H, W, 3] -> the planar yuv420p layout PyAV takes, uint8 [..., H * 3 / 2, W].

    Integer arithmetic in numpy rather than FFmpeg's swscale: the result is the same on every
    CPU and FFmpeg build (swscale's SIMD paths and threading are not bit-identical across them),
    so the encoded bytes depend only on the frames. Chroma is computed from each 2x2 block's mean.
    """
    rgb = images.astype(np.int32)  # the largest sum, 4 pixels x 255 x 57568, fits in int32
    *lead, height, width, _ = images.shape
    luma = (_weighted(rgb, _Y_FROM_RGB) + (16 << 16) + (1 << 15)) >> 16
    blocks = rgb.reshape(*lead, height // 2, 2, width // 2, 2, 3).sum(axis=(-4, -2))  # 4x the block mean
    cb = (_weighted(blocks, _CB_FROM_RGB) + (128 << 18) + (1 << 17)) >> 18
    cr = (_weighted(blocks, _CR_FROM_RGB) + (128 << 18) + (1 << 17)) >> 18
    planes = [luma.reshape(*lead, -1), cb.reshape(*lead, -1), cr.reshape(*lead, -1)]
    return np.concatenate(planes, axis=-1).astype(np.uint8).reshape(*lead, height * 3 // 2, width)


# Encoders the writer knows, by the name meta/info.json gives the codec (video.codec).
CODECS = {"h264": "libx264", "av1": "libsvtav1"}


def _encoder_options(codec: str, crf: int, gop: int) -> dict[str, str]:
    """One thread and no reordered frames: the output bytes are then a pure function of the input."""
    if codec == "h264":
        return {"crf": str(crf), "g": str(gop), "bf": "0", "preset": "fast", "threads": "1"}
    # SVT-AV1's crf scale runs to 63; preset 10 is its fast end that still compresses well.
    return {"crf": str(min(63, crf + 10)), "g": str(gop), "preset": "10", "svtav1-params": "lp=1"}


class VideoStreamWriter:
    """Appends uint8 RGB frames [T, H, W, 3] to one H.264 or AV1 (yuv420p) mp4; several episodes may share a file.

    A short GOP keeps random access cheap (LeRobot writes GOP 2). The colour conversion is ours
    (`rgb_to_yuv420p`), the encoder runs one thread without B-frames and the muxer writes no
    version string, so the output bytes are a pure function of the input: regenerating a dataset
    reproduces the same files.
    """

    def __init__(
        self, path: str | Path, fps: float, height: int, width: int, crf: int = 20, gop: int = 2, codec: str = "h264"
    ):
        self.path = Path(path)
        if height % 2 or width % 2:
            raise ValueError(f"{self.path}: yuv420p needs even height and width, got {height}x{width}")
        if codec not in CODECS:
            raise ValueError(f"{self.path}: unknown codec {codec!r}; choose from {sorted(CODECS)}")
        if gop < 1:
            raise ValueError(f"{self.path}: gop must be >= 1, got {gop}")
        if codec == "av1":
            # SVT-AV1 prints its whole configuration (25 lines) each time an encoder starts, once per
            # video file: errors only, unless SVT_LOG asks for more.
            os.environ.setdefault("SVT_LOG", "1")
        self.rate = Fraction(fps).limit_denominator(1001)
        self.shape = (height, width, 3)
        self.frames = 0
        self._container = av.open(str(self.path), mode="w", options={"fflags": "+bitexact"})
        self._stream = self._container.add_stream(CODECS[codec], rate=self.rate)
        self._stream.width, self._stream.height, self._stream.pix_fmt = width, height, "yuv420p"
        self._stream.options = _encoder_options(codec, crf, gop)

    def add(self, frames: np.ndarray) -> tuple[float, float]:
        """Encode `frames`; returns the time span [from, to) they occupy in the file, in seconds."""
        frames = np.asarray(frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != self.shape or len(frames) == 0:
            raise ValueError(
                f"{self.path}: frames must be uint8 [T >= 1, {', '.join(map(str, self.shape))}], got {frames.dtype} {frames.shape}"
            )
        start = self.frames
        for planes in rgb_to_yuv420p(frames):
            frame = av.VideoFrame.from_ndarray(planes, format="yuv420p")
            frame.pts, frame.time_base = self.frames, 1 / self.rate
            self._container.mux(self._stream.encode(frame))
            self.frames += 1
        return float(start / self.rate), float(self.frames / self.rate)

    def close(self) -> None:
        self._container.mux(self._stream.encode())
        self._container.close()

    def __enter__(self) -> VideoStreamWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def encode_video(
    frames: np.ndarray, path: str | Path, fps: float, crf: int = 20, gop: int = 2, codec: str = "h264"
) -> None:
    """Write uint8 RGB frames [T, H, W, 3] to a new mp4 at `path`."""
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise ValueError(f"{path}: frames must be uint8 [T, H, W, 3] with T >= 1, got {frames.dtype} {frames.shape}")
    with VideoStreamWriter(path, fps, frames.shape[1], frames.shape[2], crf, gop, codec) as writer:
        writer.add(frames)


class VideoReader:
    """An open video file that returns the frames at requested timestamps (seconds).

    A requested timestamp without a frame within the tolerance is an error naming the file and the
    timestamp, never the nearest frame: a silent substitution would pair an observation with the
    wrong state and action.
    """

    # A seek costs about as much as decoding this many pixels of frames: measured 0.2 ms per seek
    # against 0.26 ms per 224x224 frame (H.264 and AV1 alike), so at 64x64 a seek is worth ~8 frames
    # and at 224x224 less than one.
    SEEK_PIXELS = 35_000

    def __init__(
        self, path: str | Path, threads: int = 1, size: tuple[int, int] | None = None, name: str | None = None
    ) -> None:
        self.path = Path(path)
        self.name = name or str(self.path)  # the file in decoded-frame cache keys (a dataset's relative path)
        try:
            self._container = av.open(str(self.path))
        except (av.FFmpegError, OSError) as error:
            raise VideoError(f"cannot open video {self.path}: {error}") from error
        if not self._container.streams.video:  # a truncated file can still open
            self._container.close()
            raise VideoError(f"cannot open video {self.path}: it holds no video stream (truncated or not a video?)")
        self._stream = self._container.streams.video[0]
        # One thread for small frames (threads cost more than they save, and loader workers run in
        # parallel); see `decoder_threads`. Threaded decoding returns the same pixels.
        self._stream.thread_count = threads
        if threads > 1:
            self._stream.thread_type = "AUTO"
        self.size = tuple(size) if size is not None else (self._stream.height, self._stream.width)
        # Decode forward instead of seeking when the frames skipped on the way cost no more than a
        # seek (or lie within the longest GOP seen so far, where a seek would land on a keyframe
        # behind the position).
        self._forward_frames = max(1, round(self.SEEK_PIXELS / (self._stream.height * self._stream.width)))
        rate = self._stream.average_rate or self._stream.guessed_rate or 30
        self._frame_s = 1.0 / float(rate)
        self._time_base_s = float(self._stream.time_base)  # per frame, float arithmetic rather than Fraction's
        self._frames: Any = None  # the decode generator, positioned after the last decoded frame
        self._last_time: float | None = None
        self._first_after_seek: float | None = None
        self._gop_frames = 1  # the longest distance between keyframes decoded so far
        self._last_key: float | None = None

    @property
    def nbytes_per_frame(self) -> int:
        return self.size[0] * self.size[1] * 3

    def frames_at(
        self, timestamps: np.ndarray, tolerance_s: float, cache: Any = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Frames at `timestamps`, uint8 [N, H, W, 3], written into `out` when it is given (a slot of a
        batch: each frame is then copied once, from the decoder's output to the batch). With an `LRU`
        cache, frames are looked up by (file name, microsecond) first, and the frames returned are stored there."""
        query = np.asarray(timestamps, dtype=np.float64).reshape(-1).tolist()
        if out is None:
            out = np.empty((len(query), *self.size, 3), dtype=np.uint8)
        elif out.shape != (len(query), *self.size, 3):
            raise ValueError(
                f"{self.path}: frames at {len(query)} timestamps of {self.size} need an out buffer of {(len(query), *self.size, 3)}, got {out.shape}"
            )
        # Python scalars, not numpy calls: a sample asks for a few frames, and per-call overhead
        # would cost more than copying them.
        done: dict[float, int] = {}  # timestamp -> the slot that already holds its frame
        for k in sorted(range(len(query)), key=query.__getitem__):  # each frame decoded once, in time order
            target = query[k]
            if target in done:
                out[k] = out[done[target]]
                continue
            frame = cache.peek((self.name, int(round(target * 1e6)))) if cache is not None else None
            if frame is None:
                frame = self._decode_at(target, tolerance_s, cache, None)
            out[k] = frame
            done[target] = k
        return out

    def cache_frames(
        self, timestamps: np.ndarray, tolerance_s: float, cache: Any, keep: dict[int, int] | None = None
    ) -> None:
        """Decode the frames at `timestamps` that the `LRU` cache lacks into it, in time order, without
        assembling them (samples read them from the cache). `keep` maps frame numbers (time x fps,
        rounded) to the microsecond keys later requests will use: frames decoded on the way that it
        names are converted and cached too, so that no frame is decoded twice."""
        for target in np.unique(np.asarray(timestamps, dtype=np.float64)).tolist():
            if cache.peek((self.name, int(round(target * 1e6)))) is None:
                self._decode_at(target, tolerance_s, cache, keep)

    def close(self) -> None:
        self._frames = None
        self._container.close()

    def _decode_at(self, target: float, tolerance_s: float, cache: Any, keep: dict[int, int] | None) -> np.ndarray:
        # Strictly after the last decoded frame: that frame itself is behind the decoder now (it was
        # evicted from the cache if it is asked for again), so it needs a seek.
        ahead = (
            self._last_time is not None
            and self._last_time + tolerance_s < target
            and self._wasted_frames(target, keep) <= max(self._forward_frames, self._gop_frames)
        )
        if not ahead:
            self._seek(target)
        for attempt in range(2):
            frame, time = self._decode_until(target, tolerance_s, cache, keep)
            if frame is not None:
                return frame
            if attempt == 0 and self._first_after_seek is not None and self._first_after_seek > target:
                self._seek(target - 1.0)  # the index pointed past the frame: start from an earlier keyframe
                continue
            break
        where = f"nearest decoded is {time:.6f}s" if time is not None else "no frame decodes there"
        raise VideoError(f"{self.path}: no frame at timestamp {target:.6f}s ({where}, tolerance {tolerance_s}s)")

    def _wasted_frames(self, target: float, keep: dict[int, int] | None) -> int:
        """Frames that decoding forward to `target` would decode and throw away: those between the
        position and the target that no later request (`keep`) names."""
        first, last = int(round(self._last_time / self._frame_s)) + 1, int(round(target / self._frame_s))
        if keep is None:
            return last - first
        return sum(1 for n in range(first, last) if n not in keep)

    def _seek(self, target: float) -> None:
        offset = int(max(target, 0.0) / float(self._stream.time_base))
        try:
            self._container.seek(offset, stream=self._stream, backward=True, any_frame=False)
        except (av.FFmpegError, OSError) as error:
            raise VideoError(f"{self.path}: cannot seek to {target:.6f}s: {error}") from error
        self._frames = self._container.decode(self._stream)
        self._last_time = None
        self._first_after_seek = None
        self._last_key = None

    def _decode_until(
        self, target: float, tolerance_s: float, cache: Any, keep: dict[int, int] | None
    ) -> tuple[np.ndarray | None, float | None]:
        """Decode forward to `target`: (the frame, its time), or (None, time of the first frame past it)."""
        if self._frames is None:
            self._seek(target)
        try:
            for frame in self._frames:
                if frame.pts is None:
                    continue
                time = frame.pts * self._time_base_s
                if self._last_time is None:
                    self._first_after_seek = time
                self._last_time = time
                if frame.key_frame:
                    if self._last_key is not None:
                        self._gop_frames = max(self._gop_frames, round((time - self._last_key) / self._frame_s))
                    self._last_key = time
                if time < target - tolerance_s:
                    self._keep(
                        frame, time, tolerance_s, cache, keep
                    )  # others are not converted to RGB: never asked for
                    continue
                if time > target + tolerance_s:
                    return None, time
                image = self._rgb(frame)
                if cache is not None:
                    cache.put((self.name, int(round(target * 1e6))), image)
                return image, time
        except (av.FFmpegError, OSError) as error:
            self._frames, self._last_time = None, None
            raise VideoError(f"{self.path}: cannot decode the frame at {target:.6f}s: {error}") from error
        self._frames = None  # end of file: the next request seeks
        return None, self._last_time

    def _keep(
        self, frame: av.VideoFrame, time: float, tolerance_s: float, cache: Any, keep: dict[int, int] | None
    ) -> None:
        if keep is None or cache is None:
            return
        micros = keep.get(int(round(time / self._frame_s)))
        if micros is not None and abs(micros / 1e6 - time) <= tolerance_s and (self.name, micros) not in cache:
            cache.put((self.name, micros), self._rgb(frame))

    def _rgb(self, frame: av.VideoFrame) -> np.ndarray:
        return to_rgb(frame, self.size)


def to_rgb(frame: av.VideoFrame, size: tuple[int, int]) -> np.ndarray:
    """uint8 RGB [H, W, 3] of a decoded frame at (height, width) `size`: scaled, when it differs from
    the stored size, in the same colour-conversion pass (area averaging when shrinking)."""
    height, width = size
    if (frame.height, frame.width) == (height, width):
        return _to_rgb().reformat(frame, format="rgb24").to_ndarray()
    return _to_rgb().reformat(frame, format="rgb24", width=width, height=height, interpolation="AREA").to_ndarray()


def decoder_threads(workers: int, height: int, width: int, cpus: int | None = None) -> int:
    """Decoder threads per open video: the cores each loader process may use, but no more than one
    per ~100k pixels (below that, frame threading costs more than it saves)."""
    cpus = cpus or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    return max(1, min(cpus // max(1, workers), height * width // 100_000))


@dataclass(frozen=True)
class DecodedVideo:
    """Every frame of one video file, with presentation timestamps in seconds."""

    path: Path
    frames: np.ndarray  # uint8 [T, H, W, 3]
    timestamps: np.ndarray  # float64 [T]


def decode_video(path: str | Path) -> DecodedVideo:
    """Decode every frame of a video file to RGB."""
    path = Path(path)
    frames, timestamps = [], []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_count = 1
            for frame in container.decode(stream):
                frames.append(to_rgb(frame, (frame.height, frame.width)))
                timestamps.append(float(frame.pts * frame.time_base))
    except (av.FFmpegError, OSError, IndexError) as error:
        raise VideoError(f"cannot decode video {path}: {error}") from error
    if not frames:
        raise VideoError(f"video {path} has no frames")
    return DecodedVideo(path, np.stack(frames), np.asarray(timestamps))


def decode_frames_at(
    path: str | Path, timestamps: np.ndarray, tolerance_s: float = 1e-4, size: tuple[int, int] | None = None
) -> np.ndarray:
    """Frames of a video file at the given timestamps (seconds), uint8 [N, H, W, 3]."""
    reader = VideoReader(path, size=size)
    try:
        return reader.frames_at(timestamps, tolerance_s)
    finally:
        reader.close()


def gpu_decoder() -> str | None:
    """The GPU video decoder installed next to a usable CUDA device ("torchcodec" or "PyNvVideoCodec"), else None."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return None
    for name in ("torchcodec", "PyNvVideoCodec"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def choose_decoder(setting: str, num_workers: int) -> tuple[str, str]:
    """("cpu" or "cuda", why) for the loader's `decoder` setting; cuda falls back to cpu, saying why."""
    if setting == "cpu":
        return "cpu", "set in the config"
    found = gpu_decoder()
    if found is None:
        return "cpu", "no GPU decoder (torchcodec's CUDA build or PyNvVideoCodec) with a CUDA device is installed"
    if num_workers > 0:
        return (
            "cpu",
            f"{found} decodes in the training process, and loader.num_workers is {num_workers} (set it to 0 for GPU decoding)",
        )
    return "cuda", f"{found} on {__import__('torch').cuda.get_device_name()}"


class CudaVideoReader:
    """`VideoReader`'s interface over torchcodec's GPU decoder (NVDEC). Its colour conversion is the
    GPU's, so frames differ from the CPU path's by a few levels; the frames come back to host memory
    for collation, as the CPU path's do."""

    def __init__(
        self, path: str | Path, threads: int = 1, size: tuple[int, int] | None = None, name: str | None = None
    ) -> None:
        from torchcodec.decoders import VideoDecoder

        self.path = Path(path)
        self.size = size
        try:
            self._decoder = VideoDecoder(str(self.path), device="cuda", seek_mode="approximate")
        except (RuntimeError, ValueError, OSError) as error:
            raise VideoError(f"cannot open video {self.path} on the GPU: {error}") from error

    def frames_at(
        self, timestamps: np.ndarray, tolerance_s: float, cache: Any = None, out: np.ndarray | None = None
    ) -> np.ndarray:
        import torch

        query = np.asarray(timestamps, dtype=np.float64).reshape(-1)
        try:
            batch = self._decoder.get_frames_played_at(seconds=query.tolist())
        except (RuntimeError, IndexError) as error:
            raise VideoError(f"{self.path}: cannot decode frames at {query.tolist()} on the GPU: {error}") from error
        off = np.abs(batch.pts_seconds.cpu().numpy() - query) > tolerance_s
        if off.any():
            raise VideoError(f"{self.path}: no frame at timestamp {query[off][0]:.6f}s (tolerance {tolerance_s}s)")
        frames = batch.data
        if self.size is not None and tuple(frames.shape[-2:]) != tuple(self.size):
            frames = (
                torch.nn.functional.interpolate(frames.float(), size=self.size, mode="area")
                .round_()
                .clamp_(0, 255)
                .to(torch.uint8)
            )
        frames = frames.permute(0, 2, 3, 1).cpu().numpy()
        if out is None:
            return np.ascontiguousarray(frames)
        out[...] = frames
        return out

    def cache_frames(
        self, timestamps: np.ndarray, tolerance_s: float, cache: Any, keep: dict[int, int] | None = None
    ) -> None:
        """Nothing: the GPU decoder decodes a sample's frames together when the sample is read."""

    def close(self) -> None:
        self._decoder = None
