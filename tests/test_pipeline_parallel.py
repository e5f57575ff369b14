"""Pipeline parallelism: the split, the options refused before any work, and on two gloo processes
a run that resumes bit for bit after SIGKILL, with checkpoints that load across strategies."""

import json
import shutil
import time

import forked_cli
import pytest
import torch
from checkpoint_helpers import assert_bitwise_equal, checkpoint_tensors
from checkpoint_modules import recorded_steps, resume_recipe
from suite import RECIPE, SPEC, assert_short_error, run_main

from uma_lightning.cli import UmaCLI
from uma_lightning.models import (
    RobotFlowTransformer,
    RobotModelConfig,
    RobotTransformer,
    TransformerConfig,
    VisionConfig,
)
from uma_lightning.models.flops import training_flops_per_sample
from uma_lightning.parallel import MeshShape
from uma_lightning.parallel.pipeline import PipelineConfig
from uma_lightning.parallel.plans.pipeline import balanced_starts, check_pipeline, split_robot, unit_flops

# Two layers: the fewest two stages take.
TWO_LAYERS = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64}
# The same with experts in layer 1 only: the second stage's, so the first stage (rank 0, which
# logs) holds no MoE layer. A proportional bias step and a sequence loss, so both take part.
MOE_IN_LAYER_1 = {**TWO_LAYERS, "moe": {"n_experts": 4, "top_k": 2, "n_shared": 1, "every_n_layers": 2, "expert_dim": 32,
                                        "bias_update": "proportional", "bias_update_rate": 0.01, "aux_loss_weight": 0.01}}  # fmt: skip


def meta_robot(n_layers: int, vision: VisionConfig = VisionConfig()) -> RobotTransformer:
    with torch.device("meta"):
        return RobotTransformer(
            RobotModelConfig(
                TransformerConfig(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=128), SPEC, vision=vision
            )
        )


# ---- the split: no processes ------------------------------------------------------------------------


def test_split_balances_flops_counting_the_tokenizers_and_is_overridden_by_split_points():
    model = meta_robot(12)
    costs = unit_flops(model)
    assert sum(costs) == training_flops_per_sample(model.cfg)  # the units' FLOPs add up to the model's
    split = split_robot(model, 2, None)
    assert (
        split.starts == (0, 6)
        and split.describe() == "stage 0: tokenizers + layers 0-5 (50% of FLOPs), stage 1: layers 6-11 + heads (50%)"
    )
    for start in range(1, 12):  # no other cut has a lighter heaviest stage
        assert max(split_robot(model, 2, (start,)).shares) >= max(split.shares)
    # A convolutional keypoint tokenizer at full resolution outweighs ten layers: stage 0 keeps one.
    heavy = meta_robot(12, VisionConfig(tokenizer="keypoints", n_keypoints=8, channels=32))
    assert unit_flops(heavy)[0] > 10 * unit_flops(heavy)[1]
    assert split_robot(heavy, 2, None).starts == (0, 1)
    manual = split_robot(model, 3, (4, 8))
    assert [manual.layers(s) for s in range(3)] == [range(0, 4), range(4, 8), range(8, 12)]
    assert abs(sum(manual.shares) - 1) < 1e-12
    assert balanced_starts([0, 5, 5, 5, 5, 0], 2) == (0, 2)
    assert balanced_starts([0, 1, 1, 1, 9, 0], 2) == (0, 3)


def test_stages_of_each_rank_follow_the_schedule():
    assert PipelineConfig("1F1B").stage_indices(4, 1) == [1]
    assert PipelineConfig("Interleaved1F1B", virtual_stages=2).stage_indices(4, 1) == [1, 5]  # a loop
    assert PipelineConfig("ZBVZeroBubble", virtual_stages=2).stage_indices(4, 1) == [
        1,
        6,
    ]  # a V: rank 0 holds the first and last


