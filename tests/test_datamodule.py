"""The frame dataset, the embedded-dataset cache, and RobotDataModule's loaders."""

import fcntl
import hashlib
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import uma_lightning.data.dataset as dataset_module
import uma_lightning.data.generate as generate_module
from uma_lightning.data import (
    CAMERA,
    DatasetError,
    DataSpec,
    FrameDataset,
    LeRobotMetadata,
    Normalizer,
    RobotDataModule,
    VideoError,
    VideoReader,
    decode_video,
    encode_video,
    ensure_dataset,
    split_episodes,
)
from uma_lightning.data.cache import LRU
from uma_lightning.data.generate import dataset_dirname, generate_planar_arm
from uma_lightning.data.lerobot import ACTION_KEY

BATCH_KEYS = {
    "images",
    "obs_mask",
    "state",
    "actions",
    "action_mask",
    "instruction",
    "episode_index",
    "frame_index",
    "sample_id",
    "dataset_index",
    "environment_state",  # the embedded dataset records one
}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UMA_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return generate_planar_arm(tmp_path_factory.mktemp("data") / "tiny", n_episodes=3, image_size=32, seed=0)


@pytest.fixture(scope="module")
def meta(tiny_root):
    return LeRobotMetadata.load(tiny_root)


def file_hashes(root) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


# ---------------------------------------------------------------------------------------- samples
def test_history_and_chunk_are_padded_and_masked_at_episode_edges(meta):
    # Episodes 0 and 2: windows must not leak across the boundary between them.
    ds = FrameDataset(meta, episodes=(0, 2), n_obs_steps=3, action_horizon=5)
    raw = meta.read_episode(2)
    length = len(raw.state)
    first_row = meta.episodes[0].length
    frames = decode_video(meta.video_path(2, CAMERA)).frames
    state = ds.state_normalizer.normalize(raw.state)
    action = ds.action_normalizer.normalize(raw.action)
    T, F = True, False

    def check(t, obs_frames, obs_mask, action_frames, action_mask):
        sample = ds[first_row + t]
        assert sample["obs_mask"].tolist() == obs_mask
        assert sample["action_mask"].tolist() == action_mask
        assert np.allclose(sample["state"].numpy(), state[obs_frames], atol=1e-6)
        assert np.allclose(sample["actions"].numpy(), action[action_frames], atol=1e-6)
        assert np.array_equal(sample["images"].numpy()[:, 0], frames[obs_frames])
        assert sample["episode_index"].item() == 2 and sample["frame_index"].item() == t
        assert sample["sample_id"].item() == raw.global_index[t]
        assert sample["instruction"] == meta.tasks[raw.task_index[t]]

    last = length - 1
    check(0, [0, 0, 0], [F, F, T], [0, 1, 2, 3, 4], [T] * 5)
    check(1, [0, 0, 1], [F, T, T], [1, 2, 3, 4, 5], [T] * 5)
    check(5, [3, 4, 5], [T, T, T], [5, 6, 7, 8, 9], [T] * 5)
    check(last - 2, [last - 4, last - 3, last - 2], [T] * 3, [last - 2, last - 1, last, last, last], [T, T, T, F, F])
    check(last, [last - 2, last - 1, last], [T] * 3, [last] * 5, [T, F, F, F, F])


def test_sample_dtypes_and_shapes(meta):
    sample = FrameDataset(meta, n_obs_steps=2, action_horizon=4, environment_state=True)[0]
    assert set(sample) == BATCH_KEYS
    assert set(FrameDataset(meta, n_obs_steps=2, action_horizon=4)[0]) == BATCH_KEYS - {
        "environment_state"
    }  # only when asked for
    assert sample["images"].dtype == torch.uint8 and sample["images"].shape == (2, 1, 32, 32, 3)
    assert sample["state"].dtype == torch.float32 and sample["state"].shape == (2, 5)
    assert sample["actions"].dtype == torch.float32 and sample["actions"].shape == (4, 3)
    assert sample["obs_mask"].dtype == torch.bool and sample["action_mask"].dtype == torch.bool
    assert all(
        sample[k].dtype == torch.int64 and sample[k].shape == () for k in ("episode_index", "frame_index", "sample_id")
    )


