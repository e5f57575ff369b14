"""The pretrain recipe's diagnostics in one real run with the profiler switched on: throughput and
MFU, step-time breakdown, memory, profiler traces and provenance, read back from MLflow."""

import csv
import gc
import json
import os
import re
import socket
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from mlflow import MlflowClient
from suite import QUICK, RECIPE

from uma_lightning.callbacks import StepTimeBreakdown, ThroughputLogger
from uma_lightning.callbacks.peak_flops import PEAK_TFLOPS, matmul_dtype, resolve_peak, table_entry
from uma_lightning.cli import UmaCLI
from uma_lightning.tracking.mlflow_logger import local_store_uri
from uma_lightning.tracking.provenance import PACKAGE_DIR, git_diff, git_root

STEPS = 6
# The module's run and the data-wait test compare clocks: nothing else may run beside them. The run
# is made by whichever of its tests comes first, so all of them are `alone`.


@pytest.fixture(scope="module")
def run(tmp_path_factory, mlflow_store):
    root = tmp_path_factory.mktemp("diagnostics")
    os.environ["UMA_PROVENANCE_PROBE"] = "recorded"
    os.environ["UMA_PROBE_TOKEN"] = "never-recorded"
    # The step-time test compares two callbacks' clocks, whose marks are taken at different moments of
    # a batch end: a collection of the heap earlier tests left (tens of ms in a full suite run) falling
    # between them would count in one and not the other. Frozen objects are not collected again.
    gc.collect()
    gc.freeze()
    try:
        cli = UmaCLI(
            [
                "fit",
                "--config",
                RECIPE,
                *QUICK,
                "--trainer.max_steps",
                str(STEPS),
                "--trainer.default_root_dir",
                str(root / "run"),
                "--trainer.logger.init_args.store_dir",
                str(mlflow_store),
                "--trainer.callbacks+=uma_lightning.callbacks.ProfilerTraces",
                "--trainer.callbacks.init_args.skip_first",
                "2",
                "--trainer.callbacks.init_args.active",
                "1",
            ]
        )
    finally:
        gc.unfreeze()
        del os.environ["UMA_PROVENANCE_PROBE"], os.environ["UMA_PROBE_TOKEN"]
    client = MlflowClient(local_store_uri(mlflow_store))
    run_id = cli.trainer.logger.run_id
    return SimpleNamespace(cli=cli, client=client, run=client.get_run(run_id), id=run_id, dir=root / "run", tmp=root)


def history(run, name: str) -> dict[int, float]:
    metrics = run.client.get_metric_history(run.id, name)
    assert metrics, f"metric {name} was not logged"
    return {m.step: m.value for m in metrics}


def artifact_names(run, folder: str) -> list[str]:
    return sorted(Path(a.path).name for a in run.client.list_artifacts(run.id, folder))


# ---- throughput and MFU ---------------------------------------------------------------------------


@pytest.mark.alone
def test_mfu_is_model_flops_over_the_logged_peak(run):
    tags = run.run.data.tags
    peak = float(tags["throughput.peak_tflops_per_device"])
    assert peak > 0 and tags["throughput.peak_source"].startswith("matmul probe on cpu")
    samples = history(run, "throughput/samples_per_sec")
    tflops = history(run, "throughput/tflops_per_device")
    mfu = history(run, "throughput/mfu_percent")
    assert sorted(samples) == list(range(1, STEPS))  # every step but the first, which pays start-up costs
    flops_per_sample = run.cli.model.flops_per_sample
    for step in samples:
        assert tflops[step] == pytest.approx(samples[step] * flops_per_sample / 1e12, rel=1e-5)
        assert mfu[step] == pytest.approx(100 * tflops[step] / peak, rel=1e-4)


