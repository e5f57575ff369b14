"""Video at camera sizes: the realistic generator's codecs and GOPs, the loader's forward decoding
(frames identical to the decoder's, any worker count, with or without the decoded-frame store,
resized in the decoder), the store's checks (stale, corrupt, size bound), and bounded memory."""

import json
import logging
import re
import resource
import shutil
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch

from uma_lightning.data import LeRobotMetadata, RobotDataModule
from uma_lightning.data.dataset import HELD_SHARE
from uma_lightning.data.frame_store import FrameStoreError, default_store_dir, open_store
from uma_lightning.data.generate import RealisticPreset, generate_realistic
from uma_lightning.data.order import EpochOrder
from uma_lightning.data.video import VideoError, VideoReader, decode_frames_at, decoder_threads, encode_video
from uma_lightning.tools.data import main as data_tool


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Tiny realistic datasets: 2 cameras of 32x32, 3 episodes of 20 frames; H.264 at GOP 2, AV1 at a long GOP, v3.0."""
    base = tmp_path_factory.mktemp("realistic")
    presets = {
        "h264-gop2": RealisticPreset(n_episodes=3, seconds=20 / 30, image_size=32, n_cameras=2, codec="h264", gop=2),
        "av1-gop10": RealisticPreset(
            n_episodes=3, seconds=20 / 30, image_size=32, n_cameras=2, codec="av1", gop=10, version="v3.0"
        ),
    }
    return {name: generate_realistic(base / name, preset) for name, preset in presets.items()}


def datamodule(root, **loader):
    dm = RobotDataModule(
        root=str(root),
        batch_size=4,
        n_obs_steps=2,
        val_episodes=0,
        loader={"num_workers": 0, "persistent_workers": False, "plan_batches": 3, **loader},
        order={"shuffle_buffer": 8, "partitions": 2},
    )
    dm.setup("fit")
    return dm


def expected_images(meta, batch, size=None):
    """What the decoder alone returns for each sample's frames: [B, n_obs, cameras, H, W, 3]."""
    images = []
    for episode, t in zip(batch["episode_index"].tolist(), batch["frame_index"].tolist()):
        timestamps = meta.read_episode(episode).timestamp.astype(np.float64)
        steps = timestamps[np.clip(t + np.array([-1, 0]), 0, len(timestamps) - 1)]
        per_camera = [
            decode_frames_at(
                meta.video_path(episode, camera), meta.episodes[episode].videos[camera][1] + steps, size=size
            )
            for camera in meta.cameras
        ]
        images.append(np.stack(per_camera, axis=1))
    return torch.from_numpy(np.stack(images))


@pytest.mark.parametrize("name", ["h264-gop2", "av1-gop10"])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_loader_returns_the_decoders_frames_bit_for_bit(datasets, name, workers):
    dm = datamodule(datasets[name], num_workers=workers, frame_store="off")
    meta = dm.metadata[0]
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) == 14  # 2 partitions of 30 samples, 7 batches each
    for batch in batches:
        assert torch.equal(batch["images"], expected_images(meta, batch))


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_worker_refills_an_image_buffer_only_once_training_has_let_go_of_it(datasets, start):
    """Persistent workers reuse their shared-memory image buffers across batches and epochs, and never
    one a batch still held in the training process uses: kept batches keep their frames."""
    dm = datamodule(
        datasets["h264-gop2"], num_workers=1, persistent_workers=True, frame_store="off", multiprocessing_context=start
    )
    meta, loader = dm.metadata[0], dm.train_dataloader()
    kept = list(loader) + list(loader)  # two epochs, every batch held
    pool = loader.stream.buffer_pool
    assert int(pool.allocations.sum()) == len(kept) == 28  # nothing refilled under a held batch
    for batch in kept:
        assert torch.equal(batch["images"], expected_images(meta, batch))
    del kept, batch
    for _epoch in range(3):  # now each batch is dropped after its check: the buffers go round
        for batch in loader:
            assert torch.equal(batch["images"], expected_images(meta, batch))
        del batch
    # 42 batches more, none made: the training side holds at most 2, the worker has 2 in hand (of 6 slots).
    assert int(pool.allocations.sum()) == 28
    for stop_after in (2, 5):  # a pass stopped early leaves its loaded-ahead batches' slots to the next
        for k, _batch in enumerate(loader):
            if k == stop_after:
                break
        del _batch  # held, it would keep its buffer's slot through the next pass
    for batch in loader:
        assert torch.equal(batch["images"], expected_images(meta, batch))
    assert int(pool.allocations.sum()) == 28


