"""Parallelism: mesh validation, the strategies on real gloo process groups, parity with one process, launchers."""

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from dataclasses import is_dataclass
from typing import get_type_hints

import forked_cli
import mlflow
import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from mlflow import MlflowClient
from suite import RECIPE, REPO, TESTS, assert_short_error, free_port, run_main
from torch import nn

from uma_lightning.checkpoint.storage import tensor_metadata
from uma_lightning.models import RobotTransformer
from uma_lightning.parallel import MeshShape, MeshStrategy, PipelineConfig, plan_for, register_strategies
from uma_lightning.parallel.apply import ParallelConfig, apply_ac
from uma_lightning.parallel.mesh import resolve_mesh_shape
from uma_lightning.parallel.strategy import PRESETS
from uma_lightning.policy import Policy
from uma_lightning.tools.parity import TOLERANCES, needs_experts, random_network
from uma_lightning.tools.parity import main as parity_main
from uma_lightning.tools.parity.compare import first_routing_difference

sys.path.insert(0, str(REPO / "benchmarks"))
from mlflow_serve import observations  # noqa: E402  (random observations of a policy's shapes)

# The names below (fsdp_tp, our ddp and fsdp...) are the ones the uma command registers.
register_strategies()

# Small enough for several gloo processes on two cores: 2 layers of width 32, 6 short episodes.
TINY = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64}
DATA = ["--data.generation.n_episodes", "6", "--data.loader.num_workers", "0"]


def sizes(dp_replicate, dp_shard, tp, ep=1):
    return {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "ep": ep}


# ---- mesh sizes and registry: no processes -------------------------------------------------------


def test_mesh_sizes_resolve_auto_and_node():
    assert resolve_mesh_shape(sizes(1, "auto", 1), 8, 8) == MeshShape(1, 8, 1)
    assert resolve_mesh_shape(sizes("auto", "node", 1), 16, 8) == MeshShape(2, 8, 1)  # HSDP: shard within nodes
    assert resolve_mesh_shape(sizes(1, "auto", "node"), 16, 4) == MeshShape(1, 4, 4)  # TP within nodes
    assert resolve_mesh_shape(sizes("auto", 1, 1, "auto"), 4, 4) == MeshShape(
        4, 1, 1, ep=4
    )  # ep: experts over all, rest DDP
    assert resolve_mesh_shape(sizes(1, "auto", 1, "node"), 8, 4) == MeshShape(
        1, 8, 1, ep=4
    )  # ep_fsdp: experts within nodes
    assert MeshShape(1, 8, 1, ep=4).expert_dp == 2 and MeshShape(1, 8, 1, ep=4).world_size == 8  # ep adds no processes


@pytest.mark.parametrize(
    "asked, world, message",
    [
        (sizes(1, 1, 3), 2, "mesh dp_replicate 1 x dp_shard 1 x tp 3 needs 3 processes, but the world size is 2"),
        (sizes(1, "auto", 3), 4, "4 processes do not divide by 3, so dp_shard 'auto' has no size"),
        (sizes("auto", "auto", 1), 4, "at most one of pp, dp_replicate, dp_shard, tp may be 'auto'"),
        (sizes(0, "auto", 1), 4, "dp_replicate must be a positive integer, 'auto' or 'node', got 0"),
        (
            sizes(1, "auto", 1, 3),
            4,
            "ep 3 does not divide the 4 data-parallel ranks (dp_shard) it splits the experts over",
        ),
        (sizes(2, "auto", 1, 2), 4, "ep 2 inside HSDP (dp_replicate and dp_shard both above 1) is not supported"),
    ],
)
def test_bad_mesh_sizes_name_the_numbers(asked, world, message):
    with pytest.raises(ValueError) as error:
        resolve_mesh_shape(asked, world, world)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("ddp", MeshShape(2, 1, 1)),
        ("fsdp", MeshShape(1, 2, 1)),
        ("tp", MeshShape(1, 1, 2)),
        ("hsdp", MeshShape(1, 2, 1)),
        ("fsdp_tp", MeshShape(1, 1, 2)),
        ("pp", MeshShape(1, 1, 1, pp=2)),
        ("pp_fsdp", MeshShape(1, 1, 1, pp=2)),
        ("ep", MeshShape(2, 1, 1, ep=2)),
        ("ep_fsdp", MeshShape(1, 2, 1, ep=2)),
    ],  # fmt: skip
)
def test_strategy_names_select_the_mesh_strategy_on_cpu(name, shape):
    # Lightning's own "fsdp" needs a GPU; ours runs anywhere gloo does.
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    assert type(trainer.strategy) is MeshStrategy
    assert trainer.strategy.shape == shape
    assert StrategyRegistry[name]["strategy"] is MeshStrategy


STRATEGY_ARGUMENTS = inspect.signature(MeshStrategy.__init__).parameters
STRATEGY_SECTIONS = {name: hint for name, hint in get_type_hints(MeshStrategy.__init__).items() if is_dataclass(hint)}


def strategy_settings(init_args) -> dict:
    """Every argument of MeshStrategy for ``init_args`` (a dict or a parsed namespace), defaults filled in."""
    given = dict(init_args.items()) if isinstance(init_args, dict) else init_args.as_dict()
    settings = {name: given.get(name, p.default) for name, p in STRATEGY_ARGUMENTS.items() if name != "self"}
    for name, section in STRATEGY_SECTIONS.items():
        if isinstance(settings[name], dict):
            settings[name] = section(**settings[name])
    return settings


def restated_defaults(init_args: dict) -> list[str]:
    """The keys of a fragment's init_args that set what MeshStrategy sets anyway."""
    restated = []
    for name, value in init_args.items():
        if name in STRATEGY_SECTIONS:
            default = STRATEGY_ARGUMENTS[name].default
            restated += [f"{name}.{key}" for key, v in value.items() if getattr(default, key) == v]
        elif STRATEGY_ARGUMENTS[name].default == value:
            restated.append(name)
    return restated


