"""What the test modules share: the repository's paths, a few seconds' training arguments, running
``uma`` in this process and reading its error, a free port, a small model and inputs for it.

Expensive runs that several tests read are session fixtures in ``conftest.py``. Test modules import
from here and from the modules of test components (``checkpoint_modules``, ``faults``, ...), never
from each other."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from uma_lightning.command import main
from uma_lightning.data.spec import DataSpec
from uma_lightning.models import RobotModelConfig, RobotTransformer, load_size
from uma_lightning.ports import free_port  # noqa: F401  (the tests import it from here)

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
RECIPE = str(REPO / "recipes" / "pretrain.yaml")
# A one-layer backbone of width 32: seconds per run on two loaded cores.
TINY = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}
# A few seconds of training: the tiny backbone on a six-episode dataset.
QUICK = [
    "--model.network.size", json.dumps(TINY),
    "--data.generation.n_episodes", "6",
    "--data.batch_size", "4",
    "--data.loader.num_workers", "0",
    "--trainer.max_steps", "4",
    "--trainer.val_check_interval", "2",
    "--trainer.limit_val_batches", "1",
    "--trainer.enable_progress_bar", "false",
]  # fmt: skip

# Small data for the stage recipes run end to end (pretrain, midtrain, posttrain); validation runs
# once, at the end of each stage.
STAGE_DATA = [
    "--data.generation.n_episodes",
    "24",
    "--data.val_episodes",
    "4",
    "--data.loader.num_workers",
    "0",
    "--trainer.limit_val_batches",
    "4",
]


def recipe(name: str) -> str:
    """The shipped recipe ``recipes/<name>.yaml``."""
    return str(REPO / "recipes" / f"{name}.yaml")


def run_main(args, capsys):
    """Run ``uma ARGS`` in this process; returns (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def assert_short_error(code, err, *fragments):
    """A config error: exit status 2, at most two lines, no traceback, every fragment in it."""
    assert code == 2
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2, err
    for fragment in fragments:
        assert fragment in err, err


# ---- stage modules under a real Trainer, in this process -------------------------------------------


def small_data(**overrides):
    """The embedded data, six episodes (two for validation), batches of 4, loaded in this process."""
    from uma_lightning.data import RobotDataModule

    settings = {"generation": {"n_episodes": 6}, "batch_size": 4, "loader": {"num_workers": 0}, "val_episodes": 2}
    return RobotDataModule(**{**settings, **overrides})


def quiet_trainer(root, steps: int, **overrides):
    """A Trainer of ``steps`` steps in ``root``: no logger, progress bar or checkpoints, one validation batch."""
    import lightning as L

    settings = {
        "max_steps": steps,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": str(root),
        "limit_val_batches": 1,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(**{**settings, **overrides})


# ---- a small robot model and inputs for it, without data or Lightning ------------------------------

SPEC = DataSpec(
    cameras=("front", "wrist"), image_size=(32, 48), state_dim=5, action_dim=3, n_obs_steps=2, action_horizon=4, fps=10
)


def small_config(**overrides) -> RobotModelConfig:
    """A two-layer robot model of width 64 on ``SPEC``."""
    backbone = load_size({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128})
    return RobotModelConfig(backbone=backbone, spec=SPEC, max_text_len=16, n_action_bins=32, **overrides)


def random_inputs(model: RobotTransformer, batch: int = 3, seed: int = 0):
    """Images, state, instruction tokens and binned action targets for ``model``, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    spec = model.cfg.spec
    images = torch.randint(
        0, 256, (batch, spec.n_obs_steps, len(spec.cameras), *spec.image_size, 3), dtype=torch.uint8, generator=gen
    )
    state = torch.randn(batch, spec.n_obs_steps, spec.state_dim, generator=gen)
    text_ids, text_mask = model.text_tokenizer(["reach the red square", "go", "touch blue"][:batch])
    actions = torch.rand(batch, spec.action_horizon, spec.action_dim, generator=gen) * 2 - 1
    return images, state, text_ids, text_mask, model.action_binner.encode(actions).flatten(1)


def counted_training_flops(model: RobotTransformer) -> int:
    """FLOPs of one forward and backward of ``model`` on ``random_inputs``, as torch's flop counter
    sees them (set a plain-matmul kernel backend first, so it sees every matmul)."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    images, state, text_ids, text_mask, actions = random_inputs(model)
    with FlopCounterMode(display=False) as counter:
        logits = model(images, state, text_ids, text_mask, actions)
        F.cross_entropy(logits.flatten(0, 1), actions.flatten()).backward()
    return counter.get_total_flops()


# ---- uma parity on many models in one launch -------------------------------------------------------

# Two layers of width 32 whose heads, kv heads and feed-forward split over tp 2.
PARITY_SIZE = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64}
# The same with 4 experts (top-2, one shared) in both layers, for the expert-parallel strategies and
# pipeline stages; with a sequence loss and proportional bias steps, which move with every count.
PARITY_EXPERTS = {
    "n_experts": 4,
    "top_k": 2,
    "n_shared": 1,
    "expert_dim": 32,
    "bias_update": "proportional",
    "bias_update_rate": 0.05,
}
PARITY_MOE = ["--model.network.size", json.dumps({**PARITY_SIZE, "moe": {**PARITY_EXPERTS, "aux_loss_weight": 0.01}})]
# Without the sequence-level loss, which needs whole sequences: tensor parallelism splits them.
PARITY_MOE_TP = ["--model.network.size", json.dumps({**PARITY_SIZE, "moe": PARITY_EXPERTS})]
PARITY_DATA = ["--data.generation.n_episodes", "6", "--data.loader.num_workers", "0", "--data.batch_size", "8"]


def parity_case(
    label: str,
    strategies: str,
    *overrides: str,
    module: str | None = None,
    config: str = RECIPE,
    steps: int = 3,
    **strategy_args,
):
    """A ``uma parity`` case: the recipe ``config`` (pretrain) with the small model, ``overrides`` and the
    LightningModule class ``module`` (with its init args as ``--model.init_args.KEY`` overrides)."""
    from uma_lightning.tools.parity import Case, resolve

    chosen = ["--model", module] if module else []
    args = [*chosen, "--model.network.size", json.dumps(PARITY_SIZE), *PARITY_DATA, *overrides]
    built, batches, trainer_args = resolve(config, args, steps)
    return Case(label, built, batches, strategies.split(","), trainer_args, strategy_args)


def logged_run(tmp_path, monkeypatch, metrics: dict[str, list[float]]) -> str:
    """A run directory (``tmp_path``) whose checkpoint names an MLflow run (a file store) that logged ``metrics``."""
    from mlflow.tracking import MlflowClient

    from uma_lightning.checkpoint.directory import step_dirname
    from uma_lightning.checkpoint.manifest import FORMAT

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()  # a file store: seconds faster to open than sqlite, which migrates its schema
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("steps")).info.run_id
    for name, values in metrics.items():
        for step, value in enumerate(values):
            client.log_metric(run_id, name, value, step=step)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"logger": {"init_args": {"tracking_uri": uri}}}}))
    checkpoint = tmp_path / "checkpoints" / step_dirname(3)
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text(json.dumps({"format": FORMAT, "files": {}, "mlflow_run_id": run_id}))
    return str(tmp_path)