def test_a_cache_too_small_for_an_epoch_still_decodes_each_frame_once(datasets, monkeypatch):
    """The decoded-frame cache keeps the frames the next batches show before the others: in 0.2 MB
    (about 60 of these frames and the episodes' columns) the epoch converts each of its 120 frames
    once. Plain least-recently-used eviction converted 136."""
    converted = []
    to_rgb = VideoReader._rgb
    monkeypatch.setattr(
        VideoReader, "_rgb", lambda reader, frame: converted.append((reader.path, frame.pts)) or to_rgb(reader, frame)
    )
    dm = datamodule(datasets["h264-gop2"], frame_store="off", decode_cache_mb=0.2)
    meta = dm.metadata[0]
    batches = list(dm.train_dataloader())
    frames = sum(meta.episodes[e].length for e in range(3)) * len(meta.cameras)
    assert len(converted) == len(set(converted)) == frames == 120
    for batch in batches:
        assert torch.equal(batch["images"], expected_images(meta, batch))


def test_the_held_window_stops_at_three_quarters_of_the_cache_and_grows_again_as_batches_leave(datasets):
    dm = datamodule(datasets["h264-gop2"], frame_store="off", decode_cache_mb=0.25)  # 85 frames of 32x32
    stream, source = dm.train_dataloader().stream, dm.train_sets[0]
    order = EpochOrder(stream.layouts, stream.config, epoch=0)
    held = deque()
    stream._hold_frames(order, range(9), held)  # nothing decoded yet: nothing kept is held
    assert len(held) == 9 and source.room_to_hold()
    source.prepare([row for rows in held for row in rows[0]])  # decode the window's frames: held ones stay
    bound = HELD_SHARE * source.cache_bytes
    assert source._caches()[1].held_cost >= bound and not source.room_to_hold()
    stream._hold_frames(order, range(9, 11), held)  # no room: the window stops short
    assert len(held) == 9
    current = deque()
    stream._hold_frames(order, range(20, 22), current)  # a window's first batch is held even without room
    assert len(current) == 1
    stream._release_frames(current.popleft())
    left = 0
    while not source.room_to_hold():  # batches built and let go
        stream._release_frames(held.popleft())
        left += 1
    assert source._caches()[1].held_cost < bound and 0 < left < 9
    stream._hold_frames(order, range(9, 10), held)
    assert len(held) == 10 - left


def test_frames_are_resized_in_the_decoder_when_the_loader_asks_for_smaller_images(datasets):
    dm = datamodule(datasets["h264-gop2"], image_size=16, frame_store="off")
    assert dm.spec.image_size == (16, 16)
    batch = next(iter(dm.train_dataloader()))
    assert batch["images"].shape[-3:] == (16, 16, 3)
    assert torch.equal(batch["images"], expected_images(dm.metadata[0], batch, size=(16, 16)))


