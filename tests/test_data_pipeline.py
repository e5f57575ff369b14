"""The data pipeline: LeRobot v3.0, the `uma data` tool, the seeded resumable order (worker and rank
counts, Lightning checkpoints), mixtures, bad data, and host-to-device prefetch."""

import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import time

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from uma_lightning.callbacks import BadDataCounter, StepTimeBreakdown
from uma_lightning.data import (
    CAMERA,
    DatasetError,
    DevicePrefetcher,
    EpochOrder,
    FrameDataset,
    LeRobotMetadata,
    OrderConfig,
    RobotDataModule,
    VideoError,
    Window,
)
from uma_lightning.data.generate import generate_planar_arm
from uma_lightning.data.loader import BatchStream, RobotDataLoader, _killed_worker
from uma_lightning.data.order import SourceLayout, buffer_shuffle
from uma_lightning.tools.data import main as data_tool
from uma_lightning.tracking import MLflowLogger


@pytest.fixture(scope="module")
def v21(tmp_path_factory):
    return generate_planar_arm(tmp_path_factory.mktemp("data") / "v21", n_episodes=4, image_size=32, seed=0)


@pytest.fixture(scope="module")
def v30(v21, tmp_path_factory):
    target = tmp_path_factory.mktemp("data") / "v30"
    # Tiny files force several episodes per file and several files.
    assert data_tool(["convert", str(v21), str(target), "--to", "v3.0", "--data-file-mb", "0.004"]) == 0
    return target


def keys_of(batches):
    """(dataset, episode, frame) of every sample, in order."""
    return [
        (int(d), int(e), int(f))
        for b in batches
        for d, e, f in zip(b["dataset_index"], b["episode_index"], b["frame_index"])
    ]


def datamodule(root, loader=(), order=(), **overrides):
    loader = {"num_workers": 0, "persistent_workers": False, **dict(loader)}
    settings = dict(
        root=str(root), batch_size=8, val_episodes=1, loader=loader, order={"shuffle_buffer": 32, **dict(order)}
    )
    settings.update(overrides)
    dm = RobotDataModule(**settings)
    dm.setup("fit")
    return dm


# ---------------------------------------------------------------------------------------- LeRobot v3.0
def test_v30_holds_many_episodes_per_file_and_reads_the_same_samples_as_v21(v21, v30):
    old, new = LeRobotMetadata.load(v21), LeRobotMetadata.load(v30)
    assert new.version == "v3.0" and len(new.episodes) == 4
    data_files = {e.data_file for e in new.episodes}
    video_files = {e.videos[CAMERA][0] for e in new.episodes}
    assert 1 < len(data_files) < 4 and len(video_files) == 1  # several episodes per file
    assert [e.videos[CAMERA][1] for e in new.episodes] == pytest.approx(
        np.concatenate([[0], np.cumsum([e.length for e in old.episodes])[:-1]]) / old.fps
    )
    assert new.tasks == old.tasks and [e.length for e in new.episodes] == [e.length for e in old.episodes]
    # tasks.parquet is what LeRobot (pandas) reads: the task text is the index.
    tasks = pq.read_table(v30 / "meta" / "tasks.parquet").to_pandas()
    assert tasks.index.name == "task" and tasks.loc[old.tasks[0], "task_index"] == 0

    a, b = (FrameDataset(meta, n_obs_steps=2, action_horizon=3, environment_state=True) for meta in (old, new))
    for row in range(0, len(a), 7):
        x, y = a[row], b[row]
        for key in (
            "state",
            "actions",
            "obs_mask",
            "action_mask",
            "episode_index",
            "frame_index",
            "sample_id",
            "environment_state",
        ):
            assert torch.equal(x[key], y[key]), key
        assert x["instruction"] == y["instruction"]
        # Re-encoded once more by the conversion: close, not equal.
        assert (x["images"].float() - y["images"].float()).abs().mean() < 4.0


