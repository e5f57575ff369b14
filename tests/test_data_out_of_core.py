"""Out of core: bounded memory while streaming a dataset much larger than the caches, and remote data
read from a real S3-compatible server through a bounded, checked local cache."""

import logging

import numpy as np
import psutil
import pytest
import torch

from uma_lightning.data import CAMERA, DatasetError, LeRobotMetadata, RobotDataModule, ShardCache, Storage, StorageError
from uma_lightning.data.generate import generate_planar_arm
from uma_lightning.data.writer import LeRobotWriter


def synthetic_dataset(root, episodes: int, frames: int, size: int):
    """Frames of a moving blocky texture (not trivially compressible), written as LeRobot v3.0."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
    texture = np.kron(blocks, np.ones((16, 16, 1), dtype=np.uint8))  # [2 size, 2 size, 3]
    with LeRobotWriter(
        root,
        fps=10,
        cameras=(CAMERA,),
        image_size=(size, size),
        state_names=list("abcde"),
        action_names=list("xyz"),
        version="v3.0",
        video_file_mb=0.5,
    ) as writer:
        for episode in range(episodes):
            shifts = [(episode * 7 + t * 3) % size for t in range(frames)]
            video = np.stack([texture[s : s + size, s // 2 : s // 2 + size] for s in shifts])
            state = rng.normal(size=(frames, 5)).astype(np.float32)
            writer.add_episode({CAMERA: video}, state, state[:, :3], f"task {episode % 3}")
        return writer.finalize()


@pytest.mark.slow
def test_streaming_a_dataset_much_larger_than_the_caches_keeps_rss_bounded(tmp_path):
    size, episodes, frames = 128, 18, 50
    root = synthetic_dataset(tmp_path / "big", episodes, frames, size)
    decoded_bytes = episodes * frames * size * size * 3
    cache_mb, slack_mb = 2, 8  # slack: allocator and decoder buffers that come and go
    dm = RobotDataModule(
        root=str(root),
        batch_size=16,
        val_episodes=0,
        order={"shuffle_buffer": 64},
        loader={"num_workers": 1, "decode_cache_mb": cache_mb, "max_open_files": 4, "persistent_workers": True},
    )
    dm.setup("fit")
    assert decoded_bytes > 4 * (cache_mb + slack_mb) * 2**20  # the data is several times the whole allowance
    loader = dm.train_dataloader()
    rss = []
    for _epoch in range(2):
        for _batch in loader:
            worker = psutil.Process().children()[0]
            rss.append(worker.memory_info().rss)
    baseline, peak = max(rss[:5]), max(rss[5:])
    growth_mb = (peak - baseline) / 2**20
    print(
        f"\nstreamed {2 * decoded_bytes / 2**20:.0f} MiB of decoded frames; worker RSS {baseline / 2**20:.0f} MiB after "
        f"5 batches, peak {peak / 2**20:.0f} MiB (+{growth_mb:.1f} MiB; bound {cache_mb} MiB cache + {slack_mb} MiB slack)"
    )
    assert len(rss) == 2 * len(loader)
    assert growth_mb < cache_mb + slack_mb


# ---------------------------------------------------------------------------------------- S3
@pytest.mark.slow
def test_s3_dataset_streams_through_a_bounded_checked_cache(s3, tmp_path, caplog):
    fs, options = s3
    local = generate_planar_arm(tmp_path / "local", n_episodes=5, image_size=32, seed=1)
    fs.put(str(local), "robots/arm", recursive=True)
    files = [p for p in local.rglob("*") if p.is_file() and "meta" not in p.parts]
    total = sum(p.stat().st_size for p in files)
    limit = int(total * 0.6)  # the cache cannot hold the whole dataset: it must evict
    settings = dict(batch_size=8, val_episodes=1, order={"shuffle_buffer": 32})
    with caplog.at_level(logging.INFO, logger="uma_lightning.data.datamodule"):
        remote = RobotDataModule(
            root="s3://robots/arm",
            storage={"options": options, "cache_dir": str(tmp_path / "cache"), "cache_gb": limit / 2**30},
            loader={"num_workers": 1, "persistent_workers": False},
            **settings,
        )
        remote.setup("fit")
        remote_batches = list(remote.train_dataloader())
    assert "started with forkserver (remote storage clients run threads" in caplog.text
    local_dm = RobotDataModule(root=str(local), loader={"num_workers": 0, "persistent_workers": False}, **settings)
    local_dm.setup("fit")
    local_batches = list(local_dm.train_dataloader())
    assert remote.spec == local_dm.spec and len(remote_batches) == len(local_batches) > 0
    for a, b in zip(remote_batches, local_batches):
        for key in ("images", "state", "actions", "sample_id", "episode_index"):
            assert torch.equal(a[key], b[key]), key
    cached = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*") if p.suffix in (".mp4", ".parquet"))
    assert 0 < cached <= limit

    # Integrity: a damaged cached copy is noticed and downloaded again.
    cache = ShardCache(tmp_path / "check", limit, fs, prefetch_threads=1)
    url = "robots/arm/data/chunk-000/episode_000000.parquet"
    original = (local / "data/chunk-000/episode_000000.parquet").read_bytes()
    path = cache.get(url)
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))  # same size, different content
    fresh = ShardCache(tmp_path / "check", limit, fs)  # another process: checks the SHA-256 on first use
    with caplog.at_level(logging.WARNING, logger="uma_lightning.data.storage"):
        assert fresh.get(url).read_bytes() == original
    assert "is damaged (its SHA-256 differs" in caplog.text and fresh.downloads == 1
    path.write_bytes(original[:100])
    assert fresh.get(url).read_bytes() == original and fresh.downloads == 2  # truncated: size check

    # Prefetch downloads in the background; the later get finds the file ready.
    video = f"robots/arm/videos/chunk-000/{CAMERA}/episode_000001.mp4"
    cache.prefetch([video])
    cache._pending[video].result(timeout=60)
    before = cache.downloads
    assert cache.get(video).read_bytes() == (local / f"videos/chunk-000/{CAMERA}/episode_000001.mp4").read_bytes()
    assert cache.downloads == before

    with pytest.raises(StorageError, match=r"episode_000001\.mp4 is .* larger than the whole shard cache"):
        ShardCache(tmp_path / "tiny", 100, fs).get(video)
    fs.rm("robots/arm/data/chunk-000/episode_000002.parquet")
    meta = LeRobotMetadata.load(Storage("s3://robots/arm", tmp_path / "cache2", storage_options=options))
    with pytest.raises(
        DatasetError,
        match=r"episode 2: data file s3://robots/arm/data/chunk-000/episode_000002\.parquet: .* is missing",
    ):
        meta.read_episode(2)