@pytest.mark.parametrize(
    "options, message",
    [
        (
            ["--trainer.strategy.pipeline.microbatches", "1"],
            "pipeline.microbatches 1 is fewer than the 2 pipeline ranks",
        ),
        (
            ["--trainer.strategy.pipeline.microbatches", "3"],
            "a batch of 4 samples (data.batch_size) does not divide into 3 microbatches",
        ),
        (
            ["--trainer.strategy.pipeline.virtual_stages", "2"],
            "pipeline.schedule 1F1B runs one stage per rank, got pipeline.virtual_stages 2",
        ),
        (
            [
                "--trainer.strategy.pipeline.schedule",
                "ZBVZeroBubble",
                "--trainer.strategy.pipeline.virtual_stages",
                "3",
            ],
            "ZBVZeroBubble runs exactly 2 stages per rank",
        ),
        (
            ["--trainer.strategy.pipeline.schedule", "Interleaved1F1B"],
            "Interleaved1F1B interleaves 2 or more stages per rank, got pipeline.virtual_stages 1",
        ),
        (
            [
                "--trainer.strategy.pipeline.schedule",
                "Interleaved1F1B",
                "--trainer.strategy.pipeline.virtual_stages",
                "2",
                "--trainer.strategy.pipeline.microbatches",
                "3",
            ],
            "Interleaved1F1B takes a multiple of the 2 pipeline ranks as pipeline.microbatches, got 3",
        ),
        (
            [
                "--trainer.strategy.pipeline.schedule",
                "Interleaved1F1B",
                "--trainer.strategy.pipeline.virtual_stages",
                "2",
            ],
            "2 backbone layers do not divide into 4 stages",
        ),
        (
            ["--trainer.strategy.pipeline.split", "[2]"],
            "pipeline.split [2]: split points must be increasing layer indices between 1 and 1",
        ),
        (["--trainer.strategy.pipeline.split", "[1, 1]"], "2 stages need 1 split point(s)"),
        (
            ["--model.network.environment_state_weight", "0.5"],
            "pp: the environment-state head reads the first stage's prefix",
        ),
        (
            [
                "--trainer.devices",
                "4",
                "--trainer.strategy.sizes.dp_shard",
                "2",
                "--trainer.strategy.pipeline.schedule",
                "ZBVZeroBubble",
                "--trainer.strategy.pipeline.virtual_stages",
                "2",
                "--model.network.size",
                json.dumps({**TWO_LAYERS, "n_layers": 4}),
            ],
            "pipeline.schedule ZBVZeroBubble with data parallelism (dp 2) gives wrong gradients here",
        ),
    ],
)
def test_bad_pipeline_options_fail_in_one_line_before_any_work(tmp_path, capsys, monkeypatch, options, message):
    monkeypatch.chdir(tmp_path)
    args = [
        "fit", "--config", RECIPE, "--model.network.size", json.dumps(TWO_LAYERS), "--data.generation.n_episodes", "6",
        "--data.loader.num_workers", "0", "--data.batch_size", "4", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
        "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "uma_lightning.parallel.MeshStrategy",
        "--trainer.strategy.sizes.pp", "2", "--trainer.strategy.sizes.dp_shard", "1", "--trainer.default_root_dir", str(tmp_path / "run"), *options,
    ]  # fmt: skip
    code, _, err = run_main(args, capsys)
    assert_short_error(code, err, message)
    assert not (tmp_path / "run").exists()


def test_the_flow_model_is_refused_with_the_reason():
    flow = RobotFlowTransformer.__new__(RobotFlowTransformer)
    with pytest.raises(
        ValueError,
        match="action expert runs after the whole backbone and its layer l attends to backbone layer l's keys",
    ):
        check_pipeline(flow, MeshShape(1, 1, 1, pp=2), PipelineConfig())


# ---- two gloo processes: resume after SIGKILL, checkpoints across strategies --------------------------

DATA = ["--data.generation.n_episodes", "6", "--data.batch_size", "8", "--data.loader.num_workers", "0"]
STEPS = 12


def _argv(recipe: str, run_dir, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        recipe,
        *DATA,
        "--model.network.size",
        json.dumps(MOE_IN_LAYER_1),
        "--trainer.default_root_dir",
        str(run_dir),
        *extra,
    ]