def test_every_strategy_fragment_is_its_preset_and_restates_no_default():
    """configs/strategy/NAME.yaml, parsed as uma parses it, sets what --trainer.strategy NAME does (PRESETS),
    and only what differs from MeshStrategy's defaults."""
    import yaml
    from jsonargparse import ActionConfigFile
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_lightning_class_args(Trainer, "trainer")
    fragments = sorted((REPO / "configs" / "strategy").glob("*.yaml"))
    assert {f.stem for f in fragments} == set(PRESETS)
    for fragment in fragments:
        strategy = parser.parse_args(["--config", str(fragment)]).trainer.strategy
        assert strategy.class_path == "uma_lightning.parallel.MeshStrategy"
        assert strategy_settings(strategy.init_args) == strategy_settings(PRESETS[fragment.stem][1]), fragment.name
        written = yaml.safe_load(fragment.read_text())["trainer"]["strategy"].get("init_args", {})
        assert restated_defaults(written) == [], fragment.name
    # Both ways: a fragment that sets another layout than its preset, or restates a default, is told apart.
    assert strategy_settings({"sizes": {"tp": 2}}) != strategy_settings(PRESETS["fsdp_tp"][1])
    restating = {"sizes": {"tp": "node", "dp_shard": "auto"}, "wrapping": {"compile": "none"}}
    assert restated_defaults(restating | {"save_distributed_checkpoint": True}) == [
        "sizes.dp_shard",
        "wrapping.compile",
        "save_distributed_checkpoint",
    ]


def test_plans_are_found_by_model_class_and_subclass():
    class MyRobot(RobotTransformer):
        pass

    assert plan_for(nn.Linear(2, 2)) is None
    assert plan_for(MyRobot.__new__(MyRobot)).name == "robot"


def test_a_module_without_a_plan_gets_the_generic_one_and_one_without_parameters_is_refused():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(2, 2)

    trainer = Trainer(strategy="fsdp", accelerator="cpu", devices=2, logger=False)
    trainer.strategy.check_module(Plain())  # data parallelism needs no plan
    with pytest.raises(ValueError, match=r"^Module holds no parameters to lay out on mesh dp_replicate 1 x dp_shard 2"):
        trainer.strategy.check_module(nn.Module())


def test_bad_strategy_options_are_refused():
    with pytest.raises(ValueError, match="wrapping.activation_checkpointing must be none, full or ops, got 'all'"):
        ParallelConfig(activation_checkpointing="all")
    with pytest.raises(ValueError, match="wrapping.compile must be none or blocks, got 'model'"):
        ParallelConfig(compile="model")


@pytest.mark.parametrize("mode", ["full", "ops"])
def test_activation_checkpointing_keeps_names_values_and_gradients(mode):
    from uma_lightning.models import TransformerConfig
    from uma_lightning.models.transformer import Transformer

    torch.manual_seed(0)
    plain = Transformer(TransformerConfig(**TINY, name="t"), max_seq_len=16)
    checkpointed = Transformer(TransformerConfig(**TINY, name="t"), max_seq_len=16)
    checkpointed.load_state_dict(plain.state_dict())
    assert "2 blocks" in apply_ac(
        list(checkpointed.layers), ParallelConfig(activation_checkpointing=mode, ac_every_n_blocks=1)
    )
    x = torch.randn(2, 16, 32)
    for model in (plain, checkpointed):
        model(x, prefix_len=4).square().mean().backward()
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.equal(a.grad, b.grad), name  # recomputation repeats the same arithmetic


@pytest.mark.parametrize("head", [False, True])
def test_every_trainable_parameter_of_the_flow_network_gets_a_gradient(head):
    """Adam keeps state only for parameters that got a gradient, and a resume loads the optimizer
    state of every trainable one: the last backbone block's outputs, which nothing reads without an
    environment-state head, must be frozen, LoRA adapters on them too (resuming post-training under
    FSDP failed with "Missing optimizer state for parameter 'model.backbone.layers.3.attn.wq.weight'")."""
    import dataclasses

    from suite import PARITY_SIZE, SPEC

    from uma_lightning.models.network import flow_network

    network = {"size": PARITY_SIZE, **({"environment_state_weight": 0.5} if head else {})}
    lora = {"targets": ["backbone.layers.*.attn.wq", "backbone.layers.*.attn.wv"], "rank": 2}
    model, _ = flow_network(
        {
            "network": network,
            "spec": dataclasses.replace(SPEC, environment_state_dim=2 if head else 0),
            "expert": {"dim": 32, "ffn_dim": 64},
            "lora": lora,
        }
    )
    out = model(*flow_inputs(model, batch=3, seed=0), with_environment_state=head)
    flow_loss(out).backward()
    assert [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None] == []
    last = "backbone.layers.1.attn.wq.lora_a"
    assert (
        model.get_parameter(last).requires_grad == head
        and model.get_parameter("backbone.norm.weight").requires_grad == head
    )


@pytest.mark.parametrize("mode", ["full", "ops"])
def test_checkpointed_blocks_that_read_a_kv_cache_recompute_what_their_forward_saw(mode):
    """Post-training's action expert attends to the backbone's cached keys: a block recomputed in
    backward must see the cache as its forward did, not as later blocks and calls left it."""
    from suite import small_config

    from uma_lightning.models import ActionExpertConfig, RobotFlowTransformer

    torch.manual_seed(0)
    plain = RobotFlowTransformer(small_config(), ActionExpertConfig(dim=32, ffn_dim=64))
    checkpointed = RobotFlowTransformer(small_config(), ActionExpertConfig(dim=32, ffn_dim=64))
    checkpointed.load_state_dict(plain.state_dict())
    blocks = [*checkpointed.backbone.layers, *checkpointed.expert.layers]
    apply_ac(blocks, ParallelConfig(activation_checkpointing=mode))
    inputs = flow_inputs(plain, batch=3, seed=1)
    for model in (plain, checkpointed):
        flow_loss(model(*inputs)).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        assert a.grad is None or torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("mode", ["full", "ops"])