def test_uma_data_info_stats_and_preview(v30, tmp_path, capsys, monkeypatch):
    preview = tmp_path / "sheet.png"
    assert data_tool(["info", str(v30), "--episode", "1", "--preview", str(preview)]) == 0
    out = capsys.readouterr().out
    assert "LeRobot v3.0" in out and "episodes  4" in out and f"preview of episode 1: {preview}" in out
    from PIL import Image

    with Image.open(preview) as image:
        assert image.size[0] > 8 * 100 and image.size[1] > 200
        pixels = np.asarray(image.convert("RGB"))
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20  # frames and plot lines, not a blank page

    # The statistics pass reads parquet columns only: it must not decode any video.
    import uma_lightning.data.video as video_module

    monkeypatch.setattr(video_module.VideoReader, "__init__", lambda *a: pytest.fail("decoded video"))
    assert data_tool(["stats", str(v30)]) == 0
    stats = json.loads(capsys.readouterr().out)
    meta = LeRobotMetadata.load(v30)
    actions = np.concatenate([meta.read_episode(e).action for e in range(4)]).astype(np.float64)
    assert np.allclose(stats["action"]["mean"], actions.mean(0)) and np.allclose(
        stats["action"]["q99"], np.quantile(actions, 0.99, axis=0)
    )

    assert data_tool(["info", str(tmp_path / "nothing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- timestamps
def test_a_requested_time_without_a_frame_is_an_error_naming_file_and_time(v21, tmp_path):
    meta = LeRobotMetadata.load(v21)
    off_grid = FrameDataset(meta, window=Window(observation=(-0.05, 0.0), action=(0.0,)))
    with pytest.raises(DatasetError, match=r"episode 0: .*episode_000000\.parquet: no frame at timestamp 0\.450000s"):
        off_grid[5]

    root = shutil.copytree(v21, tmp_path / "gap")
    path = root / "data" / "chunk-000" / "episode_000002.parquet"
    table = pq.read_table(path)
    timestamps = table.column("timestamp").to_numpy().copy()
    timestamps[10:] += 0.1  # frame 10 (t = 1.0 s) is missing: the rest are shifted by one frame
    pq.write_table(table.set_column(table.schema.get_field_index("timestamp"), "timestamp", pa.array(timestamps)), path)
    with pytest.raises(DatasetError, match=r"episode 2: .*episode_000002\.parquet: no frame at timestamp 1\.000000s"):
        LeRobotMetadata.load(root).read_episode(2)


# ---------------------------------------------------------------------------------------- order
def test_order_is_seeded_and_covers_each_sample_once_per_epoch():
    layout = SourceLayout(lengths=(40, 25, 33, 50), shards=((0, 1), (2,), (3,)))
    config = OrderConfig(seed=3, batch_size=10, partitions=3, shuffle_buffer=16)

    def epoch(config, number):
        order = EpochOrder([layout], config, number)
        return np.concatenate([order.batch(b)[1] for b in range(order.n_batches)])

    first = epoch(config, 0)
    assert len(first) == len(set(first.tolist())) == (148 // 3 // 10) * 10 * 3  # partitions drop their tails
    assert np.array_equal(first, epoch(config, 0))
    assert not np.array_equal(first, epoch(config, 1))
    assert not np.array_equal(first, epoch(OrderConfig(seed=4, batch_size=10, partitions=3, shuffle_buffer=16), 0))
    permutation = buffer_shuffle(1000, 50, np.random.default_rng(0))
    assert sorted(permutation.tolist()) == list(range(1000))
    assert np.abs(permutation - np.arange(1000)).max() > 50  # items can linger in the buffer
    assert (permutation[:100] < 150).all()  # but cannot leave before they arrive


def test_mixture_frequencies_match_the_weights():
    layouts = [
        SourceLayout((30,) * 10, tuple((i,) for i in range(10))),
        SourceLayout((20,) * 5, ((0, 1), (2, 3), (4,))),
    ]
    weights = (3.0, 1.0)
    order = EpochOrder(
        layouts, OrderConfig(seed=0, batch_size=50, partitions=4, weights=weights, samples_per_epoch=20000), 0
    )
    datasets = np.concatenate([order.batch(b)[0] for b in range(order.n_batches)])
    n, p = len(datasets), 0.25
    assert n == 20000
    assert abs((datasets == 1).sum() - n * p) < 4 * np.sqrt(n * p * (1 - p))  # within 4 sigma of the binomial count
    # The small dataset is drawn more often than it has samples: it starts new passes, each a full permutation.
    rows = np.concatenate([order.batch(b)[1] for b in range(order.n_batches)])[datasets == 1]
    assert set(rows.tolist()) == set(range(100))


def test_mixture_from_yaml_draws_each_dataset_with_its_weight_and_its_own_statistics(v21, v30, tmp_path):
    config = yaml.safe_load(
        f"""
        datasets:
          - {{root: {v21}, weight: 1.0}}
          - {{root: {v30}, weight: 3.0, action_norm: mean_std}}
        batch_size: 8
        loader:
          num_workers: 0
        val_episodes: 1
        order:
          samples_per_epoch: 240
        """
    )
    dm = RobotDataModule(**config)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    samples = keys_of(batches)
    share = np.mean([d == 1 for d, _, _ in samples])
    assert len(samples) == 240 and abs(share - 0.75) < 4 * np.sqrt(0.75 * 0.25 / 240)
    metas = [LeRobotMetadata.load(v21), LeRobotMetadata.load(v30)]
    for batch in batches[:4]:
        for k, (d, e, f) in enumerate(zip(batch["dataset_index"], batch["episode_index"], batch["frame_index"])):
            raw = metas[d].read_episode(int(e)).action[int(f)]
            assert torch.allclose(
                dm.denormalize_actions(batch["actions"][k, 0], dataset=int(d)), torch.from_numpy(raw.copy()), atol=1e-5
            )
    assert dm.normalizers[0][1].mode == "min_max" and dm.normalizers[1][1].mode == "mean_std"


# ---------------------------------------------------------------------------------------- resumption
def test_order_does_not_depend_on_workers_and_a_resumed_loader_continues_exactly(v21):
    # The reference decodes in this process first; the forked workers below must still work (fork safety).
    reference_loader = datamodule(v21).train_dataloader()
    per_epoch = len(reference_loader)
    reference = keys_of(list(reference_loader) + list(reference_loader))  # two epochs
    assert len(reference) == 2 * per_epoch * 8 and reference[: per_epoch * 8] != reference[per_epoch * 8 :]

    workers = datamodule(v21, loader={"num_workers": 2, "persistent_workers": True}).train_dataloader()
    assert keys_of(list(workers) + list(workers)) == reference  # persistent workers across the epoch boundary

    interrupted = datamodule(v21, loader={"num_workers": 2}).train_dataloader()
    stop = per_epoch + 2  # mid second epoch
    seen = []
    for batch in interrupted:
        seen.append(batch)
        if len(seen) == per_epoch:
            break
    seen += [b for _, b in zip(range(2), interrupted)]
    state = interrupted.state_dict()
    assert state == {"epoch": 1, "global_batches": 2, "bad_samples": 0}
    resumed = datamodule(v21, loader={"num_workers": 1}).train_dataloader()
    resumed.load_state_dict(state)
    assert keys_of(seen + list(resumed)) == reference
    assert len(seen) == stop


def test_global_order_is_the_same_on_any_number_of_ranks(v21):
    dm = datamodule(v21)
    single = keys_of(RobotDataLoader(BatchStream(dm.train_sets, dm.order)))
    ranks = [list(RobotDataLoader(BatchStream(dm.train_sets, dm.order, rank=r, world_size=2))) for r in range(2)]
    interleaved = [batch for step in zip(*ranks) for batch in step]
    assert keys_of(interleaved) == single[: len(interleaved) * 8]

    # Two ranks stop after 3 steps; one rank resumes from their state and sees the rest in order.
    first = RobotDataLoader(BatchStream(dm.train_sets, dm.order, rank=0, world_size=2))
    assert [b for _, b in zip(range(3), first)]
    alone = RobotDataLoader(BatchStream(dm.train_sets, dm.order))
    alone.load_state_dict(first.state_dict())
    assert keys_of(list(alone)) == single[6 * 8 :]


def test_validation_gives_every_rank_the_same_number_of_batches(v21):
    dm = datamodule(v21)
    config = dm.val_dataloader().stream.config
    single = list(RobotDataLoader(BatchStream(dm.val_sets, config), resumable=False))
    assert len(single) % 3 == 1, "the test needs a batch count that 3 ranks do not divide"
    ranks = [
        list(RobotDataLoader(BatchStream(dm.val_sets, config, rank=r, world_size=3), resumable=False)) for r in range(3)
    ]
    # Equal counts (a sharded forward would otherwise wait forever on the ranks with one batch less);
    # every batch is seen, and the ranks past the end repeat the first ones.
    assert [len(batches) for batches in ranks] == [(len(single) + 2) // 3] * 3
    interleaved = [batch for step in zip(*ranks) for batch in step]
    assert keys_of(interleaved) == keys_of(single + single[:2])


class RecordingModule(L.LightningModule):
    """A linear policy on the state; records the samples each training step saw."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(5, 3)
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen += keys_of([batch])
        return torch.nn.functional.mse_loss(self.layer(batch["state"][:, -1]), batch["actions"][:, 0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(root, steps, workdir, ckpt_path=None, logger=False, callbacks=(), checkpoints=True):
    dm = datamodule(root, loader={"num_workers": 1, "persistent_workers": True}, val_episodes=0)
    module = RecordingModule()
    if checkpoints:
        callbacks = [
            L.pytorch.callbacks.ModelCheckpoint(dirpath=workdir, every_n_train_steps=1, save_top_k=-1),
            *callbacks,
        ]
    trainer = L.Trainer(
        max_steps=steps,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=list(callbacks),
        enable_checkpointing=checkpoints,
        default_root_dir=workdir,
        log_every_n_steps=1,
    )
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module.seen


def test_lightning_resume_sees_the_samples_of_an_uninterrupted_run(v21, tmp_path):
    per_epoch = len(datamodule(v21, val_episodes=0).train_dataloader())
    steps, stop = per_epoch + 6, per_epoch + 3  # both runs cross an epoch boundary
    logger = MLflowLogger(experiment_name="data", store_dir=str(tmp_path / "mlruns"))
    wait = StepTimeBreakdown()
    whole = fit(v21, steps, tmp_path / "whole", logger=logger, callbacks=[wait, BadDataCounter()], checkpoints=False)
    first = fit(v21, stop, tmp_path / "first")
    checkpoint = tmp_path / "first" / f"epoch=1-step={stop}.ckpt"
    saved = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert saved == [{"epoch": 1, "global_batches": 3, "bad_samples": 0}]
    rest = fit(v21, steps, tmp_path / "first", ckpt_path=str(checkpoint))
    assert first + rest == whole and len(whole) == steps * 8

    # The data-wait metrics reached MLflow: every step but the first of each epoch.
    import mlflow

    logger.finalize()
    client = mlflow.MlflowClient(tracking_uri=logger._tracking_uri)
    history = client.get_metric_history(logger.run_id, "time/data_wait_fraction")
    assert len(history) == steps - 2 and all(0 <= m.value < 1 for m in history)
    assert client.get_metric_history(logger.run_id, "data/bad_samples")[-1].value == 0
    assert 0 < wait.total_data_wait < wait.total_step


# ---------------------------------------------------------------------------------------- bad data
def damage_parquet_type(root):
    path = root / "data" / "chunk-000" / "episode_000001.parquet"
    table = pq.read_table(path)
    column = table.schema.get_field_index("action")
    pq.write_table(table.set_column(column, "action", table.column("action").cast(pa.list_(pa.float64(), 3))), path)


DAMAGE = {
    "missing-parquet": (
        lambda r: (r / "data/chunk-000/episode_000001.parquet").unlink(),
        r"episode 1: data file .*episode_000001\.parquet is missing",
    ),
    "corrupt-parquet": (
        lambda r: (r / "data/chunk-000/episode_000001.parquet").write_bytes(b"PAR1 not really"),
        r"episode 1: cannot read parquet file .*episode_000001\.parquet",
    ),
    "schema-disagrees": (
        damage_parquet_type,
        r"episode 1: .*episode_000001\.parquet: column 'action' has type .*double.*, meta/info.json declares",
    ),
    "missing-mp4": (
        lambda r: (r / f"videos/chunk-000/{CAMERA}/episode_000001.mp4").unlink(),
        r"episode 1: video file .*episode_000001\.mp4 is missing",
    ),
    "truncated-mp4": (
        lambda r: (p := r / f"videos/chunk-000/{CAMERA}/episode_000001.mp4").write_bytes(p.read_bytes()[:300]),
        r"episode 1: .*episode_000001\.mp4",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_bad_data_is_an_error_naming_episode_and_file_or_is_skipped_and_counted(v21, tmp_path, damage, caplog):
    root = shutil.copytree(v21, tmp_path / "damaged")
    harm, message = DAMAGE[damage]
    harm(root)
    loader = datamodule(root, val_episodes=0, order={"shuffle_buffer": 0}).train_dataloader()
    with pytest.raises((DatasetError, VideoError), match=message):
        list(loader)

    skipping = datamodule(
        root, val_episodes=0, order={"shuffle_buffer": 0}, loader={"on_bad_data": "skip"}
    ).train_dataloader()
    with caplog.at_level(logging.WARNING, logger="uma_lightning.data.loader"):
        samples = keys_of(skipping)
    episode_1 = LeRobotMetadata.load(v21).episodes[1].length
    clean = keys_of(datamodule(v21, val_episodes=0, order={"shuffle_buffer": 0}).train_dataloader())
    assert samples == [key for key in clean if key[1] != 1]  # exactly episode 1's samples left out, order kept
    assert skipping.bad_samples == len(clean) - len(samples) and 0 < skipping.bad_samples <= episode_1
    assert skipping.state_dict()["bad_samples"] == skipping.bad_samples
    assert re.search(message, caplog.text) and "skipped bad sample (1 so far)" in caplog.text


# ---------------------------------------------------------------------------------------- host to device
def test_device_prefetcher_is_a_no_op_on_cpu():
    batches = [{"x": torch.arange(3), "names": ["a"]} for _ in range(3)]
    assert all(a is b for a, b in zip(DevicePrefetcher(batches, "cpu"), batches))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the prefetcher copies on a side CUDA stream"
)
def test_device_prefetcher_copies_on_a_side_stream_from_pinned_memory(v21):
    dm = datamodule(v21, loader={"num_workers": 1, "pin_memory": True})
    host = list(dm.train_dataloader())
    device = torch.device("cuda", torch.cuda.current_device())
    loader = dm.train_dataloader()
    loader.device = device
    on_device = list(loader)
    assert len(on_device) == len(host)
    for a, b in zip(host, on_device):
        assert b["images"].device == device and torch.equal(a["images"], b["images"].cpu())
        assert b["instruction"] == a["instruction"]
    # The copy of batch k+1 is issued before batch k is handed over, on a stream other than the current one.
    prefetcher = iter(DevicePrefetcher(iter(host), device))
    first = next(prefetcher)
    torch.cuda.synchronize()
    assert torch.equal(first["state"].cpu(), host[0]["state"])


def _segfault() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def test_a_loader_worker_killed_between_torchs_checks_is_named_with_its_signal(v21):
    # torch's SIGCHLD handler usually sees a worker's death first; without it (as when the signal comes
    # while the handler cannot run), torch's own words are only that the worker "exited unexpectedly".
    dm = datamodule(v21)
    loader = RobotDataLoader(BatchStream(dm.train_sets, dm.order), num_workers=1, multiprocessing_context="fork")
    children = {child.pid for child in multiprocessing.active_children()}
    batches = iter(loader)
    next(batches)
    (pid,) = {child.pid for child in multiprocessing.active_children()} - children  # the loader's worker
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        os.kill(pid, signal.SIGSEGV)
        with pytest.raises(RuntimeError) as raised:
            for _ in batches:
                pass
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert str(raised.value) == f"DataLoader worker (pid {pid}) is killed by signal: Segmentation fault."
    # What torch raised: "exited unexpectedly", or, when a batch the worker had queued came next, the
    # connection over which its tensors' file descriptors were to come, reset or closed.
    cause = raised.value.__cause__
    assert "exited unexpectedly" in str(cause) or isinstance(cause, (ConnectionError, EOFError)), repr(cause)


def test_killed_worker_names_only_a_worker_a_signal_killed():
    worker = multiprocessing.get_context("fork").Process(target=_segfault)
    worker.start()
    worker.join()
    alive = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    alive.start()
    try:
        unexpected = RuntimeError(f"DataLoader worker (pid(s) {worker.pid}) exited unexpectedly")
        named = _killed_worker(unexpected, [alive, worker])
        assert str(named) == f"DataLoader worker (pid {worker.pid}) is killed by signal: Segmentation fault."
        assert _killed_worker(unexpected, [alive]) is None  # no worker died of a signal: torch's words stand
        assert _killed_worker(RuntimeError("CUDA error: out of memory"), [worker]) is None
        reset = ConnectionResetError(104, "Connection reset by peer")
        assert str(_killed_worker(reset, [alive, worker])) == str(named)
        assert str(_killed_worker(EOFError(), [alive, worker])) == str(named)
        started = time.monotonic()
        assert _killed_worker(reset, [alive]) is None  # after waiting a little for a death that does not come
        assert 1.5 < time.monotonic() - started < 5
    finally:
        alive.kill()
        alive.join()