@pytest.mark.parametrize(
    "mode, low, high, reference_low, reference_high",
    [("quantile", "q01", "q99", -1.0, 1.0), ("min_max", "min", "max", -1.0, 1.0), ("mean_std", "mean", None, 0.0, 1.0)],
)
def test_normalisation_maps_reference_statistics(meta, mode, low, high, reference_low, reference_high):
    stats = meta.stats[ACTION_KEY]
    normalizer = Normalizer.from_stats(mode, stats, ACTION_KEY)
    upper = stats[high] if high else stats["mean"] + stats["std"]
    assert np.allclose(normalizer.normalize(stats[low].astype(np.float32)), reference_low, atol=1e-5)
    assert np.allclose(normalizer.normalize(upper.astype(np.float32)), reference_high, atol=1e-5)

    raw = meta.read_episode(0).action
    assert np.allclose(normalizer.denormalize(normalizer.normalize(raw)), raw, atol=1e-6)
    as_tensor = normalizer.normalize(torch.from_numpy(raw.copy()))
    assert as_tensor.dtype == torch.float32 and np.allclose(as_tensor.numpy(), normalizer.normalize(raw))


def test_dataset_normalises_with_the_stored_statistics(meta):
    ds = FrameDataset(meta, state_norm="mean_std", action_norm="min_max", action_horizon=1)
    state = torch.stack([ds[i]["state"][0] for i in range(len(ds))]).numpy()
    action = torch.stack([ds[i]["actions"][0] for i in range(len(ds))]).numpy()
    # Statistics cover every episode, so over the whole dataset:
    assert np.allclose(state.mean(0), 0.0, atol=1e-5) and np.allclose(state.std(0), 1.0, atol=1e-4)
    assert np.allclose(action.min(0), -1.0, atol=1e-6) and np.allclose(action.max(0), 1.0, atol=1e-6)

    quantile = FrameDataset(meta, action_norm="quantile", action_horizon=1)
    action = torch.stack([quantile[i]["actions"][0] for i in range(len(quantile))]).numpy()
    assert (np.abs(action) > 1.0 + 1e-6).mean(0).max() <= 0.021  # only the 1% tails on each side lie outside


def test_unknown_normalisation_mode_is_rejected(meta):
    with pytest.raises(ValueError, match="unknown normalisation mode 'zscore' for 'observation.state'"):
        FrameDataset(meta, state_norm="zscore")


def test_each_file_is_opened_once_per_process_while_it_fits_the_lru(meta, monkeypatch):
    opened = []

    def counting_reader(path, *settings, **named):
        opened.append(path)
        return VideoReader(path, *settings, **named)

    monkeypatch.setattr(dataset_module, "VideoReader", counting_reader)
    ds = FrameDataset(meta, n_obs_steps=2, max_open_files=8)
    for row in np.random.default_rng(0).permutation(len(ds)):
        ds[int(row)]
    assert sorted(opened) == [meta.video_path(e, CAMERA) for e in range(3)]

    # With room for one open file, random access reopens files, and never holds more than one.
    opened.clear()
    ds = FrameDataset(meta, n_obs_steps=2, max_open_files=1, decode_cache_mb=0)
    rows = np.random.default_rng(1).permutation(len(ds))[:30]
    for row in rows:
        ds[int(row)]
        assert len(ds._files) <= 1
    assert len(opened) > 3


def test_decoded_cache_stays_within_its_byte_bound(meta):
    frame_bytes = 32 * 32 * 3
    ds = FrameDataset(meta, n_obs_steps=3, decode_cache_mb=40 * frame_bytes / 2**20)
    reference = FrameDataset(meta, n_obs_steps=3, decode_cache_mb=0)
    for row in np.random.default_rng(0).permutation(len(ds)):
        sample = ds[int(row)]
        assert ds._decoded.total <= ds.cache_bytes
        assert torch.equal(sample["images"], reference[int(row)]["images"])  # cached frames are the right ones
    assert len(ds._decoded) > 0


def test_held_values_leave_the_cache_only_when_nothing_else_is_left():
    cache = LRU(3)
    cache.hold("b")  # before it is kept: a later request is known
    for key in "abc":
        cache.put(key, key)
    cache.hold("a")
    cache.put("d", "d")  # c is the only value not held
    assert {k for k in "abcd" if k in cache} == {"a", "b", "d"}
    cache.hold("d")
    cache.put("e", "e")  # the only value not held: it goes at once
    assert {k for k in "abcde" if k in cache} == {"a", "b", "d"}
    cache.hold("e")
    cache.put("e", "e")  # everything held: the least recently used goes
    assert {k for k in "abcde" if k in cache} == {"a", "d", "e"}
    cache.hold("a")  # twice now: one release leaves it held
    cache.release("a")
    cache.release("d")
    cache.release("x")  # never held: nothing changes
    cache.put("f", "f")  # d and f are not held, d the older
    assert {k for k in "abcdef" if k in cache} == {"a", "e", "f"}
    assert cache.total == 3 and len(cache) == 3 and cache.held_cost == 2  # a and e
    for key in "ae":
        cache.release(key)
    cache.hold("e")
    cache.put("g", "g")  # f goes: a released counts as used after it
    assert {k for k in "aefg" if k in cache} == {"a", "e", "g"} and cache.held_cost == 1
    cache.clear()
    assert cache.total == 0 and cache.held_cost == 0