def test_a_block_recomputed_in_backward_runs_under_the_forwards_default_dtype(mode):
    """Lightning's "true" precisions set the default dtype around the forward only: the recompute in
    backward must run under the forward's, or a compiled block is compiled a second time."""
    from torch._dynamo.utils import counters

    from uma_lightning.models import TransformerConfig
    from uma_lightning.models.transformer import Transformer
    from uma_lightning.parallel.apply import apply_compile

    model = Transformer(TransformerConfig(**TINY, name="t"), max_seq_len=16).double()
    config = ParallelConfig(activation_checkpointing=mode, compile="blocks", compile_backend="eager")
    apply_ac(list(model.layers), config)
    apply_compile(list(model.layers), config)
    dtypes_seen = []  # at every call of the first block: forward, then recompute
    model.layers[0].register_forward_pre_hook(lambda *_: dtypes_seen.append(torch.get_default_dtype()))
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):
        torch.set_default_dtype(torch.float64)
        try:
            loss = model(torch.randn(2, 16, 32, requires_grad=True), prefix_len=4).square().mean()  # as embeddings are
        finally:
            torch.set_default_dtype(torch.float32)
        loss.backward()
    assert torch.get_default_dtype() == torch.float32
    assert dtypes_seen == [torch.float64] * 4, dtypes_seen  # two forwards, two recomputes
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_compiled_flow_model_keeps_every_variant_of_each_kind_of_block_compiled():
    """Backbone and action-expert blocks share Block.forward: training, evaluation without grad on
    EMA weights, a shorter batch and decoding from a KV cache make more graphs than dynamo keeps per
    function by default (8); past that, variants would run uncompiled."""
    import copy

    from suite import small_config
    from torch._dynamo.utils import counters

    from uma_lightning.models import ActionExpertConfig, RobotFlowTransformer
    from uma_lightning.parallel.apply import apply_compile

    torch.manual_seed(0)
    model = RobotFlowTransformer(small_config(), ActionExpertConfig(dim=32, ffn_dim=64))
    ema = copy.deepcopy(model).requires_grad_(False)
    default_limit = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    counters.clear()
    try:
        described = [
            apply_compile(
                [*network.backbone.layers, *network.expert.layers],
                ParallelConfig(compile="blocks", compile_backend="eager"),
            )
            for network in (model, ema)
        ]
        # Backbone, its last block (whose unread outputs are frozen) and the action expert; the EMA
        # copy's backbone blocks are all frozen alike. Other tests of this process may have compiled more.
        assert [d.split(";")[0] for d in described] == [
            f"torch.compile (eager) per block ({kinds} kind(s) of block" for kinds in (3, 2)
        ]
        assert torch._dynamo.config.recompile_limit >= 8 * 5
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # raise where a variant would run uncompiled
            for batch in (3, 2):  # a full and a shorter last batch
                inputs = flow_inputs(model, batch=batch, seed=batch)
                flow_loss(model(*inputs)).backward()
                with torch.no_grad():
                    model(*inputs)
                    ema(*inputs)
                    images, state, text_ids, text_mask = inputs[:4]
                    ema.predict_actions(images, state, text_ids, text_mask, steps=2)
        assert counters["stats"]["unique_graphs"] > 8, dict(counters["stats"])  # more than one kind's default
    finally:
        torch._dynamo.config.recompile_limit = default_limit
        torch._dynamo.reset()


# ---- an invalid mesh through the CLI: exit 2, one line, nothing started -------------------------


def quick_fit(tmp_path, *args):
    return [
        "fit", "--config", RECIPE, *DATA,
        "--data.batch_size", "4",
        "--trainer.max_steps", "4",
        "--trainer.limit_val_batches", "0",
        "--trainer.accelerator", "cpu",
        "--trainer.default_root_dir", str(tmp_path / "run"),
        *args,
    ]  # fmt: skip