def test_decoder_threads_follow_the_frame_size_and_the_worker_count():
    assert decoder_threads(2, 224, 224, cpus=16) == 1  # small frames: one thread
    assert decoder_threads(2, 480, 640, cpus=16) == 3
    assert decoder_threads(8, 1080, 1920, cpus=16) == 2  # the cores shared among the workers


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("UMA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("name", ["h264-gop2", "av1-gop10"])
@pytest.mark.parametrize("workers", [0, 2])
def test_the_frame_store_serves_the_decoders_frames_and_says_so(datasets, cache_dir, name, workers, caplog):
    root = datasets[name]
    assert data_tool(["cache", str(root), "--image-size", "32"]) == 0
    with caplog.at_level(logging.INFO, logger="uma_lightning.data.datamodule"):
        dm = datamodule(root, num_workers=workers)
    assert sum("frame store" in r.getMessage() and "not decoded" in r.getMessage() for r in caplog.records) == 1
    assert dm.train_sets[0].frame_store is not None
    for batch in dm.train_dataloader():
        assert torch.equal(batch["images"], expected_images(dm.metadata[0], batch))


def test_the_store_finds_frames_by_timestamp_within_the_tolerance_and_refuses_others(datasets, cache_dir):
    root = datasets["av1-gop10"]  # v3.0: the episodes share video files, at offsets
    assert data_tool(["cache", str(root)]) == 0
    meta = LeRobotMetadata.load(root)
    store = open_store(default_store_dir(meta, meta.image_size, cache_dir), meta)
    relative, start = meta.episodes[1].videos[meta.cameras[1]]
    frames = np.array([5, 2, 2, 19, 3, 4])
    expected = decode_frames_at(meta.video_path(1, meta.cameras[1]), start + frames / 30)
    jitter = np.array([0, 4e-5, -4e-5, 0, 0, 9e-5])
    assert np.array_equal(store.frames(relative, start + frames / 30 + jitter, 1e-4), expected)
    assert np.array_equal(
        store.frames(relative, start + np.array([2, 3]) / 30, 1e-4), expected[[1, 4]]
    )  # a run: one slice
    for missing in (start + 2.5 / 30, start + 100 / 30, -1.0):
        with pytest.raises(
            VideoError, match=rf"{re.escape(str(store.directory))}.*no stored frame at timestamp {missing:.6f}s"
        ):
            store.frames(relative, np.array([start, missing]), 1e-4)


def test_a_store_whose_source_changed_is_not_used(datasets, cache_dir, tmp_path, caplog):
    root = shutil.copytree(datasets["h264-gop2"], tmp_path / "data")
    assert data_tool(["cache", str(root)]) == 0
    meta = LeRobotMetadata.load(root)
    assert open_store(default_store_dir(meta, meta.image_size, cache_dir), meta) is not None  # silent on a valid store
    video = meta.video_path(1, meta.cameras[0])
    frames = decode_frames_at(video, np.arange(20) / 30)
    encode_video(frames[:, ::-1].copy(), video, 30)  # the same size, other pixels: the store is stale
    with caplog.at_level(logging.WARNING):
        dm = datamodule(root)
    assert dm.train_sets[0].frame_store is None
    stale = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
    assert len(stale) == 1 and str(video.relative_to(root)) in stale[0]
    batch = next(iter(dm.train_dataloader()))
    assert torch.equal(batch["images"], expected_images(dm.metadata[0], batch))  # decoded, not the old frames
    assert data_tool(["cache", str(root)]) == 0  # rebuilds it
    assert datamodule(root).train_sets[0].frame_store is not None


@pytest.mark.parametrize("damage", ["truncated-shard", "flipped-bytes", "bad-manifest"])
def test_a_corrupt_store_is_refused_naming_the_file_and_rebuilt_on_request(datasets, cache_dir, damage, capsys):
    root = datasets["h264-gop2"]
    meta = LeRobotMetadata.load(root)
    directory = default_store_dir(meta, meta.image_size, cache_dir)
    assert data_tool(["cache", str(root), "--rebuild"]) == 0
    manifest = json.loads((directory / "manifest.json").read_text())
    shard = directory / next(iter(manifest["files"].values()))["shard"]
    if damage == "truncated-shard":
        shard.write_bytes(shard.read_bytes()[:-100])
        named = shard
    elif damage == "flipped-bytes":
        data = bytearray(shard.read_bytes())
        data[10] ^= 0xFF
        shard.write_bytes(bytes(data))
        named = shard
    else:
        (directory / "manifest.json").write_text("{not json")
        named = directory / "manifest.json"
    with pytest.raises(FrameStoreError, match=str(named)):
        datamodule(root)
    capsys.readouterr()
    assert data_tool(["cache", str(root)]) == 2
    assert str(named) in capsys.readouterr().err
    assert data_tool(["cache", str(root), "--rebuild"]) == 0
    assert datamodule(root).train_sets[0].frame_store is not None


def test_the_store_keeps_to_its_size_bound_and_stores_only_the_cameras_asked(datasets, cache_dir, capsys):
    root = datasets["h264-gop2"]
    assert data_tool(["cache", str(root), "--max-gb", "0.0001", "--rebuild"]) == 2
    assert "over the bound" in capsys.readouterr().err
    meta = LeRobotMetadata.load(root)
    assert data_tool(["cache", str(root), "--cameras", meta.cameras[1], "--rebuild"]) == 0
    dm = datamodule(root)
    assert dm.train_sets[0].frame_store.cameras == (meta.cameras[1],)
    batch = next(iter(dm.train_dataloader()))  # one camera from the store, the other decoded
    assert torch.equal(batch["images"], expected_images(meta, batch))


def test_rss_stays_flat_over_two_epochs(datasets):
    dm = datamodule(datasets["h264-gop2"], frame_store="off", decode_cache_mb=1)
    loader = dm.train_dataloader()
    peaks = []
    for _ in range(3):
        for _ in loader:
            pass
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    # The first epoch fills the caches; the second and third add (next to) nothing.
    assert peaks[2] - peaks[1] < 4 * 1024, peaks  # KiB


def test_reader_reaches_ahead_by_the_longest_gop_instead_of_seeking(datasets):
    meta = LeRobotMetadata.load(datasets["av1-gop10"])  # v3.0: the episodes' 60 frames in one file, a keyframe every 10
    reader = VideoReader(meta.video_path(0, meta.cameras[0]))
    seeks = []
    seek = reader._seek
    reader._seek = lambda target: (seeks.append(target), seek(target))
    first = reader.frames_at(np.array([0.0, 5 / 30, 11 / 30]), 1e-4)  # passes the keyframe at frame 10
    assert reader._gop_frames == 10
    later = reader.frames_at(np.array([21 / 30, 31 / 30]), 1e-4)  # 10 frames ahead: more than 8, within a GOP
    assert len(seeks) == 1  # only the first request seeks
    reader.close()
    expected = decode_frames_at(meta.video_path(0, meta.cameras[0]), np.array([0.0, 5, 11, 21, 31]) / 30)
    assert np.array_equal(np.concatenate([first, later]), expected)


def test_gpu_decode_script_cpu_smoke_falls_back_to_the_cpu_and_says_why(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "video_decode.py"
    out = subprocess.run(
        [sys.executable, str(script), "--cpu-smoke"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "=== decoder choice: cpu (no GPU decoder" in out.stdout
    assert "all checks passed" in out.stdout and "FAILED" not in out.stdout


def test_reader_seeks_back_for_the_frame_it_decoded_last(datasets):
    """Its last frame, asked for again at a time a hair later (within tolerance) once the cache has
    dropped it: the decoder is past it, so decoding on would miss it."""
    meta = LeRobotMetadata.load(datasets["h264-gop2"])
    path = meta.video_path(0, meta.cameras[0])
    reader = VideoReader(path)
    first = reader.frames_at(np.array([5 / 30]), 1e-4)
    again = reader.frames_at(np.array([5 / 30 + 5e-5]), 1e-4)
    reader.close()
    assert np.array_equal(first, again) and np.array_equal(first, decode_frames_at(path, np.array([5 / 30])))


@pytest.mark.slow
def test_the_frame_store_works_behind_the_s3_shard_cache(datasets, cache_dir, s3, tmp_path, caplog):
    fs, options = s3
    local = datasets["av1-gop10"]  # v3.0: episodes share video files
    fs.put(str(local), "robots/store-source", recursive=True)
    remote = ["--storage-options", json.dumps(options), "--cache-dir", str(tmp_path / "shards")]
    assert data_tool([*remote, "cache", "s3://robots/store-source"]) == 0

    def remote_datamodule():
        dm = RobotDataModule(
            root="s3://robots/store-source",
            batch_size=4,
            n_obs_steps=2,
            val_episodes=0,
            loader={"num_workers": 0, "persistent_workers": False},
            order={"shuffle_buffer": 8, "partitions": 2},
            storage={"options": options, "cache_dir": str(tmp_path / "shards")},
        )
        dm.setup("fit")
        return dm

    dm = remote_datamodule()
    assert dm.train_sets[0].frame_store is not None
    meta = LeRobotMetadata.load(local)
    for batch in dm.train_dataloader():
        assert torch.equal(batch["images"], expected_images(meta, batch))
    # Another object under the same name: its ETag changes, so the store is stale and not used.
    video = meta.episodes[0].videos[meta.cameras[0]][0]
    fs.pipe(f"robots/store-source/{video}", (local / video).read_bytes() + b"\0")
    with caplog.at_level(logging.WARNING):
        assert remote_datamodule().train_sets[0].frame_store is None
    assert any("stale" in r.getMessage() and video in r.getMessage() for r in caplog.records)


def test_the_loader_benchmark_trains_with_the_settings_it_is_given(monkeypatch):
    """Its data-wait figure comes from `uma fit` on the realistic data with the small model: the
    overrides must reach the run (they once did not, and it measured the default recipe)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from data_loader import recipe_wait_fraction

    with pytest.raises(subprocess.CalledProcessError) as refused:
        recipe_wait_fraction(1, ("--model.init_args.network.size", "no-such-size"))
    assert "no-such-size" in refused.value.stderr