def test_missing_video_frame_is_an_error_naming_file_and_timestamp(tiny_root, tmp_path):
    root = shutil.copytree(tiny_root, tmp_path / "copy")
    meta = LeRobotMetadata.load(root)
    video_path = meta.video_path(0, CAMERA)
    frames = decode_video(video_path).frames
    encode_video(frames[:-2], video_path, meta.fps)  # the video now lacks the episode's last two frames
    ds = FrameDataset(meta, episodes=[0])
    ds[0]
    last = len(frames) - 1
    with pytest.raises(
        VideoError, match=rf"{re.escape(str(video_path))}: no frame at timestamp {last / meta.fps:.6f}s"
    ):
        ds[last]


def test_truncated_video_is_an_error_naming_the_file(tiny_root, tmp_path):
    root = shutil.copytree(tiny_root, tmp_path / "copy")
    meta = LeRobotMetadata.load(root)
    video_path = meta.video_path(1, CAMERA)
    video_path.write_bytes(video_path.read_bytes()[:500])
    with pytest.raises(VideoError, match=re.escape(str(video_path))):
        FrameDataset(meta, episodes=[1])[0]


# ---------------------------------------------------------------------------------------- embedded dataset
def test_generation_is_deterministic(tmp_path):
    first = ensure_dataset(n_episodes=2, image_size=32, seed=3, cache_dir=tmp_path / "a")
    second = ensure_dataset(n_episodes=2, image_size=32, seed=3, cache_dir=tmp_path / "b")
    other_seed = ensure_dataset(n_episodes=2, image_size=32, seed=4, cache_dir=tmp_path / "a")
    hashes = file_hashes(first)
    assert len(hashes) == 2 + 2 + 5  # parquet files, videos, meta files
    assert first.name == second.name and hashes == file_hashes(second)
    episode = "data/chunk-000/episode_000000.parquet"
    assert hashes[episode] != file_hashes(other_seed)[episode]


def test_cached_dataset_is_reused_from_the_default_cache_dir(tmp_path, monkeypatch):
    root = ensure_dataset(n_episodes=1, image_size=32)
    assert root.parent == tmp_path / "cache" and root.name == dataset_dirname("planar_arm", 1, 32, 0)
    monkeypatch.setattr(generate_module, "generate_planar_arm", lambda *args: pytest.fail("regenerated"))
    assert ensure_dataset(n_episodes=1, image_size=32) == root


@pytest.mark.slow  # two new interpreters
def test_concurrent_processes_generate_the_dataset_once(tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
        "from uma_lightning.data.generate import ensure_dataset\n"
        "print(ensure_dataset(n_episodes=3, image_size=32, seed=5, cache_dir=sys.argv[1]))\n"
    )
    lock_path = cache / (dataset_dirname("planar_arm", 3, 32, 5) + ".lock")
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    # Hold the lock until both processes are waiting for it, so they really do contend.
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(cache)], stdout=subprocess.PIPE, stderr=log.open("w"), text=True
            )
            for log in logs
        ]
        deadline = time.monotonic() + 120
        while not all("waiting for another process" in log.read_text() for log in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), [
                text.read_text() for text in logs
            ]
            time.sleep(0.1)
        fcntl.flock(lock, fcntl.LOCK_UN)
    outputs = [p.communicate(timeout=120)[0].strip() for p in processes]
    stderr = [log.read_text() for log in logs]
    assert [p.returncode for p in processes] == [0, 0], stderr
    assert len(set(outputs)) == 1
    assert sum(text.count("generating 3 planar-arm episodes") for text in stderr) == 1
    assert sum("generated by another process" in text for text in stderr) == 1
    meta = LeRobotMetadata.load(outputs[0])
    assert len(meta.episodes) == 3 and all(meta.read_episode(e) for e in range(3))
    assert not list(cache.glob("*.partial"))