FSDP_TP = str(REPO / "configs" / "strategy" / "fsdp_tp.yaml")
PRESET_LIST = "presets: ddp, fsdp, tp, hsdp, fsdp_tp, pp, pp_fsdp, pp_fsdp_tp, ep, ep_fsdp"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trainer.strategy", "fsdp_tpp"], f"command line: trainer.strategy: unknown strategy 'fsdp_tpp'; did you mean 'fsdp_tp'? ({PRESET_LIST};"),
        (["--config", FSDP_TP, "--trainer.strategy.sizes.dp_shrad", "2"],
         "unknown key 'trainer.strategy.sizes.dp_shrad': trainer.strategy.sizes takes no key 'dp_shrad'; did you mean 'dp_shard'?"),
        (["--config", FSDP_TP, "--trainer.strategy.init_args.wraping.compile", "blocks"],
         "trainer.strategy takes no argument 'wraping'; did you mean 'wrapping'?"),
        (["--config", FSDP_TP, "--trainer.strategy.init_args.pp_schedule", "GPipe"],
         "'trainer.strategy.pp_schedule' is now 'trainer.strategy.pipeline.schedule'"),
        (["--config", FSDP_TP, "--trainer.strategy.pipeline.schedule", "Interleaved1F1B"],
         "trainer.strategy: pipeline.schedule Interleaved1F1B interleaves 2 or more stages per rank, got pipeline.virtual_stages 1"),
        (["--trainer.strategy", "fsdp_tp", "--trainer.strategy.sizes.tp", "2"],
         "trainer.strategy: 'fsdp_tp' is a registered name, which takes no settings; give a class_path with them instead"),
    ],
)  # fmt: skip
def test_a_wrong_strategy_name_or_setting_stops_before_any_work(tmp_path, capsys, monkeypatch, args, message):
    """Before the dataset is generated or the run's tracking directory made: one line, the close name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("UMA_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = run_main(["fit", "--config", RECIPE, *args], capsys)
    assert_short_error(code, err, message)
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no dataset in the cache, no mlruns/


def test_an_old_flat_strategy_key_in_a_fragment_names_its_section(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fragment = tmp_path / "old.yaml"
    fragment.write_text(
        "trainer:\n  strategy:\n    class_path: uma_lightning.parallel.MeshStrategy\n    init_args: {tp: 2}\n"
    )
    code, _, err = run_main(["fit", "--config", RECIPE, "--config", str(fragment)], capsys)
    assert_short_error(code, err, f"{fragment}: 'trainer.strategy.tp' is now 'trainer.strategy.sizes.tp'")
    assert [p.name for p in tmp_path.iterdir()] == ["old.yaml"]


def test_mesh_larger_than_the_world_fails_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = quick_fit(
        tmp_path, "--trainer.devices", "2", "--trainer.logger", "false",
        "--trainer.strategy", "uma_lightning.parallel.MeshStrategy", "--trainer.strategy.sizes.tp", "3", "--trainer.strategy.sizes.dp_shard", "1",
    )  # fmt: skip
    code, _, err = run_main(args, capsys)
    assert_short_error(code, err, "mesh dp_replicate 1 x dp_shard 1 x tp 3 needs 3 processes, but the world size is 2")
    assert not (tmp_path / "run").exists()


def test_heads_that_do_not_divide_by_tp_fail_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = quick_fit(
        tmp_path, "--trainer.devices", "4", "--trainer.strategy", "tp", "--trainer.logger", "false"
    )  # tiny: 6 heads, 2 kv heads
    code, _, err = run_main(args, capsys)
    assert_short_error(code, err, "trainer.strategy: tp 4 does not divide n_heads 6, n_kv_heads 2")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "devices, strategy, message",
    [
        ("3", ["--trainer.strategy", "ep"], "trainer.strategy: ep 3 does not divide the 8 experts of backbone.layers.1.ffn"),
        ("4", ["--config", str(REPO / "configs" / "strategy" / "ep_fsdp.yaml"), "--trainer.strategy.init_args.sizes.ep", "3"],
         "mesh dp_replicate 1 x dp_shard 4 x tp 1: ep 3 does not divide the 4 data-parallel ranks (dp_shard) it splits the experts over"),
    ],
)  # fmt: skip
def test_expert_parallel_sizes_that_do_not_divide_fail_before_any_work(
    tmp_path, capsys, monkeypatch, devices, strategy, message
):
    monkeypatch.chdir(tmp_path)
    args = quick_fit(
        tmp_path,
        "--model.network.size",
        "tiny_moe",
        "--trainer.devices",
        devices,
        *strategy,
        "--trainer.logger",
        "false",
    )
    code, _, err = run_main(args, capsys)
    assert_short_error(code, err, message)
    assert not (tmp_path / "run").exists()


# ---- parity with one process -----------------------------------------------------------------------


def run_parity(tmp_path, strategies, *extra, module=None):
    report = tmp_path / "parity.json"
    args = [
        "--config", RECIPE, "--strategies", strategies, "--steps", "3", "--report", str(report),
        "--model.network.size", json.dumps(TINY), *DATA, "--data.batch_size", "8", *extra,
    ]  # fmt: skip
    if module:
        args += ["--model", module]
    code = parity_main(args)
    return code, json.loads(report.read_text())


def test_parity_refuses_bad_arguments_before_training(capsys):
    assert parity_main(["--config", RECIPE, "--strategies", "ddp,zero"]) == 2
    assert (
        "--strategies: unknown strategy zero; choose from ddp, fsdp, tp, hsdp, fsdp_tp, pp, pp_fsdp, pp_fsdp_tp, ep, ep_fsdp"
        in capsys.readouterr().err
    )
    args = ["--config", RECIPE, "--strategies", "hsdp", "--trainer.logger", "false", *DATA, "--data.batch_size", "6"]
    assert parity_main(args) == 2
    assert "hsdp: global batch 6 (data.batch_size) does not split over 4 data-parallel ranks" in capsys.readouterr().err
    args = ["--config", RECIPE, "--strategies", "ddp,ep", "--trainer.logger", "false", *DATA, "--data.batch_size", "4"]
    assert parity_main(args) == 2
    assert "ep: the model has no mixture-of-experts layers to split" in capsys.readouterr().err
    args = ["--config", RECIPE, "--strategies", "pp", "--pipeline.schedule", "Interleaved1F1B"]
    assert parity_main(args) == 2
    assert (
        "--pipeline.schedule Interleaved1F1B interleaves 2 or more stages per rank, got pipeline.virtual_stages 1"
        in capsys.readouterr().err
    )


def test_parity_takes_the_strategy_sections_as_options_of_the_same_dataclasses():
    import argparse

    from uma_lightning.tools.parity.cli import STRATEGY_SECTIONS as PARITY_SECTIONS
    from uma_lightning.tools.parity.cli import add_section_options, section_of

    parser = argparse.ArgumentParser()
    for name, section in PARITY_SECTIONS.items():
        add_section_options(parser, name, section)
    given = ["--wrapping.compile", "blocks", "--no-wrapping.reshard_after_forward", "--wrapping.ac_every_n_blocks", "2"]
    args = parser.parse_args([*given, "--pipeline.split", "2,4", "--pipeline.microbatches", "4"])
    assert section_of(args, "wrapping", ParallelConfig) == ParallelConfig(
        compile="blocks", reshard_after_forward=False, ac_every_n_blocks=2
    )
    assert section_of(args, "pipeline", PipelineConfig) == PipelineConfig(microbatches=4, split=(2, 4))
    # Nothing given: the dataclasses' own defaults; every setting of each has its option.
    assert section_of(parser.parse_args([]), "wrapping", ParallelConfig) == ParallelConfig()
    listed = parser.format_help()
    for name, section in PARITY_SECTIONS.items():
        assert all(f"--{name}.{field.name}" in listed for field in dataclasses.fields(section) if field.init)
    assert "bf16_params" not in listed  # set from the precision, not an option


def assert_within_tolerance(name, result):
    assert result["ok"], (name, result)
    assert result["initial_param_diff"] == 0.0 and result["replica_difference"] is None
    tol = TOLERANCES[name]
    assert (
        result["max_loss_diff"] <= tol.loss
        and result["max_gradient_diff"] <= tol.grad
        and result["update_diff"] <= tol.update
    )
    assert result["first_divergence"] is None


@pytest.mark.slow(seconds=55)
def test_ddp_fsdp_tp_match_one_process(parity_on_two_processes):
    # Every second block is checkpointed. With the environment-state head, so the auxiliary loss is
    # trained under each layout too.
    results = parity_on_two_processes["recipe"]
    assert list(results) == ["ddp", "fsdp", "tp"]
    for name, result in results.items():
        assert_within_tolerance(name, result)
    # The all-reduce of two ranks adds two numbers, which is exact to reorder: DDP equals one
    # process accumulating the same halves bit for bit.
    assert results["ddp"]["bitwise_vs_accumulation"] and results["ddp"]["bitwise_required"]


@pytest.mark.slow
def test_posttrain_matches_one_process(parity_on_two_processes):
    """The flow model (backbone and action expert, with its EMA) under each layout: every sample's
    noise and flow time are drawn from its id and the step, so one process and the data-parallel
    slices train on the same draws, DDP bit for bit."""
    results = parity_on_two_processes["posttrain"]
    for name, result in results.items():
        assert_within_tolerance(name, result)
    assert results["ddp"]["bitwise_vs_accumulation"]


@pytest.mark.slow
def test_tp_runs_the_instruction_conditioned_keypoint_tokenizer_and_the_environment_state_head(parity_on_two_processes):
    """The FiLM pooling mixes replicated embeddings with the plain text mask, and the environment-state
    head reads the gathered hidden states: the TP plan must handle both. In float64, each step from
    the reference's weights, the updates of the zero-initialised conditioning are judged too."""
    assert_within_tolerance("tp", parity_on_two_processes["keypoints"]["tp"])


