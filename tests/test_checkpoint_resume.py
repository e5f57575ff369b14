"""Resume is exact: a run interrupted and continued matches the uninterrupted run bit for bit."""

import json
from pathlib import Path

import forked_cli
import pytest
import torch
from checkpoint_helpers import assert_bitwise_equal, checkpoint_tensors
from checkpoint_modules import MAX_STEPS, TINY_POSTTRAIN, crash_at, recorded_steps
from checkpoint_modules import resume_recipe as write_recipe
from safetensors.torch import load_file
from suite import recipe

from uma_lightning.cli import UmaCLI
from uma_lightning.command import main
from uma_lightning.data.spec import DataSpec
from uma_lightning.models import RobotModelConfig, RobotTransformer, VisionConfig, load_size

# 16 batches per epoch: the runs cross an epoch boundary, and a checkpoint falls on its last batch.
DATA = ["--data.generation.n_episodes", "6", "--data.batch_size", "16", "--data.loader.num_workers", "2"]


def fit(recipe: str, run_dir: Path, *extra: str) -> UmaCLI:
    return UmaCLI(["fit", "--config", recipe, *DATA, "--trainer.default_root_dir", str(run_dir), *extra])


def trained_state(cli: UmaCLI) -> dict[str, torch.Tensor]:
    state = {f"model/{k}": v for k, v in cli.model.state_dict().items()}
    for index, values in cli.trainer.optimizers[0].state_dict()["state"].items():
        state.update({f"optimizer/{index}/{k}": v for k, v in values.items()})
    return state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its steps, its final state, its run directory."""
    root = tmp_path_factory.mktemp("reference")
    cli = fit(write_recipe(root / "recipe.yaml", root / "record"), root / "run")
    assert cli.trainer.global_step == MAX_STEPS
    steps = {r["step"]: r for r in recorded_steps(root / "record")}
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    return {"steps": steps, "state": trained_state(cli), "run_dir": root / "run", "cli": cli}


def test_interrupted_runs_resume_bit_for_bit_with_loader_workers(reference, tmp_path):
    run_dir, record = tmp_path / "run", tmp_path / "record"
    plain = write_recipe(tmp_path / "recipe.yaml", record)
    # Crash after step 19: the newest checkpoint is step 16, the last batch of epoch 0.
    with pytest.raises(RuntimeError, match="injected crash after step 19"):
        fit(write_recipe(tmp_path / "crash19.yaml", record, [crash_at(19)]), run_dir)
    # Resume, crash again after step 21: the newest checkpoint is step 20, in the middle of epoch 1.
    with pytest.raises(RuntimeError, match="injected crash after step 21"):
        cli = fit(write_recipe(tmp_path / "crash21.yaml", record, [crash_at(21)]), run_dir)
    cli = fit(plain, run_dir)
    assert cli.trainer.global_step == MAX_STEPS
    assert cli.trainer.checkpoint_callback.resumed_from == run_dir / "checkpoints" / "step-000000020"

    seen = recorded_steps(record)
    assert [r["step"] for r in seen] == list(range(1, 20)) + [17, 18, 19, 20, 21] + [21, 22]
    for record_ in seen:  # every step, including the repeated ones, saw the same batch and the same loss
        expected = reference["steps"][record_["step"]]
        assert record_["samples"] == expected["samples"], record_["step"]
        assert record_["loss"] == expected["loss"], record_["step"]
    assert_bitwise_equal(trained_state(cli), reference["state"])


def test_exported_weights_load_into_a_plain_model_with_the_same_outputs(reference, tmp_path, capsys):
    output = tmp_path / "model.safetensors"
    with pytest.raises(SystemExit) as exit_info:
        main(["ckpt", "export", str(reference["run_dir"] / "checkpoints"), "--to", str(output)])
    assert exit_info.value.code == 0, capsys.readouterr().err
    assert f"of step {MAX_STEPS}" in capsys.readouterr().out
    weights = load_file(output)
    from safetensors import safe_open

    with safe_open(output, "pt") as file:
        hparams = json.loads(file.metadata()["hyper_parameters"])
    config = RobotModelConfig(
        backbone=load_size(hparams["network"]["size"]),
        spec=DataSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in hparams["spec"].items()}),
        vision=VisionConfig(**hparams["network"]["vision"]),
        max_text_len=hparams["network"]["max_text_len"],
        n_action_bins=hparams["n_action_bins"],
    )
    plain = RobotTransformer(config)
    plain.load_state_dict(weights, strict=True)
    trained = reference["cli"].model.model
    assert not any(name.startswith(("_orig_mod", "model.")) for name in weights)
    batch = next(iter(reference["cli"].datamodule.val_dataloader()))
    text_ids, text_mask = plain.text_tokenizer(batch["instruction"])
    targets = plain.action_binner.encode(batch["actions"]).flatten(1)
    trained.eval(), plain.eval()
    with torch.no_grad():
        expected = trained(batch["images"], batch["state"], text_ids, text_mask, targets)
        actual = plain(batch["images"], batch["state"], text_ids, text_mask, targets)
    assert torch.equal(actual, expected)


def _launch_as_ranks(argv, log, cwd):
    return max(map(abs, forked_cli.run_as_ranks(argv, log, cwd)))


PARALLEL = {
    # Lightning's DDP, its two processes forked by Lightning.
    "ddp": (
        {"strategy": "ddp_fork", "accelerator": "cpu", "devices": 2},
        {},
        lambda argv, log, cwd: forked_cli.run(argv, log, cwd, timeout=300),
    ),
    # FSDP2 through the project's mesh strategy and the robot model's parallel plan.
    # Its two ranks started the way torchrun starts them (Lightning joins them instead of launching its own).
    "fsdp": ({"strategy": "fsdp", "accelerator": "cpu", "devices": 2}, {}, _launch_as_ranks),
    # Post-training's flow model and its EMA copy, laid out alike. The validation at step 5 runs the
    # EMA copy alone, and only backward puts what a forward gathered back in its DTensor form, so the
    # EMA update after it must.
    **{
        f"{strategy} posttrain": (
            {"strategy": strategy, "accelerator": "cpu", "devices": 2},
            {"base": recipe("posttrain"), "model": TINY_POSTTRAIN},
            _launch_as_ranks,
        )
        for strategy in ("ddp", "fsdp")
    },
}


@pytest.mark.slow(seconds=25)
@pytest.mark.parametrize("parallel", sorted(PARALLEL))
def test_two_processes_resume_bit_for_bit(tmp_path, parallel):
    """Two gloo ranks, a loader worker each, a crash mid-epoch, a rerun of the same command."""
    trainer, stage, launch = PARALLEL[parallel]
    status = {}
    for name, callbacks in (("reference", []), ("interrupted", [crash_at(11)]), ("resumed", [])):
        job = tmp_path / ("reference" if name == "reference" else "interrupted")
        recipe_file = write_recipe(
            tmp_path / f"{name}.yaml",
            job / "record",
            callbacks,
            every_n_steps=3,
            trainer={**trainer, "max_steps": 14},
            **stage,
        )
        argv = [
            "fit",
            "--config",
            recipe_file,
            *DATA,
            "--data.loader.num_workers",
            "1",
            "--trainer.default_root_dir",
            str(job / "run"),
        ]
        status[name] = launch(argv, tmp_path / f"{name}.log", tmp_path)
    assert status["reference"] == 0 and status["resumed"] == 0 and status["interrupted"] != 0
    log = (tmp_path / "resumed.log").read_text()
    assert f"resumed from {tmp_path / 'interrupted' / 'run' / 'checkpoints' / 'step-000000009'}: step 9" in log

    for rank in (0, 1):
        expected = {r["step"]: r for r in recorded_steps(tmp_path / "reference" / "record", rank)}
        seen = recorded_steps(tmp_path / "interrupted" / "record", rank)
        assert [r["step"] for r in seen] == list(range(1, 12)) + list(range(10, 15))
        for record in seen:
            assert (
                record["samples"] == expected[record["step"]]["samples"]
                and record["loss"] == expected[record["step"]]["loss"]
            ), (rank, record["step"])
    final = "run/checkpoints/step-000000014"
    tensors = checkpoint_tensors(tmp_path / "interrupted" / final)
    assert_bitwise_equal(tensors, checkpoint_tensors(tmp_path / "reference" / final))
    if "model" in stage:
        assert any(key.startswith("model/ema_model.") for key in tensors)


def test_rollback_mid_training_restores_the_newest_checkpoint(tmp_path):
    rollback = {"class_path": "checkpoint_modules.RollbackAt", "init_args": {"step": 10}}
    cli = fit(
        write_recipe(tmp_path / "recipe.yaml", tmp_path / "record", [rollback]),
        tmp_path / "run",
        "--trainer.max_steps",
        "12",
    )
    callback = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "RollbackAt")
    assert callback.rolled_back_to == 8  # checkpoints every 4 steps
    saved = checkpoint_tensors(tmp_path / "run" / "checkpoints" / "step-000000008")
    assert_bitwise_equal(
        {f"model/{k}": v for k, v in callback.weights_after.items()},
        {k: v for k, v in saved.items() if k.startswith("model/")},
    )
    assert cli.trainer.global_step == 12  # training went on