# ---------------------------------------------------------------------------------------- data module
def test_datamodule_worker_batches_follow_the_contract(tiny_root):
    dm = RobotDataModule(
        root=str(tiny_root),
        n_obs_steps=2,
        action_horizon=4,
        batch_size=8,
        val_episodes=1,
        loader={"num_workers": 2, "persistent_workers": False},
    )
    assert dm.spec == DataSpec(
        cameras=(CAMERA,),
        image_size=(32, 32),
        state_dim=5,
        action_dim=3,
        n_obs_steps=2,
        action_horizon=4,
        fps=10.0,
        environment_state_dim=2,
    )
    dm.setup("fit")
    for batch in (next(iter(dm.train_dataloader())), next(iter(dm.val_dataloader()))):
        assert set(batch) == BATCH_KEYS
        expected = {
            "images": (torch.uint8, (8, 2, 1, 32, 32, 3)),
            "obs_mask": (torch.bool, (8, 2)),
            "state": (torch.float32, (8, 2, 5)),
            "actions": (torch.float32, (8, 4, 3)),
            "action_mask": (torch.bool, (8, 4)),
            "episode_index": (torch.int64, (8,)),
            "frame_index": (torch.int64, (8,)),
            "sample_id": (torch.int64, (8,)),
            "environment_state": (torch.float32, (8, 2)),
        }
        assert {k: (batch[k].dtype, tuple(batch[k].shape)) for k in expected} == expected
        assert isinstance(batch["instruction"], list) and len(batch["instruction"]) == 8
        assert all(isinstance(text, str) and text for text in batch["instruction"])


def test_datamodule_splits_shuffles_reproducibly_and_denormalises(tiny_root, meta):
    def datamodule(seed):
        dm = RobotDataModule(
            root=str(tiny_root), batch_size=16, loader={"num_workers": 0}, val_episodes=1, order={"seed": seed}
        )
        dm.setup("fit")
        return dm

    dm = datamodule(seed=1)
    assert (dm.train_episodes, dm.val_episodes) == ([0, 1], [2])
    n_train = meta.episodes[0].length + meta.episodes[1].length
    assert len(dm.train_dataloader()) == n_train // 16  # the last partial batch is dropped

    order = torch.cat([b["sample_id"] for b in dm.train_dataloader()])
    assert order.tolist() == torch.cat([b["sample_id"] for b in datamodule(seed=1).train_dataloader()]).tolist()
    assert order.tolist() != torch.cat([b["sample_id"] for b in datamodule(seed=2).train_dataloader()]).tolist()
    assert order.tolist() != sorted(order.tolist())

    val_ids = torch.cat([b["sample_id"] for b in dm.val_dataloader()]).tolist()
    assert val_ids == meta.read_episode(2).global_index.tolist()  # in order, nothing dropped

    batch = next(iter(dm.train_dataloader()))
    raw_actions = np.concatenate([meta.read_episode(e).action for e in range(3)])
    expected = raw_actions[batch["sample_id"].numpy()]  # the chunk starts at the sample's own frame
    assert torch.allclose(dm.denormalize_actions(batch["actions"][:, 0]), torch.from_numpy(expected), atol=1e-5)
    raw_states = np.concatenate([meta.read_episode(e).state for e in range(3)])
    state = dm.normalize_state(torch.from_numpy(raw_states[batch["sample_id"].numpy()]))
    assert torch.allclose(state, batch["state"][:, -1], atol=1e-5)


def test_datamodule_generates_the_embedded_dataset_when_root_is_none(tmp_path):
    dm = RobotDataModule(generation={"n_episodes": 2, "image_size": 32}, val_episodes=0, loader={"num_workers": 0})
    assert dm.root.parent == tmp_path / "cache"
    assert dm.spec.image_size == (32, 32) and dm.spec.cameras == (CAMERA,)
    dm.setup("fit")
    assert dm.val_dataloader() == []  # no validation episodes: Lightning skips validation


def test_datamodule_rejects_a_bad_root(tmp_path):
    with pytest.raises(DatasetError, match=re.escape(f"dataset root {tmp_path / 'nope'} is not a directory")):
        RobotDataModule(root=str(tmp_path / "nope"))
    with pytest.raises(DatasetError, match=re.escape(f"{tmp_path / 'meta' / 'info.json'} is missing")):
        RobotDataModule(root=str(tmp_path))


def test_split_episodes():
    assert split_episodes(10, 0.2) == (list(range(8)), [8, 9])
    assert split_episodes(10, 0.01) == (list(range(9)), [9])  # a positive fraction holds out at least one
    assert split_episodes(10, 3) == (list(range(7)), [7, 8, 9])
    assert split_episodes(10, 0) == (list(range(10)), [])
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\)"):
        split_episodes(10, 1.0)
    with pytest.raises(ValueError, match="leave at least one of 2 episodes"):
        split_episodes(2, 2)