@pytest.mark.slow
def test_pretrained_vlm_backbones_match_one_process_under_every_strategy(
    parity_on_two_processes, parity_on_four_processes
):
    """Tiny SmolVLM (Idefics3) and PaliGemma models as backbones, laid out from their own metadata
    (units from _no_split_modules, tp from base_model_tp_plan, the vision tower replicated), in
    float64, with the token head or the flow expert: ddp, fsdp, tp on two processes, fsdp_tp on four."""
    runs = {label: results for label, results in {**parity_on_two_processes, **parity_on_four_processes}.items()
            if label.startswith("vlm ")}  # fmt: skip
    assert {label: list(results) for label, results in runs.items()} == {
        "vlm idefics3 pretrain": ["ddp", "fsdp", "tp"],
        "vlm paligemma posttrain": ["ddp", "fsdp", "tp"],
        "vlm paligemma pretrain": ["fsdp_tp"],
        "vlm idefics3 posttrain": ["fsdp_tp"],
    }
    for label, results in runs.items():
        for name, result in results.items():
            assert_within_tolerance(name, result)
        if "ddp" in results:
            assert results["ddp"]["bitwise_vs_accumulation"], label


@pytest.mark.slow(seconds=55)
@pytest.mark.crowd  # the first to ask for the four-rank parity runs
def test_hsdp_and_fsdp_tp_match_one_process_with_the_other_switches(parity_on_four_processes):
    for name, result in parity_on_four_processes["switches"].items():
        assert_within_tolerance(name, result)


@pytest.mark.slow
def test_model_shapes_drawn_at_random_raise_no_false_alarm(parity_on_two_processes, parity_on_four_processes):
    """A few of benchmarks/parity_sweep.py's shapes, under every strategy: each within tolerance, by a wide margin."""
    shapes = {**{k: v for k, v in parity_on_two_processes.items() if k.startswith("shape")}, **parity_on_four_processes}
    checked = [(label, name) for label, results in shapes.items() if label.startswith("shape") for name in results]
    assert {name for _, name in checked} == {
        name for name in TOLERANCES if not needs_experts(name)
    }  # the drawn shapes are dense
    for label, name in checked:
        result = shapes[label][name]
        assert_within_tolerance(name, result)
        assert result["margin"] > 100, (label, name, result["margin"])  # measured: over 1000


@pytest.mark.slow
def test_experts_match_one_process_with_its_routing_under_ep_tp_and_in_pipeline_stages(
    parity_on_two_processes, parity_on_four_processes
):
    """ep on 2 processes (experts split over both, the rest DDP) and ep_fsdp on 4 (experts split over
    2 and FSDP-sharded over 2, the rest FSDP over 4), the recipe's gradient clipping across both
    meshes; pp (a MoE layer on each of 2 stages) and pp_fsdp (each stage FSDP over 2), whose
    microbatches each add their sequence loss and counts; tp, fsdp_tp and pp_fsdp_tp (each tp rank
    routes its slice of the sequence through whole experts): within tolerance, and every step sends as
    many tokens to each expert of every layer as one process, and leaves the same balancing biases."""
    two, four = parity_on_two_processes["experts"], parity_on_four_processes["experts 4"]
    tp, tp_four = parity_on_two_processes["experts tp"]["tp"], parity_on_four_processes["experts tp 4"]
    for name, result in (
        ("ep", two["ep"]),
        ("ep_fsdp", four["ep_fsdp"]),
        ("pp", two["pp"]),
        ("pp_fsdp", four["pp_fsdp"]),
        ("tp", tp),
        ("fsdp_tp", tp_four["fsdp_tp"]),
        ("pp_fsdp_tp", tp_four["pp_fsdp_tp"]),
    ):
        assert_within_tolerance(name, result)
        assert result["routing_difference"] is None
        assert result["margin"] > 100, (name, result["margin"])  # measured: 1.1e4 for both


@pytest.mark.slow
def test_tokens_sent_to_the_wrong_expert_parallel_rank_diverge_in_their_layer(parity_on_two_processes):
    """Block 0's MoE layer sends each rank's tokens to the next rank: the experts were chosen right
    (routing as one process), but computed by the wrong ones, so the gradients differ from step 1,
    most in that layer; the same model under correct ep is ok (test above)."""
    result = parity_on_two_processes["wrong_rank"]["ep"]
    assert not result["ok"] and result["routing_difference"] is None
    divergence = result["first_divergence"]
    assert divergence["step"] == 1 and divergence["largest"]["parameter"].startswith("model.backbone.layers.0.ffn.")
    assert divergence["largest"]["relative"] > 0.1  # measured: 1.3, against a tolerance of 2.2e-11


