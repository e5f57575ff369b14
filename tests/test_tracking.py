"""MLflow tracking against a real `mlflow server` on 127.0.0.1, read back through the MLflow client."""

import http.client
import json
import logging
import random
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from suite import QUICK, RECIPE, assert_short_error, run_main

from uma_lightning.cli import UmaCLI
from uma_lightning.data import LeRobotMetadata
from uma_lightning.data.generate import generate_planar_arm
from uma_lightning.modules import MidtrainModule, PosttrainModule, PretrainModule
from uma_lightning.tools.data import main as data_tool
from uma_lightning.tracking import MLflowLogger
from uma_lightning.tracking.datasets import metadata_digest
from uma_lightning.tracking.run_config import headline_metrics
from uma_lightning.tracking.run_name import MAX_NAME_LENGTH, changed_settings, describe_overrides, run_name


def tracked_fit(server: str, run_dir: Path, *args: str, late: tuple[str, ...] = ()) -> UmaCLI:
    """``uma fit`` of the quick pretrain recipe, ``args`` before the quick settings, ``late`` after them."""
    return UmaCLI(
        [
            "fit",
            "--config",
            RECIPE,
            *args,
            *QUICK,
            *late,
            "--trainer.default_root_dir",
            str(run_dir),
            "--trainer.logger.init_args.tracking_uri",
            server,
            "--trainer.logger.init_args.experiment_name",
            "tracking-test",
        ]
    )


@pytest.fixture(scope="module")
def first_run(mlflow_server, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("first") / "run"
    cli = tracked_fit(mlflow_server, run_dir)
    return cli, run_dir


NAME_SUFFIX = r" #[0-9a-f]{6}"


@pytest.mark.slow  # a server process and a training run
def test_run_is_tracked_on_a_real_server(mlflow_server, first_run, tmp_path):
    cli, run_dir = first_run
    client = MlflowClient(mlflow_server)
    run = client.get_run(cli.trainer.logger.run_id)
    assert run.info.status == "FINISHED"

    # Named after the recipe and what the command line changed, in the flags' order; never MLflow's seeded random name.
    # "1" is an int (one batch) or a float (all of them) as the installed jsonargparse resolves Lightning's
    # Union[int, float]: the tag shows the value the run used.
    overrides = (
        "dim=32 n_layers=1 n_heads=2 n_kv_heads=1 ffn_dim=64 name=custom n_episodes=6 batch_size=4 num_workers=0 "
        f"max_steps=4 val_check_interval=2 limit_val_batches={cli.trainer.limit_val_batches} default_root_dir=run"
    )
    assert run.data.tags["overrides"] == overrides
    # The name: as many whole settings as the runs table shows, a count of the others, then the suffix.
    match = re.fullmatch(r"pretrain (.+) \(\+(\d+) more\)" + NAME_SUFFIX, run.info.run_name)
    assert match and len(run.info.run_name) <= MAX_NAME_LENGTH + len(" #123456"), run.info.run_name
    shown = match.group(1).split(" ")
    assert shown[:5] == overrides.split(" ")[:5] and set(shown) < set(overrides.split(" "))
    assert len(shown) + int(match.group(2)) == len(overrides.split(" "))

    # The resolved config, flattened into params in their sections, each once; callbacks by class name.
    params = run.data.params
    assert params["trainer/max_steps"] == "4"
    assert params["model/init_args/network/size/dim"] == "32"
    assert params["data/init_args/batch_size"] == "4"
    assert params["trainer/callbacks/ShardedCheckpoint/init_args/every_n_steps"] == "100"
    assert int(params["model.n_parameters"]) == sum(p.numel() for p in cli.model.parameters())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    counts = {"model.n_parameters", "model.tokens_per_sample", "model.flops_per_sample"}
    assert set(params) == set(config_leaves(config)) | counts
    assert not {"batch_size", "root", "n_episodes", "_instantiator", "_class_path"} & set(params)

    # The dataset as a dataset input: what the runs table's Dataset column shows.
    (dataset_input,) = run.inputs.dataset_inputs
    meta = cli.datamodule.metadata[0]
    assert_dataset_input(dataset_input, meta, weight="1", train_episodes="5", val_episodes="1")

    # The headline metrics: the last validation's loss and the stage's key metric.
    for final, name in (("final/val_loss", "val/loss"), ("final/val_token_accuracy", "val/token_accuracy")):
        (value,) = client.get_metric_history(run.info.run_id, final)
        assert value.value == pytest.approx(client.get_metric_history(run.info.run_id, name)[-1].value)
        assert value.value == run.data.metrics[final]

    # Per-step metrics on the step axis.
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in losses) == [0, 1, 2, 3]
    assert float(cli.trainer.callback_metrics["train/loss"]) == pytest.approx(max(losses, key=lambda m: m.step).value)
    for name in ("lr", "grad_norm", "throughput/tokens_per_sec", "throughput/samples_per_sec", "val/loss"):
        assert client.get_metric_history(run.info.run_id, name), f"metric {name} missing"
    tokens = client.get_metric_history(run.info.run_id, "throughput/tokens_per_sec")
    samples = client.get_metric_history(run.info.run_id, "throughput/samples_per_sec")
    assert tokens[-1].value == pytest.approx(samples[-1].value * cli.model.tokens_per_sample)

    # Provenance tags and the checkpoint location.
    tags = run.data.tags
    assert tags["recipe"] == RECIPE
    assert tags["world_size"] == "1"
    assert tags["version.torch"].startswith("2.")
    assert tags["git.dirty"] in ("true", "false") and len(tags["git.commit"]) == 40
    assert Path(tags["checkpoint_dir"]) == (run_dir / "checkpoints").resolve()
    assert (Path(tags["checkpoint_dir"]) / "step-000000004" / "manifest.json").is_file()

    # The config artifact is the run directory's config.yaml, byte for byte; provenance files beside it.
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml", "provenance"]
    assert "pip_freeze.txt" in [Path(a.path).name for a in client.list_artifacts(run.info.run_id, "provenance")]
    downloaded = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert Path(downloaded).read_bytes() == (run_dir / "config.yaml").read_bytes()
    assert yaml.safe_load(Path(downloaded).read_text())["trainer"]["max_steps"] == 4