@pytest.mark.parametrize(
    "device_name, key",
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("AMD Instinct MI300X", "MI300X"),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_device_names_find_their_row_of_the_peak_table(device_name, key):
    assert table_entry(device_name) == key


def test_peak_table_holds_the_dense_datasheet_figures():
    assert PEAK_TFLOPS["H100"]["bf16"] == PEAK_TFLOPS["H200"]["bf16"] == 989
    assert PEAK_TFLOPS["H100"]["fp8"] == 1979 and PEAK_TFLOPS["H100"]["tf32"] == pytest.approx(494.7)
    assert PEAK_TFLOPS["H100 PCIe"]["bf16"] == 756 and PEAK_TFLOPS["H100 NVL"]["bf16"] == pytest.approx(835.5)
    assert PEAK_TFLOPS["A100"]["bf16"] == 312 and PEAK_TFLOPS["A100"]["tf32"] == 156
    assert PEAK_TFLOPS["B200"]["bf16"] == 2250


def test_precision_picks_the_matmul_dtype():
    assert matmul_dtype("bf16-mixed") == matmul_dtype("bf16-true") == "bf16"
    assert matmul_dtype("16-mixed") == "fp16"
    assert matmul_dtype("transformer-engine") == "fp8"
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert matmul_dtype("32-true") == "tf32"
        torch.set_float32_matmul_precision("highest")
        assert matmul_dtype("32-true") == "fp32"
    finally:
        torch.set_float32_matmul_precision(saved)


def test_a_probed_peak_is_measured_once_per_host_dtype_and_thread_count_then_read_back(tmp_path, monkeypatch, caplog):
    from uma_lightning.callbacks import peak_flops

    def probe(device, dtype="fp32", size=1024, seconds=0.3):
        measured.append((dtype, torch.get_num_threads()))
        return {"bf16": 3.0, "fp64": 0.5}[dtype]

    measured = []
    monkeypatch.setenv("UMA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak_flops, "probe_tflops", probe)
    cpu, cache, threads = torch.device("cpu"), tmp_path / "peak_tflops.json", torch.get_num_threads()
    peak, source = resolve_peak(cpu, "bf16-true")
    assert (
        peak == 3.0
        and source == f"matmul probe on cpu (bf16) measured now, kept in {cache}; set peak_tflops to override"
    )
    assert resolve_peak(cpu, "bf16-true") == (
        3.0,
        f"matmul probe on cpu (bf16) measured earlier on this host ({cache}); set peak_tflops to override",
    )
    assert resolve_peak(cpu, "64-true")[0] == 0.5
    torch.set_num_threads(threads + 1)
    try:
        assert resolve_peak(cpu, "bf16-true")[0] == 3.0
    finally:
        torch.set_num_threads(threads)
    assert measured == [("bf16", threads), ("fp64", threads), ("bf16", threads + 1)]
    assert len(json.loads(cache.read_text())) == 3
    # A damaged cache is said so and measured again, never trusted.
    cache.write_text('{"a": -1}')
    assert resolve_peak(cpu, "bf16-true")[0] == 3.0 and len(measured) == 4
    assert f"ignoring the peak cache {cache}: not a mapping to positive TFLOP/s; measuring again" in caplog.text
    cache.write_text("{")
    assert resolve_peak(cpu, "bf16-true")[0] == 3.0 and len(measured) == 5
    assert f"ignoring the unreadable peak cache {cache}" in caplog.text
    assert resolve_peak(cpu, "bf16-true")[0] == 3.0 and len(measured) == 5


def test_configured_peak_wins_and_a_bad_one_is_refused():
    assert resolve_peak(torch.device("cpu"), "32-true", 123.0) == (123.0, "config")
    with pytest.raises(ValueError, match="peak_tflops must be > 0, got 0"):
        ThroughputLogger(peak_tflops=0)


# ---- step time, memory --------------------------------------------------------------------------


@pytest.mark.alone
def test_step_time_phases_add_up_to_the_measured_step(run):
    samples = history(run, "throughput/samples_per_sec")
    phases = {
        name: history(run, f"time/{name}_ms") for name in ("overhead", "data_wait", "forward", "backward", "optimizer")
    }
    assert sorted(phases["forward"]) == list(range(STEPS))
    for name in ("forward", "backward", "optimizer"):
        assert all(value > 0 for value in phases[name].values()), name
    # The loader is timed from the loop's fetch, so validation (after steps 1 and 3, 0-based) does not
    # count as data wait; the first batch pays for worker start-up and has none.
    assert sorted(phases["data_wait"]) == [1, 2, 3, 4, 5]
    assert all(value >= 0 for value in phases["data_wait"].values())
    # The time between steps outside the loader is known only for gaps without validation.
    assert sorted(phases["overhead"]) == [1, 3, 5]
    fractions = history(run, "time/data_wait_fraction")
    batch = 4
    for step in phases["overhead"]:
        step_ms = 1e3 * batch / samples[step]  # the throughput logger's own clock, batch end to batch end
        total = sum(phases[name][step] for name in phases)
        assert total == pytest.approx(step_ms, rel=0.05, abs=10), step
        assert fractions[step] == pytest.approx(phases["data_wait"][step] / total, rel=1e-6)


class _SlowBatches(torch.utils.data.Dataset):
    """Each batch takes 50 ms to load."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.05)
        return torch.randn(4)


class _SlowBatchEnd(L.Callback):
    """Work between steps that is not the loader's: 150 ms after every batch."""

    def on_train_batch_end(self, *args) -> None:
        time.sleep(0.15)


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.alone
def test_data_wait_is_the_loaders_time_not_the_work_between_steps(tmp_path):
    breakdown = StepTimeBreakdown()
    trainer = L.Trainer(
        max_steps=6,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[breakdown, _SlowBatchEnd()],
    )
    trainer.fit(_Regression(), torch.utils.data.DataLoader(_SlowBatches(), batch_size=1))
    rows = list(csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv")))
    timed = {int(row["step"]): row for row in rows if row["time/data_wait_ms"]}
    assert sorted(timed) == [1, 2, 3, 4, 5]  # the first batch of the epoch has no previous end
    for row in timed.values():
        assert float(row["time/data_wait_ms"]) >= 48 and float(row["time/overhead_ms"]) >= 148, row
    # Had the batch-end work counted as data wait, every wait would be over 200 ms; had it counted
    # twice as overhead, every overhead over 300 ms. Medians: one step that the machine delayed
    # (a 347 ms overhead in a CI run) does not make a wrong split of them all.
    assert statistics.median(float(row["time/data_wait_ms"]) for row in timed.values()) < 150, timed
    assert statistics.median(float(row["time/overhead_ms"]) for row in timed.values()) < 300, timed
    waits = [float(row["time/data_wait_ms"]) / 1e3 for row in timed.values()]
    assert breakdown.total_data_wait == pytest.approx(sum(waits))
    assert 0.1 < breakdown.total_data_wait / breakdown.total_step < 0.4


@pytest.mark.alone
def test_memory_is_logged_every_step(run):
    rss = history(run, "memory/cpu_rss_mib")
    assert sorted(rss) == list(range(STEPS))
    import psutil

    now = psutil.Process().memory_info().rss / 2**20
    assert all(0.3 * now < value < 1.5 * now for value in rss.values()), (rss, now)


# ---- profiler -----------------------------------------------------------------------------------


# What TensorBoard's profiler plugin (torch-tb-profiler) counts as a trace: a worker name, optionally
# a span (the milliseconds torch's trace handler appends), ".pt.trace.json", optionally gzipped. A
# folder holding one is a run, named by its path under the log directory.
PLUGIN_TRACE = re.compile(r"^(?P<worker>.*?)(?:\.(?P<span>\d+))?\.pt\.trace\.json(?:\.gz)?$")


def plugin_runs(logdir: Path) -> dict[str, list[tuple[str, str, Path]]]:
    """The runs the plugin finds under ``logdir``: {run name: [(worker, span, trace file)]}."""
    runs = {}
    for folder, _, files in os.walk(logdir):
        traces = [(m["worker"], m["span"], Path(folder) / name) for name in files if (m := PLUGIN_TRACE.match(name))]
        if traces:
            runs[os.path.relpath(folder, logdir)] = sorted(traces)
    return runs


@pytest.mark.alone
def test_profiler_traces_are_laid_out_for_tensorboard_and_are_mlflow_artifacts(run):
    # skip 2 steps, warm up 1, record 1: step 3, in one run folder of rank 0.
    logdir = run.dir / "profiler"
    runs = plugin_runs(logdir)
    assert list(runs) == ["rank0-steps3-3"]
    ((worker, span, trace_path),) = runs["rank0-steps3-3"]
    # The worker is "<node>_<process>", which the plugin splits for its distributed view.
    assert worker == f"{socket.gethostname()}_{os.getpid()}" and re.fullmatch(r"(.*)_(\d+)", worker)
    assert abs(int(span) / 1000 - time.time()) < 3600  # milliseconds since the epoch
    # The JSON the plugin parses: traceEvents with a ts on each event it keeps, the step annotations it
    # splits the steps by; deviceProperties only on a GPU.
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    assert isinstance(trace.get("deviceProperties", []), list)
    assert all("ph" in event and "name" in event for event in events)
    complete = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in complete)
    steps = [e for e in complete if e["name"].startswith("ProfilerStep#")]
    assert [e["name"] for e in steps] == ["ProfilerStep#3"] and steps[0]["cat"] == "user_annotation"
    names = {e["name"] for e in complete}
    assert "aten::mm" in names or "aten::addmm" in names  # the model's matmuls were recorded
    table = (trace_path.parent / "key_averages.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    # The same folder, byte for byte, among the MLflow artifacts.
    assert artifact_names(run, "profiler") == ["rank0-steps3-3"]
    assert artifact_names(run, "profiler/rank0-steps3-3") == sorted(["key_averages.txt", trace_path.name])
    artifact = f"profiler/rank0-steps3-3/{trace_path.name}"
    assert Path(run.client.download_artifacts(run.id, artifact, str(run.tmp))).read_bytes() == trace_path.read_bytes()


def test_a_file_the_tensorboard_plugin_would_skip_is_not_counted_as_a_trace(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "trace_rank0_step4.json").write_text("{}")  # the old name: no run
    (tmp_path / "a" / "host_1.pt.trace.json.partial").write_text("{}")
    assert plugin_runs(tmp_path) == {}
    (tmp_path / "a" / "host_1.1700000000000.pt.trace.json.gz").write_bytes(b"")
    assert plugin_runs(tmp_path) == {
        "a": [("host_1", "1700000000000", tmp_path / "a" / "host_1.1700000000000.pt.trace.json.gz")]
    }


# ---- provenance ---------------------------------------------------------------------------------


@pytest.mark.alone
def test_provenance_is_on_the_run_page(run):
    tags = run.run.data.tags
    assert tags["hw.cpu_threads"] == str(os.cpu_count()) and tags["hw.gpu_count"] == "0" and tags["hw.cpu"]
    assert tags["world.nodes"] == "1" and tags["strategy"] == "SingleDeviceStrategy" and tags["precision"] == "32-true"
    files = artifact_names(run, "provenance")
    in_repo = git_root(".") == git_root(PACKAGE_DIR)
    patch = "git_diff.patch" if in_repo else "uma_lightning_git_diff.patch"
    assert files == sorted(["environment.json", "pip_freeze.txt", "world.json", patch])

    def read(name: str) -> str:
        return Path(run.client.download_artifacts(run.id, f"provenance/{name}", str(run.tmp))).read_text()

    assert f"torch=={torch.__version__}\n" in read("pip_freeze.txt")
    assert read(patch) == git_diff("." if in_repo else PACKAGE_DIR)
    environment = json.loads(read("environment.json"))
    assert environment["UMA_PROVENANCE_PROBE"] == "recorded"
    assert "UMA_PROBE_TOKEN" not in environment  # secret-looking names stay out
    world = json.loads(read("world.json"))
    assert world["world_size"] == 1 and world["nodes"] == [socket.gethostname()]
    assert world["ranks"][0]["rank"] == 0 and world["ranks"][0]["device"] == "cpu"


@pytest.mark.alone
def test_a_healthy_run_reports_no_anomaly_and_leaves_no_watchdog_running(run):
    assert not (run.dir / "anomalies.jsonl").exists() and not (run.dir / "hang").exists()
    assert not any(
        name.startswith("anomaly/") and name.endswith(("nonfinite", "spike")) for name in run.run.data.metrics
    )
    assert not [t for t in threading.enumerate() if t.name == "uma-hang-watchdog"]