def test_a_routing_difference_names_the_step_and_layer():
    layers = ["backbone.layers.0.ffn", "backbone.layers.1.ffn"]
    counts = [dict(zip(layers, torch.tensor([[3, 5], [4, 4]]))), dict(zip(layers, torch.tensor([[2, 6], [4, 4]])))]
    biases = [{f"{layer}.expert_bias": torch.zeros(2) for layer in layers}] * 2
    reference = {"routing": counts, "expert_biases": biases}
    assert first_routing_difference(reference, reference) is None
    moved = {**reference, "routing": [counts[0], {**counts[1], layers[1]: torch.tensor([5, 3])}]}
    assert first_routing_difference(reference, moved) == {
        "step": 2,
        "layer": layers[1],
        "what": "tokens per expert",
        "expected": [4, 4],
        "got": [5, 3],
    }
    # A layer the run did not report on (a pipeline stage's, lost on its way to rank 0) differs too.
    assert (
        first_routing_difference(reference, {**reference, "routing": [{layers[0]: counts[0][layers[0]]}, counts[1]]})[
            "got"
        ]
        is None
    )
    nudged = {
        **reference,
        "expert_biases": [biases[0], {**biases[1], f"{layers[0]}.expert_bias": torch.tensor([0.5, -0.5])}],
    }
    assert first_routing_difference(reference, nudged) == {
        "step": 2,
        "layer": f"{layers[0]}.expert_bias",
        "what": "balancing bias",
        "expected": [0.0, 0.0],
        "got": [0.5, -0.5],
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, strategy, parameter, where",
    [
        # Only that gradient differs, at the first step.
        ("unreduced_gradient", "ddp", "model.backbone.layers.0.ffn.w2.weight", "gradient"),
        # Replicas each keep their own copy: the ranks' copies differ. FSDP shards: the gathered weights differ.
        ("rank_seed", "ddp", "model.text_embed.weight", "replicas"),
        ("rank_seed", "fsdp", "model.text_embed.weight", "initial"),
        ("wrong_dim", "tp", "model.backbone.layers.0.attn.wq.weight", "initial"),
        ("unreduced_norm", "tp", "model.backbone.layers.0.ffn_norm.weight", "gradient"),
        ("wrong_group", "hsdp", "model.text_embed.weight", "gradient"),
        # Gradients summed over the pipeline's microbatches instead of averaged: every one is twice too large.
        ("unscaled_microbatches", "pp", "model.text_embed.weight", "gradient"),
        # A forward bug: every gradient upstream of block 0's MoE layer differs (largest: test below).
        ("wrong_rank", "ep", "model.text_embed.weight", "gradient"),
        # Each tp rank keeps its own tokens' share of the experts' gradients: those gradients differ first.
        ("unsummed_experts", "tp", "model.backbone.layers.0.ffn.experts.w1", "gradient"),
    ],
)
def test_every_injected_bug_is_caught_and_located(
    parity_on_two_processes, parity_on_four_processes, fault, strategy, parameter, where
):
    result = {**parity_on_two_processes, **parity_on_four_processes}[fault][strategy]
    assert not result["ok"]
    assert result["parts_ways_at"] == parameter
    if where == "gradient":
        divergence = result["first_divergence"]
        assert divergence["step"] == 1 and divergence["first"]["parameter"] == parameter
        assert divergence["first"]["relative"] > 1e-3  # a bug's size, against a tolerance of 2.2e-11
        assert result["initial_difference"] is None and result["replica_difference"] is None
        if fault.startswith("unreduced"):
            assert divergence["count"] == 1  # exactly the parameter the bug misses
    else:
        found = result["initial_difference" if where == "initial" else "replica_difference"]
        assert found["parameter"] == parameter and found["max_abs_diff"] > 1e-3


@pytest.mark.slow
def test_pipeline_schedules_match_one_process(parity_on_two_processes, parity_on_four_processes):
    """1F1B (with a MoE layer in each stage), Interleaved1F1B (two stages per rank) alone and under FSDP, ZBVZeroBubble under TP: within tolerance, by a wide margin."""
    results = {**parity_on_two_processes, **parity_on_four_processes}
    for case, strategy in (
        ("experts", "pp"),
        ("interleaved", "pp"),
        ("pipeline fsdp", "pp_fsdp"),
        ("pipeline tp", "pp_fsdp_tp"),
    ):
        result = results[case][strategy]
        assert result["ok"], (case, result["parts_ways_at"])
        assert result["margin"] > 100, case
        assert (
            result["initial_param_diff"] == 0.0
        )  # the stages start from the one-process model's weights, gathered whole


@pytest.mark.slow
def test_parity_catches_and_locates_a_data_parallel_bug(tmp_path, capsys):
    # The module averages its loss over the rank's real tokens: ranks whose samples hold different
    # numbers of real tokens get the wrong weight, so the gradients differ from the first step whose
    # ranks hold different numbers (step 2 of this recipe's data).
    code, results = run_parity(tmp_path, "ddp", module="parallel_faults.TokenMeanPretrain")
    assert code == 1
    ddp = results["ddp"]
    assert not ddp["ok"] and ddp["max_loss_diff"] > 10 * TOLERANCES["ddp"].loss  # measured: 8.6e-4 against 1e-5
    divergence = ddp["first_divergence"]
    assert divergence["step"] == 2 and divergence["first"]["parameter"] == "model.text_embed.weight"
    assert divergence["largest"]["relative"] > 0.01
    out = capsys.readouterr().out
    assert "DIVERGED" in out and "gradients diverge at step 2" in out


# ---- the flow model's plan on two ranks, against one process --------------------------------------


def flow_inputs(model, batch: int, seed: int):
    """Observations, a noisy chunk and flow times for ``model``."""
    gen = torch.Generator().manual_seed(seed)
    spec = model.cfg.spec
    images = torch.randint(
        0, 256, (batch, spec.n_obs_steps, len(spec.cameras), *spec.image_size, 3), dtype=torch.uint8, generator=gen
    )
    state = torch.randn(batch, spec.n_obs_steps, spec.state_dim, generator=gen)
    text_ids, text_mask = model.text_tokenizer(["reach the red square", "go", "touch blue", "push it left"][:batch])
    noisy = torch.randn(batch, spec.action_horizon, spec.action_dim, generator=gen)
    return images, state, text_ids, text_mask, noisy, torch.rand(batch, generator=gen)


def flow_loss(out) -> torch.Tensor:
    # A mean over samples, so data-parallel halves average to the whole batch's loss.
    velocity, progress = out if isinstance(out, tuple) else (out, None)
    return velocity.pow(2).mean() + (progress.pow(2).mean() if progress is not None else 0.0)


