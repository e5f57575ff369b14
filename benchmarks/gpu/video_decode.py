"""GPU check of the loader's video decoder option (loader.decoder=cuda), in one run of a few minutes.

1. The decoder choice: with a GPU decoder installed (torchcodec's CUDA build or PyNvVideoCodec)
   and a CUDA device, `auto` picks the GPU and says so; otherwise it falls back to the CPU, saying why.
2. For the realistic preset's cameras (224x224, 30 fps) in H.264 and AV1 at GOP 2: the GPU
   decoder's frames against PyAV's (mean and largest difference in levels: the GPU's colour
   conversion is its own, so they are close, not equal) and the frames/s of each, decoding every
   frame of the videos in order.
3. One training batch through RobotDataModule with the decoder the choice made.

It needs torch, PyAV and pyarrow, and runs from a checkout without ``pip install``. The script
exits 1 if a check failed. ``--cpu-smoke`` runs it at tiny sizes on the CPU path only, to check
the script itself anywhere.

    python benchmarks/gpu/video_decode.py
    python benchmarks/gpu/video_decode.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from uma_lightning.data import LeRobotMetadata, RobotDataModule  # noqa: E402
from uma_lightning.data.generate import RealisticPreset, generate_realistic  # noqa: E402
from uma_lightning.data.video import CudaVideoReader, VideoReader, choose_decoder  # noqa: E402

failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok    ' if ok else 'FAILED'} {name}{': ' + detail if detail else ''}")
    if not ok:
        failures.append(name)


def decode_all(reader_class, meta: LeRobotMetadata) -> tuple[np.ndarray, float]:
    """Every frame of every camera video, in order: (frames, frames/s)."""
    frames, start = [], time.perf_counter()
    for episode in meta.episodes:
        times = episode.videos[meta.cameras[0]][1] + np.arange(episode.length) / meta.fps
        for camera in meta.cameras:
            reader = reader_class(meta.video_path(episode.index, camera))
            frames.append(reader.frames_at(times, tolerance_s=1e-3))
            reader.close()
    frames = np.concatenate(frames)
    return frames, len(frames) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, CPU path only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    choice, why = choose_decoder("auto", num_workers=0)
    print(f"=== decoder choice: {choice} ({why})")
    if not args.cpu_smoke:
        check("auto picks the GPU decoder on this machine", choice == "cuda", why)
    else:
        check("auto names its reason", bool(why))
    size, seconds = (32, 0.5) if args.cpu_smoke else (224, 4.0)
    with tempfile.TemporaryDirectory() as workdir:
        for codec in ("h264", "av1"):
            preset = RealisticPreset(n_episodes=2, seconds=seconds, image_size=size, codec=codec, gop=2)
            root = generate_realistic(Path(workdir) / codec, preset)
            meta = LeRobotMetadata.load(root)
            cpu_frames, cpu_rate = decode_all(VideoReader, meta)
            print(f"=== {codec}: CPU (PyAV) {cpu_rate:.0f} frames/s over {len(cpu_frames)} frames of {size}x{size}")
            if choice == "cuda":
                gpu_frames, gpu_rate = decode_all(CudaVideoReader, meta)
                difference = np.abs(gpu_frames.astype(np.int16) - cpu_frames.astype(np.int16))
                print(
                    f"    GPU {gpu_rate:.0f} frames/s ({gpu_rate / cpu_rate:.2f}x the CPU); difference mean {difference.mean():.2f}, max {difference.max()} levels"
                )
                check(f"{codec}: GPU frames match the CPU's shapes", gpu_frames.shape == cpu_frames.shape)
                check(
                    f"{codec}: GPU frames are close to the CPU's",
                    float(difference.mean()) < 3.0,
                    f"mean {difference.mean():.2f} levels",
                )
            dm = RobotDataModule(
                root=str(root),
                batch_size=4,
                val_episodes=0,
                loader={"num_workers": 0, "decoder": "auto", "frame_store": "off"},
            )
            dm.setup("fit")
            batch = next(iter(dm.train_dataloader()))
            check(
                f"{codec}: a training batch with decoder {choice}", tuple(batch["images"].shape[-3:]) == (size, size, 3)
            )
    print("all checks passed" if not failures else f"{len(failures)} check(s) FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