def config_leaves(config, prefix=""):
    """Dotted paths of a config's values, as an independent count of the params it should give."""
    if isinstance(config, dict) and config:
        return [
            leaf for key, value in config.items() for leaf in config_leaves(value, f"{prefix}/{key}" if prefix else key)
        ]
    if isinstance(config, list) and config and all(isinstance(item, dict) for item in config):
        keys = [
            item["class_path"].rsplit(".", 1)[-1] if "class_path" in item else str(i) for i, item in enumerate(config)
        ]
        return [leaf for key, item in zip(keys, config) for leaf in config_leaves(item, f"{prefix}/{key}")]
    return [prefix]


def assert_dataset_input(dataset_input, meta, **tags):
    dataset = dataset_input.dataset
    assert dataset.name == Path(meta.root).name and dataset.digest == metadata_digest(meta)
    assert json.loads(dataset.source) == {"uri": str(meta.root)} and dataset.source_type == "local"
    assert json.loads(dataset.profile) == {
        "format": f"LeRobot {meta.version}",
        "episodes": len(meta.episodes),
        "frames": sum(e.length for e in meta.episodes),
        "fps": meta.fps,
        "cameras": list(meta.cameras),
    }
    assert {tag.key: tag.value for tag in dataset_input.tags} == {"mlflow.data.context": "train", **tags}


@pytest.mark.slow  # a server process and three training runs
def test_runs_are_named_apart_and_a_resumed_run_keeps_its_name(mlflow_server, first_run, tmp_path):
    client = MlflowClient(mlflow_server)
    first = client.get_run(first_run[0].trainer.logger.run_id)
    # Another run of the recipe, with another learning rate, on a mixture of two datasets.
    v21 = generate_planar_arm(tmp_path / "v21", n_episodes=4, image_size=32, seed=0)
    assert data_tool(["convert", str(v21), str(tmp_path / "v30"), "--to", "v3.0"]) == 0
    mixture = json.dumps([{"root": str(v21), "weight": 1.0}, {"root": str(tmp_path / "v30"), "weight": 3.0}])
    second = tracked_fit(mlflow_server, tmp_path / "lr", "--model.optimizer.lr", "1e-3", "--data.datasets", mixture)
    run = client.get_run(second.trainer.logger.run_id)
    assert run.info.run_name.startswith("pretrain lr=1e-3 datasets=v21+v30 dim=32") and re.search(
        NAME_SUFFIX + "$", run.info.run_name
    )
    assert run.info.run_name != first.info.run_name
    assert [i.dataset.name for i in run.inputs.dataset_inputs] == ["v21", "v30"]
    for dataset_input, weight in zip(run.inputs.dataset_inputs, ("0.25", "0.75")):
        meta = LeRobotMetadata.load(json.loads(dataset_input.dataset.source)["uri"])
        assert_dataset_input(dataset_input, meta, weight=weight, train_episodes="3", val_episodes="1")

    # The first run, resumed with more steps (the command line changed): the same run, the same name.
    resumed = tracked_fit(mlflow_server, first_run[1], late=("--trainer.max_steps", "6"))
    assert resumed.trainer.logger.run_id == first.info.run_id and resumed.trainer.global_step == 6
    again = client.get_run(first.info.run_id)
    assert again.info.run_name == first.info.run_name and again.data.tags["overrides"] == first.data.tags["overrides"]
    assert len(client.search_runs([first.info.experiment_id], f"attributes.run_name = '{first.info.run_name}'")) == 1