def flow_plan_matches_one_process(rank: int, world_size: int, port: int, layout: str) -> None:
    """In each rank: the flow model (LoRA on column- and row-wise layers) and a research subclass with
    a head of its own, laid out by their plan, give the velocities, gradients and sampled actions of
    the plain model on the whole batch."""
    import copy

    import torch.distributed as dist
    from research_module import ProgressRobot
    from suite import small_config
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from uma_lightning.models import ActionExpertConfig, RobotFlowTransformer
    from uma_lightning.models.lora import add_lora
    from uma_lightning.parallel.mesh import build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    shape = FLOW_LAYOUTS[layout]
    mesh = build_mesh(shape, "cpu")
    for model_class in (RobotFlowTransformer, ProgressRobot):
        torch.manual_seed(0)
        reference = model_class(small_config(), ActionExpertConfig(dim=32, ffn_dim=64))
        add_lora(
            reference, ["backbone.layers.*.attn.wq", "backbone.layers.*.attn.wo", "expert.layers.*.ffn.w2"], rank=2
        )
        for name, param in reference.named_parameters():
            if name.endswith("lora_b"):
                torch.nn.init.normal_(param, std=0.02)  # not zero, so the adapters change the outputs
        model = copy.deepcopy(reference)
        applied = plan_for(model).parallelize(model, mesh, ParallelConfig())
        inputs = flow_inputs(reference, batch=4, seed=1)
        # The ranks of a tensor-parallel group share their data-parallel rank's part of the batch.
        part = 4 // shape.dp
        mine = tuple(x[rank // shape.tp * part : (rank // shape.tp + 1) * part] for x in inputs)
        flow_loss(model(*mine)).backward()
        flow_loss(reference(*inputs)).backward()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
            assert param.requires_grad == expected.requires_grad, name
            if expected.grad is not None:
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                torch.testing.assert_close(
                    grad,
                    expected.grad,
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m, name=name: f"{layout} {model_class.__name__} {name}: {m}",
                )
        noise = torch.randn(2, *inputs[4].shape[1:], generator=torch.Generator().manual_seed(2))
        observations = tuple(x[:2] for x in mine[:4])
        with torch.no_grad():
            sampled = model.predict_actions(*observations, steps=2, noise=noise)
            torch.testing.assert_close(
                sampled, reference.predict_actions(*observations, steps=2, noise=noise), rtol=1e-4, atol=1e-5
            )
        if shape.dp_shard > 1:  # the expert's blocks and the research head are sharded one by one
            assert all(isinstance(block, FSDPModule) for block in model.expert.layers), applied
            assert isinstance(getattr(model, "progress_head", None), FSDPModule) == (model_class is ProgressRobot)
        if shape.tp > 1:
            assert "action expert" in applied[0] and ("progress" in applied[0]) == (model_class is ProgressRobot), (
                applied
            )
    dist.barrier()
    dist.destroy_process_group()


FLOW_LAYOUTS = {"tp": MeshShape(1, 1, 2), "fsdp": MeshShape(1, 2, 1), "fsdp_tp": MeshShape(1, 2, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", FLOW_LAYOUTS)
def test_flow_model_plan_matches_one_process(layout):
    forked_cli.run_ranks(flow_plan_matches_one_process, FLOW_LAYOUTS[layout].world_size, free_port(), layout)


def test_random_model_shapes_are_distinct_and_split_over_tp():
    shapes = [json.loads(random_network(seed)[1]) for seed in range(20)]
    assert len({json.dumps(shape, sort_keys=True) for shape in shapes}) == 20
    for shape in shapes:
        assert (
            shape["n_heads"] % shape["n_kv_heads"] == 0 and shape["n_kv_heads"] % 2 == 0 and shape["ffn_dim"] % 2 == 0
        )
    visions = [json.loads(random_network(seed)[3])["tokenizer"] for seed in range(20)]
    heads = [random_network(seed)[5] for seed in range(20)]
    assert set(visions) == {"patches", "keypoints"} and set(heads) == {"0", "0.5"}


# ---- precision against fp32 ----------------------------------------------------------------------


@pytest.mark.slow
def test_precision_check_names_the_layer_that_overflows_in_fp16_and_is_quiet_otherwise():
    from suite import parity_case

    from uma_lightning.tools.parity.precision import compare_precision

    def check(precision, module=None):
        case = parity_case(precision, "", module=module, steps=2)
        return compare_precision(case.module, case.batches, case.trainer_args, precision, None, {})

    overflowing = check("16-mixed", "parallel_faults.OverflowingPretrain")
    assert not overflowing["ok"]
    assert overflowing["ranked"][0]["layer"] == overflowing["flagged"][0] == "model.backbone.layers.0.ffn.w1"
    assert overflowing["ranked"][0]["activation"] == float("inf")
    for precision in ("16-mixed", "bf16-mixed"):
        plain = check(precision)
        assert plain["ok"] and plain["flagged"] == [], plain["ranked"][:3]
        # Every layer within a few units of the precision's rounding (bf16: 2^-8, fp16: 2^-11).
        assert 0 < plain["ranked"][0]["error"] < 16 * (2**-8 if precision == "bf16-mixed" else 2**-11)
        assert plain["skipped_steps"] == []


# ---- uma fit on two processes --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "tp", "ddp"])
def test_uma_fit_trains_on_two_processes(tmp_path, strategy):
    # One validation batch every 2 steps: per-rank metrics must be reduced without Lightning's warning.
    validation = ["--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1", "--data.batch_size", "4"]
    argv = [
        *quick_fit(tmp_path, "--trainer.devices", "2", "--trainer.strategy", strategy, "--model.network.size", json.dumps(TINY), *validation),
        "--trainer.callbacks+", json.dumps({"class_path": "rank_digest.RankDigest", "init_args": {"out_dir": str(tmp_path / "digests")}}),
    ]  # fmt: skip
    codes = forked_cli.run_as_ranks(argv, tmp_path / "job.log", tmp_path, timeout=600)
    log = (tmp_path / "job.log").read_text()
    assert codes == [0, 0], log[-3000:]
    assert (
        log.count("strategy: ") == 1 and "parallel plan robot on RobotTransformer" in log
    )  # rank 0 says what it chose
    assert "step 4/4 | loss" in log and "training: 4 steps, 2 process(es)" in log
    # Both ranks ended with the same full model.
    digests = [json.loads(p.read_text()) for p in sorted((tmp_path / "digests").glob("rank*.json"))]
    assert [d["rank"] for d in digests] == [0, 1] and digests[0]["digest"] == digests[1]["digest"]
    # Rank 0 tracked the run in MLflow: the global-batch loss of every step.
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs(client.get_experiment_by_name("pretrain").experiment_id)
    assert run.data.tags["world_size"] == "2" and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [0, 1, 2, 3]
    # Two validations without one of Lightning's sync_dist warnings:
    # their metrics, reduced over both processes by torchmetrics, are logged all the same.
    assert log.count("validation at step") == 2
    assert "sync_dist=True" not in log and "PossibleUserWarning" not in log, log
    # Under tp, predicted action chunks are left out of validation, and the plan's log line says so.
    validated = ("val/loss",) if strategy == "tp" else ("val/action_mse", "val/action_l1", "val/loss")
    assert ("validation without predicted action chunks" in log) == (strategy == "tp")
    for name in validated:
        assert len(client.get_metric_history(run.info.run_id, name)) == 2, name
    # The final checkpoint: one shard per rank under every strategy, under the unwrapped model's names.
    final = tmp_path / "run" / "checkpoints" / "step-000000004"
    assert sorted(p.name for p in final.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    names = set(tensor_metadata(final))
    assert "model/model.backbone.layers.0.attn.wq.weight" in names
    assert not any("_fsdp" in k or "_orig_mod" in k or "checkpoint_wrapped" in k for k in names)
    # Rank 0 logged the policy of that checkpoint as the run's MLflow Model, after the other rank had left.
    assert "could not log the policy" not in log, log[-3000:]
    (logged,) = client.search_logged_models([run.info.experiment_id])
    assert logged.source_run_id == run.info.run_id
    policy = Policy.from_checkpoint(final)
    observation = observations(policy, batch=2, seed=0)
    predicted = mlflow.pyfunc.load_model(logged.artifact_location).predict(observation)
    assert np.array_equal(predicted, policy(observation).numpy())


# ---- multi-node launch -----------------------------------------------------------------------------


@pytest.mark.slow(seconds=20)
def test_two_nodes_through_torchrun_c10d_rendezvous_train_the_same_model(tmp_path):
    """The torchrun template, started twice as two 'nodes' of one process that meet at a c10d endpoint."""
    env = {
        **os.environ,
        "PYTHONPATH": str(TESTS),
        "PYTHON": sys.executable,
        "NNODES": "2",
        "NPROC_PER_NODE": "1",
        "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
        "RDZV_ID": "two-nodes",
    }
    args = quick_fit(
        tmp_path, "--trainer.strategy", "ddp", "--trainer.logger", "false", "--model.network.size", json.dumps(TINY)
    )[1:]
    args += [
        "--trainer.callbacks+",
        json.dumps({"class_path": "rank_digest.RankDigest", "init_args": {"out_dir": str(tmp_path / "digests")}}),
    ]
    nodes = [
        subprocess.Popen(
            ["bash", str(REPO / "configs/launch/torchrun.sh"), *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    digests = [json.loads(p.read_text()) for p in sorted((tmp_path / "digests").glob("rank*.json"))]
    assert sorted((d["node_rank"], d["rank"]) for d in digests) == [(0, 0), (1, 1)]
    assert {d["environment"] for d in digests} == {"TorchElasticEnvironment"}  # ranks came from torchrun
    assert all(d["world_size"] == 2 and d["global_step"] == 4 for d in digests)
    assert digests[0]["digest"] == digests[1]["digest"]


def test_launch_templates_are_valid():
    import yaml

    launch = REPO / "configs" / "launch"
    for script in ("torchrun.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(launch / script)], check=True)
    assert "srun" in (launch / "slurm.sbatch").read_text()
    job = yaml.safe_load((launch / "kubeflow-pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob"
    for role in ("Master", "Worker"):
        command = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]["command"]
        assert command[:4] == ["torchrun", "-m", "uma_lightning.command", "fit"]
        for config in (command[i + 1] for i, a in enumerate(command) if a == "--config"):
            assert (REPO / config).is_file(), config


def test_throughput_counts_each_sample_once_under_tensor_parallel():
    from uma_lightning.ranks import data_parallel_rank

    # Tensor-parallel ranks share a batch: two TP ranks process one batch, two DDP ranks two.
    assert data_parallel_rank(Trainer(strategy="tp", accelerator="cpu", devices=2, logger=False)) == (0, 1)
    assert data_parallel_rank(Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False)) == (0, 2)
    assert data_parallel_rank(Trainer(accelerator="cpu", devices=1, logger=False)) == (0, 1)
    assert data_parallel_rank(None) == (0, 1)


# ---- the GPU script --------------------------------------------------------------------------------


@pytest.mark.slow(seconds=20)
def test_gpu_strategies_script_cpu_smoke_runs_every_variant_on_every_model_family(tmp_path):
    """benchmarks/gpu/strategies.py --cpu-smoke: the house transformer, the shipped example network (no
    plan, no tokens) and a pretrained VLM (post-training with the flow expert), each under every variant
    (the plan alone, activation checkpointing, compiled blocks), as on the GPU with tiny models."""
    script = REPO / "benchmarks" / "gpu" / "strategies.py"
    out = subprocess.run([sys.executable, str(script), "--cpu-smoke"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0 and "FAILED" not in out.stdout, out.stdout[-4000:] + out.stderr[-4000:]
    rows = [
        line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["tiny"], ["chunk_mlp"], ["smolvlm"])
    ]
    assert [row[0] for row in rows] == ["tiny"] * 6 + ["chunk_mlp"] * 6 + ["smolvlm"] * 6, out.stdout
    tokens_per_s = {row[0]: row[-5] for row in rows}  # then vs baseline, MFU, step ms and peak GiB
    assert tokens_per_s["chunk_mlp"] == "-" and float(tokens_per_s["smolvlm"]) > 0, out.stdout