def _recipe(path, record, strategy: str, max_steps: int, callbacks=()) -> str:
    trainer = {
        "strategy": strategy,
        "accelerator": "cpu",
        "devices": 2,
        "max_steps": max_steps,
        "val_check_interval": 5,
        "limit_val_batches": 1,
    }
    expert_metrics = {"class_path": "checkpoint_modules.RecordExpertMetrics", "init_args": {"dir": str(record)}}
    return resume_recipe(path, record, [expert_metrics, *callbacks], every_n_steps=3, trainer=trainer)


def _weights_at_start(path) -> dict:
    return {"class_path": "checkpoint_modules.SaveWeightsAtStart", "init_args": {"path": str(path)}}


def _continue_from(checkpoint, tmp_path, name: str, strategy: str, devices: int = 2) -> dict[str, torch.Tensor]:
    """Train one step from a copy of ``checkpoint`` under ``strategy``; the weights it started from."""
    run_dir = tmp_path / name
    shutil.copytree(checkpoint, run_dir / "checkpoints" / checkpoint.name)
    step = int(checkpoint.name.removeprefix("step-"))
    recipe = _recipe(
        tmp_path / f"{name}.yaml",
        tmp_path / f"{name}-record",
        strategy,
        step + 1,
        [_weights_at_start(tmp_path / f"{name}.pt")],
    )
    if devices == 1:
        UmaCLI(_argv(recipe, run_dir, "--trainer.devices", "1", "--trainer.strategy", "auto"))
    else:
        assert forked_cli.run_as_ranks(_argv(recipe, run_dir), tmp_path / f"{name}.log", tmp_path) == [0, 0], (
            tmp_path / f"{name}.log"
        ).read_text()[-3000:]
    return torch.load(tmp_path / f"{name}.pt", weights_only=True)


def assert_loaded(weights: dict[str, torch.Tensor], checkpoint) -> None:
    """The weights a run started from (MoE balancing biases included) are the checkpoint's, every
    one, bit for bit (float32 widens exactly to float64)."""
    saved = {k.removeprefix("model/"): v for k, v in checkpoint_tensors(checkpoint).items() if k.startswith("model/")}
    assert weights.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(weights[name], value.double()), name


def assert_optimizer_steps(checkpoint, steps: int) -> None:
    """Every parameter's AdamW step count in ``checkpoint`` (the experts' included) is ``steps``:
    the optimizer state came along with the weights across strategies (a fresh one would count 1)."""
    counts = {
        k: float(v)
        for k, v in checkpoint_tensors(checkpoint).items()
        if k.startswith("optimizer/") and k.endswith("/step")
    }
    assert any(".experts.w1" in key for key in counts) and set(counts.values()) == {steps}, counts