def test_default_store_is_embedded_sqlite_without_a_server(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    UmaCLI(["fit", "--config", RECIPE, *QUICK])
    store = tmp_path / "mlruns" / "mlflow.db"
    assert store.is_file()
    client = MlflowClient(f"sqlite:///{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("pretrain").experiment_id])
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 4
    assert (tmp_path / "runs" / "pretrain" / "config.yaml").is_file()
    artifact_dir = Path(run.info.artifact_uri.removeprefix("file://"))
    assert (artifact_dir / "config.yaml").is_file() and artifact_dir.is_relative_to(tmp_path / "mlruns")


def test_a_new_store_copied_from_the_empty_template_is_the_store_mlflow_makes(tmp_path, monkeypatch):
    import sqlite3

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from uma_lightning.tracking.mlflow_logger import empty_store_template

    def schema(db: Path) -> tuple[list, list]:
        """Tables and indexes, each statement's lines sorted: MLflow's table rebuilds list a table's
        constraints in an order that differs from one migration to the next, in one process too."""
        with sqlite3.connect(db) as connection:
            rows = connection.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
            tables = sorted(
                (kind, name, sorted(line.strip().rstrip(",") for line in sql.splitlines())) for kind, name, sql in rows
            )
            return tables, connection.execute("SELECT * FROM alembic_version").fetchall()

    class Migrations(logging.Handler):  # MLflow logs this line before running its schema migrations on a new store
        def emit(self, record):
            runs.append("Creating initial MLflow database tables" in record.getMessage())

    runs: list[bool] = []
    mlflow_db = logging.getLogger("mlflow.store.db.utils")
    mlflow_db.addHandler(handler := Migrations())
    monkeypatch.setattr(mlflow_db, "level", logging.INFO)
    monkeypatch.setenv("UMA_CACHE_DIR", str(tmp_path / "cache"))
    native = tmp_path / "native" / "mlflow.db"
    native.parent.mkdir()
    try:
        SqlAlchemyStore(f"sqlite:///{native}", str(tmp_path / "native")).engine.dispose()
        assert any(runs)
        monkeypatch.chdir(tmp_path)
        template = empty_store_template()
        runs.clear()
        logger = MLflowLogger(experiment_name="seeded", store_dir="seeded")
        assert not any(runs)  # the new store was copied, not migrated
    finally:
        mlflow_db.removeHandler(handler)
    made = template.stat().st_mtime_ns
    # The same tables, indexes and schema revision as the store MLflow makes itself.
    assert schema(tmp_path / "seeded" / "mlflow.db") == schema(native) == schema(template)
    logger.log_metrics({"loss": 1.5}, step=3)
    logger.finalize("success")
    client = MlflowClient(f"sqlite:///{tmp_path / 'seeded' / 'mlflow.db'}")
    assert [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "loss")] == [(3, 1.5)]
    default = client.get_experiment("0")  # made on first open, for this store, not the template's folder
    assert default.name == "Default" and str(tmp_path) in default.artifact_location
    # A second new store is another copy of the same template, not made again; an existing store is left as it is.
    MLflowLogger(experiment_name="other", store_dir="other")
    assert template.stat().st_mtime_ns == made and schema(tmp_path / "other" / "mlflow.db") == schema(native)
    before = (tmp_path / "seeded" / "mlflow.db").read_bytes()
    MLflowLogger(experiment_name="seeded", store_dir="seeded")
    assert (tmp_path / "seeded" / "mlflow.db").read_bytes() == before


def test_a_bad_metric_batching_interval_is_refused_before_any_metric_is_lost(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "5s")
    with pytest.raises(
        ValueError, match=r"MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS must be a whole number of seconds .* got '5s'"
    ):
        MLflowLogger(store_dir=str(tmp_path / "mlruns"))
    # Through `uma`: a short error naming the variable, exit status 2, no traceback.
    code, _, err = run_main(
        ["fit", "--config", RECIPE, *QUICK, "--trainer.default_root_dir", str(tmp_path / "run")], capsys
    )
    assert_short_error(code, err, "$MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS must be a whole number of seconds", "'5s'")


def test_the_metrics_before_a_checkpoint_reach_the_store_when_it_is_saved(tmp_path, monkeypatch):
    """A SIGKILLed run resumes from its newest checkpoint; metrics still merging in MLflow's async queue
    would be lost for the steps before it."""
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "60")  # merged writes: a minute apart
    logger = MLflowLogger(experiment_name="kill", store_dir=str(tmp_path / "mlruns"))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")

    def stored_steps() -> list[int]:
        return [m.step for m in client.get_metric_history(logger.run_id, "train/loss")]

    logger.log_metrics({"train/loss": 3.0}, step=0)
    logger.log_metrics({"train/loss": 2.0}, step=1)
    assert stored_steps() == []  # merging
    logger.after_save_checkpoint(None)  # saved after step 2, in on_train_batch_end
    assert stored_steps() == [0, 1]
    logger.log_metrics({"train/loss": 1.5}, step=2)  # Lightning logs the saving step's metrics after that hook
    assert stored_steps() == [0, 1, 2]
    logger.log_metrics({"train/loss": 1.0}, step=3)
    assert stored_steps() == [0, 1, 2]  # merging again until the next checkpoint
    logger.finalize("success")
    assert stored_steps() == [0, 1, 2, 3]


def cutting_proxy(upstream: str, cuts: list[str]) -> tuple[ThreadingHTTPServer, str]:
    """An HTTP proxy in front of a real MLflow server, on a free port of 127.0.0.1. Each ``log-batch``
    request while ``cuts`` is not empty gets a response cut off after two bytes of its body (as from a
    server killed while answering): ``"forwarded"`` once the server has stored the batch, ``"dropped"``
    without passing it on. Returns the proxy (serving on a thread) and its URL."""
    host, port = urllib.parse.urlsplit(upstream).netloc.split(":")

    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def relay(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            cut = cuts.pop(0) if self.path.endswith("/runs/log-batch") and cuts else None
            if cut != "dropped":
                upstream_connection = http.client.HTTPConnection(host, int(port), timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream_connection.request(self.command, self.path, body, headers)
                response = upstream_connection.getresponse()
                status, data, content_type = response.status, response.read(), response.getheader("Content-Type")
                upstream_connection.close()
            if cut:
                status, content_type, data = 200, "application/json", b"{}" + b" " * 62
            self.send_response(status)
            self.send_header("Content-Type", content_type or "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:2] if cut else data)
            self.close_connection = bool(cut)

        do_GET = do_POST = do_PATCH = do_DELETE = relay

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    return proxy, f"http://127.0.0.1:{proxy.server_address[1]}"


@pytest.mark.slow  # a server process
def test_a_batch_whose_response_was_cut_is_sent_again_and_stored_once(mlflow_server, tmp_path, monkeypatch, caplog):
    """MLflow's client retries a request it could not send, not one whose response was cut: its async
    queue logs the failure and drops the batch, stored or not. The logger sends such batches again at the
    next flush (each checkpoint), and says so; without a cut it says nothing."""
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "0")  # a request per batch
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a resend that fails, at once
    caplog.set_level(logging.WARNING)
    cuts: list[str] = []
    proxy, url = cutting_proxy(mlflow_server, cuts)
    logger = MLflowLogger(experiment_name="cut-responses", tracking_uri=url, store_dir=str(tmp_path / "unused"))
    server = MlflowClient(mlflow_server)

    def stored_steps() -> list[int]:
        return sorted(m.step for m in server.get_metric_history(logger.run_id, "train/loss"))

    def log_steps(steps) -> None:
        for step in steps:
            logger.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
            time.sleep(0.2)  # each batch on its own: the cut ones are the first ones

    try:
        logger.log_metrics({"train/loss": 2.0}, step=0)  # opens the run
        logger.flush()
        cuts += ["dropped", "forwarded"]
        log_steps(range(1, 6))
        logger.flush()  # as at a checkpoint
        assert stored_steps() == list(range(6))  # each step once: the forwarded batch is not doubled
        resent = [r.getMessage() for r in caplog.records if "sending all" in r.getMessage()]
        assert len(resent) == 1 and re.match(r"MLflow: 2 of 5 batches since the last flush were not stored", resent[0])

        # Quiet when nothing fails.
        caplog.clear()
        log_steps(range(6, 9))
        logger.flush()
        assert stored_steps() == list(range(9)) and not [r for r in caplog.records if r.name.startswith("uma")]

        # A resend that fails too waits for the next flush, and says which steps wait.
        cuts += ["dropped", "dropped"]
        log_steps([9])
        logger.flush()
        assert stored_steps() == list(range(9))
        assert any("1 metric values of steps 9..9 are not stored yet" in r.getMessage() for r in caplog.records)
        logger.flush()
        assert stored_steps() == list(range(10))

        # At the last flush, what cannot be stored is reported lost.
        caplog.clear()
        cuts += ["dropped"] * 2
        log_steps([10])
        logger.finalize("success")
        assert stored_steps() == list(range(10))
        assert any(
            "1 metric values of steps 10..10 were not stored and are lost" in r.getMessage() for r in caplog.records
        )
    finally:
        proxy.shutdown()


def test_a_continued_run_keeps_its_params_when_the_resumed_config_changed(tmp_path, caplog):
    first = MLflowLogger(experiment_name="resume", store_dir=str(tmp_path / "mlruns"), synchronous=True)
    first.log_hyperparams({"trainer": {"max_steps": 100, "precision": "32-true"}})
    first.log_metrics({"train/loss": 1.0}, step=99)
    first.finalize("failed")  # a preempted job
    again = MLflowLogger(experiment_name="resume", store_dir=str(tmp_path / "mlruns"), synchronous=True)
    again.continue_run(first.run_id)
    with caplog.at_level(logging.WARNING):
        again.log_hyperparams({"trainer": {"max_steps": 200, "precision": "32-true"}, "model.n_parameters": 5})
    again.log_metrics({"train/loss": 0.5}, step=100)
    again.finalize("success")
    client = MlflowClient(again._tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert run.info.run_id == first.run_id and run.info.status == "FINISHED"
    assert run.data.params == {"trainer/max_steps": "100", "trainer/precision": "32-true", "model.n_parameters": "5"}
    assert run.data.tags["params_changed_on_resume"] == "trainer/max_steps"
    assert "keeps its original values of changed params: trainer/max_steps" in caplog.text
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [99, 100]


def test_a_name_lists_the_changed_settings_under_short_unambiguous_keys():
    recipe = {
        "model": {"class_path": "P", "init_args": {"optimizer": {"lr": 3e-3}, "expert": {"lr": 1e-3}, "size": "tiny"}},
        "trainer": {
            "max_steps": 300,
            "default_root_dir": "runs/pretrain",
            "logger": {"init_args": {"tracking_uri": None}},
        },
    }
    resolved = {
        "model": {"class_path": "P", "init_args": {"optimizer": {"lr": 1e-4}, "expert": {"lr": 2e-3}, "size": "tiny"}},
        "trainer": {
            "max_steps": 40,
            "default_root_dir": "runs/sweep/a",
            "logger": {"init_args": {"tracking_uri": "http://h:5000"}},
        },
    }
    args = ["--trainer.max_steps", "40", "--model.init_args.expert.lr", "2e-3", "--model.optimizer.lr", "1e-4"]
    changed = changed_settings(recipe, resolved, args)
    # In the flags' order, then the rest; where the logs go is not what the run is.
    assert describe_overrides(changed) == "max_steps=40 expert.lr=2e-3 optimizer.lr=1e-4 default_root_dir=a"
    assert re.fullmatch(
        r"pretrain max_steps=40 expert\.lr=2e-3 optimizer\.lr=1e-4 default_root_dir=a #[0-9a-f]{6}",
        run_name("recipes/pretrain.yaml", "pretrain", "fit", changed),
    )
    assert run_name("my_recipe.yaml", "posttrain", "validate", {}, ("configs/vision/grounded.yaml",)).startswith(
        "my_recipe (posttrain) validate +grounded #"
    )
    # Drawn from the OS, not from the seeded `random`.
    random.seed(0)
    first = run_name(None, "pretrain", "fit", {})
    random.seed(0)
    assert first != run_name(None, "pretrain", "fit", {})


@pytest.mark.parametrize(
    "module, final",
    [
        (PretrainModule, "final/val_token_accuracy"),
        (MidtrainModule, "final/val_action_mse"),
        (PosttrainModule, "final/val_action_mse"),
    ],
)
def test_every_stage_has_headline_metrics(module, final):
    measured = {
        "val/loss": 1.5,
        "val/token_accuracy": 0.25,
        "val/action_mse": 0.125,
        "val/success_rate": 0.5,
        "train/loss": 2.0,
    }
    assert headline_metrics(measured, module.key_metric) == {
        "final/val_loss": 1.5,
        final: measured[module.key_metric],
        "final/val_success_rate": 0.5,
    }