@pytest.mark.slow(seconds=25)
@pytest.mark.timeout(600)
def test_pp_trains_resumes_bit_for_bit_after_sigkill_and_its_checkpoints_load_under_fsdp_and_one_process(tmp_path):
    """A model with experts in its second stage's layer; the uninterrupted run logs (rank 0, which
    holds the first stage) that layer's expert metrics at every step."""
    # The uninterrupted run.
    reference = _recipe(tmp_path / "reference.yaml", tmp_path / "reference-record", "pp", STEPS)
    assert forked_cli.run_as_ranks(_argv(reference, tmp_path / "reference"), tmp_path / "reference.log", tmp_path) == [
        0,
        0,
    ]
    log = (tmp_path / "reference.log").read_text()
    assert (
        "pipeline: 2 stages, 1F1B, 2 microbatches; stage 0: tokenizers + layer 0 (" in log
        and "stage 1: layer 1 + heads (" in log
    )
    # The bubble: a share of each step, the stages' mean, so the same on both ranks.
    bubbles = [[r["bubble"] for r in recorded_steps(tmp_path / "reference-record", rank)] for rank in (0, 1)]
    assert bubbles[0] == bubbles[1] and all(0 < b < 1 for b in bubbles[0])
    # Rank 0 has stage 1's expert metrics, of both microbatches: 8 samples of 120 tokens (the
    # recipe's prefix and action tokens), each token choosing 2 experts.
    expert_metrics = [
        json.loads(line) for line in (tmp_path / "reference-record" / "moe.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in expert_metrics] == list(range(1, STEPS + 1))
    layer = "moe/model.backbone.layers.1"
    names = {
        f"{layer}/{name}"
        for name in ("imbalance", "router_entropy", "dropped", "aux_loss", *(f"tokens/expert{i}" for i in range(4)))
    }
    for record in expert_metrics:
        assert record["metrics"].keys() == names
        assert sum(record["metrics"][f"{layer}/tokens/expert{i}"] for i in range(4)) == 8 * 120 * 2
        assert record["metrics"][f"{layer}/aux_loss"] > 0 and record["metrics"][f"{layer}/dropped"] == 0

    # The same command, killed (SIGKILL, both ranks) once step 8 is done, then run again. The killed
    # attempt stalls after step 8, so that it cannot finish before the kill however fast it trains.
    recipe = _recipe(tmp_path / "interrupted.yaml", tmp_path / "record", "pp", STEPS)
    stall = [
        "--trainer.callbacks+=checkpoint_modules.StallAfter",
        "--trainer.callbacks.step=8",
        "--trainer.callbacks.seconds=300",
    ]
    ranks = forked_cli.start_ranks(
        _argv(recipe, tmp_path / "interrupted", *stall), tmp_path / "interrupted.log", tmp_path
    )
    deadline = time.monotonic() + 300
    while not any(r["step"] >= 8 for r in recorded_steps(tmp_path / "record", 0)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in ranks:
        process.kill()
        process.join()
    killed_after = max(r["step"] for r in recorded_steps(tmp_path / "record", 0))
    assert forked_cli.run_as_ranks(_argv(recipe, tmp_path / "interrupted"), tmp_path / "resumed.log", tmp_path) == [
        0,
        0,
    ]
    for rank in (0, 1):
        expected = {r["step"]: r for r in recorded_steps(tmp_path / "reference-record", rank)}
        seen = recorded_steps(tmp_path / "record", rank)
        assert seen[-1]["step"] == STEPS and len(seen) > STEPS  # steps after the last checkpoint ran twice
        assert sorted({r["step"] for r in seen}) == list(range(1, STEPS + 1)) and killed_after == 8
        for record in seen:  # every step, the repeated ones too, saw the same samples and loss as uninterrupted
            assert (record["samples"], record["loss"]) == (
                expected[record["step"]]["samples"],
                expected[record["step"]]["loss"],
            ), (rank, record["step"])
    final = f"checkpoints/step-{STEPS:09d}"
    assert_bitwise_equal(
        checkpoint_tensors(tmp_path / "interrupted" / final), checkpoint_tensors(tmp_path / "reference" / final)
    )

    # The pipeline's checkpoint (each stage saved its own parameters, under the unwrapped model's names)
    # loads whole under FSDP on two processes and into one process; theirs load back into the pipeline.
    pipelined = tmp_path / "reference" / final
    assert checkpoint_tensors(pipelined)["model/model.backbone.layers.1.ffn.experts.w1"].shape == (
        4,
        32,
        32,
    )  # whole, under its plain name
    assert_loaded(_continue_from(pipelined, tmp_path, "fsdp-from-pp", "fsdp"), pipelined)
    assert_loaded(_continue_from(pipelined, tmp_path, "one-from-pp", "auto", devices=1), pipelined)
    next_step = f"checkpoints/step-{STEPS + 1:09d}"
    for source in ("fsdp-from-pp", "one-from-pp"):
        checkpoint = tmp_path / source / next_step
        assert_optimizer_steps(checkpoint, STEPS + 1)
        assert_loaded(_continue_from(checkpoint, tmp_path, f"pp-from-{source.split('-')[0]}", "pp"), checkpoint)
        assert_optimizer_steps(
            tmp_path / f"pp-from-{source.split('-')[0]}" / f"checkpoints/step-{STEPS + 2:09d}", STEPS + 2
        )
