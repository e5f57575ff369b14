"""uma plan: the estimator's arithmetic, the command's output and errors, and its predictions
against a real step of every strategy on four gloo processes."""

import json
import math
import re

import pytest
import yaml
from suite import RECIPE, assert_short_error, logged_run, run_main

from uma_lightning.data.spec import DataSpec
from uma_lightning.models import RobotModelConfig, load_size
from uma_lightning.tools.planner.cluster import ACCELERATORS, LINK_PRESETS, Cluster, Link
from uma_lightning.tools.planner.comm import Collective, seconds
from uma_lightning.tools.planner.estimate import Settings, estimate, pipeline_bubble, save_seconds
from uma_lightning.tools.planner.layout import Layout
from uma_lightning.tools.planner.memory import Precision, chunk, rank_state
from uma_lightning.tools.planner.model import facts_of_config

# Heads, kv heads, feed-forward, action bins and the 44-token sequence all split over tp 4.
SPEC = DataSpec(
    cameras=("front",), image_size=(32, 32), state_dim=5, action_dim=3, n_obs_steps=1, action_horizon=4, fps=10
)
CONFIG = RobotModelConfig(
    load_size({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "ffn_dim": 128}),
    SPEC,
    max_text_len=16,
    n_action_bins=32,
)
CLUSTER = Cluster(2, 4, ACCELERATORS["h100"], 79.2, 989.0, Link(400.0, 3.0), LINK_PRESETS["ib-ndr"])
SIZE_7B = ["--model.network.size", "7b"]


def facts():
    return facts_of_config(CONFIG)


def test_chunks_follow_torch_chunk():
    import torch

    for size, parts in ((10, 4), (5, 4), (3, 4), (64, 4)):
        pieces = [len(p) for p in torch.arange(size).chunk(parts)] + [0] * parts
        assert [chunk(size, parts, i) for i in range(parts)] == pieces[:parts]


def test_state_shards_sum_to_the_whole_model():
    model = facts()
    whole = rank_state(model, Layout(), Precision.of("32-true"))
    layout = Layout(dp_shard=2, tp=2)
    shards = [rank_state(model, layout, Precision.of("32-true"), 0, t, s) for t in range(2) for s in range(2)]
    # Weights tp splits are cut in four pieces; the others are replicated over tp and cut in two by FSDP.
    split = sum(4 * math.prod(p.shape) for p in model.params if p.tp_dim is not None)
    assert sum(s.params for s in shards) == split + 2 * (whole.params - split)
    assert whole.optimizer == 2 * whole.params + 4 * len(model.params)  # two fp32 states and a step per tensor


def test_every_parameter_lives_on_exactly_one_stage_and_expert_shard():
    import dataclasses

    model = facts_of_config(dataclasses.replace(CONFIG, backbone=load_size({"name": "tiny_moe", "n_layers": 4})))
    fp32 = Precision.of("32-true")
    whole = rank_state(model, Layout(), fp32).params
    assert any(p.expert for p in model.params)
    experts = Layout(dp_shard=4, ep=2)  # each expert weight: E split over 2 ranks, each half sharded over the other 2
    assert sum(rank_state(model, experts, fp32, 0, 0, rank).params for rank in range(4)) == whole
    pipeline = Layout(pp=2, virtual_stages=2, microbatches=2)
    assert sum(rank_state(model, pipeline, fp32, stage).params for stage in range(2)) == whole


def test_bubble_and_ring_times():
    assert pipeline_bubble(Layout(pp=4, microbatches=12)) == pytest.approx(3 / 15)
    assert pipeline_bubble(Layout(pp=4, microbatches=12, virtual_stages=2)) == pytest.approx(3 / 27)
    gigabyte = Collective("x", "all-reduce", 10**9, 1, 4, 1, False)
    # Within a node: 2 (n-1)/n of the bytes at 400 GB/s plus 2 (n-1) hops of 3 us.
    assert seconds(gigabyte, CLUSTER) == pytest.approx(1.5e9 / 400e9 + 6 * 3e-6)
    across = Collective("x", "all-gather", 10**9, 2, 2, 4, False)  # ranks 0 and 4: different nodes
    assert seconds(across, CLUSTER) == pytest.approx(2 * (0.5e9 / 45e9 + 5e-6))


def test_save_time_is_the_busiest_nodes_checkpoint_bytes_over_its_disk_bandwidth():
    import dataclasses

    model, fp32 = facts(), Precision.of("32-true")
    cluster = dataclasses.replace(CLUSTER, disk_gb_s=4.0)  # 2 nodes of 4 ranks
    layout = Layout(dp_shard=8)
    shards = [rank_state(model, layout, fp32, 0, 0, rank) for rank in range(8)]
    largest = max(shard.params + shard.optimizer for shard in shards)  # gradients are not saved
    result = estimate(model, layout, cluster, Settings(8, fp32, 0.4))
    assert result.rejected is None and result.checkpoint_bytes == largest
    assert result.save_s == pytest.approx(4 * largest / 4e9)
    # Half the disk bandwidth, twice the time; twice the ranks per node, twice the bytes per node.
    assert save_seconds(largest, 1, dataclasses.replace(cluster, disk_gb_s=2.0)) == pytest.approx(2 * result.save_s)
    assert save_seconds(largest, 1, dataclasses.replace(cluster, nodes=1, gpus_per_node=8)) == pytest.approx(
        2 * result.save_s
    )
    # Two replicas of four shards: each shard is written once, so half the bytes per rank.
    hybrid = estimate(model, Layout(dp_replicate=2, dp_shard=4), cluster, Settings(8, fp32, 0.4))
    assert hybrid.save_s == pytest.approx(4 * hybrid.checkpoint_bytes / 2 / 4e9)


def test_checkpointing_and_pipelines_change_activations_as_their_schedules_say():
    from uma_lightning.tools.planner.memory import activation_bytes, block_activations, in_flight_microbatches

    model, fp32 = facts(), Precision.of("32-true")
    none, ops, full = (activation_bytes(model, Layout(ac=ac), fp32, 8) for ac in ("none", "ops", "full"))
    assert full < ops < none
    # Full checkpointing keeps each of the 2 blocks' input and rebuilds the rest of one block at a time.
    block, block_input = block_activations(model, 8, Layout()), 8 * CONFIG.seq_len * 64
    assert none - full == 4 * (2 * block - 2 * block_input - (block - block_input))
    assert in_flight_microbatches(Layout(pp=4, microbatches=8)) == 4  # 1F1B: one per stage ahead
    assert in_flight_microbatches(Layout(pp=4, microbatches=2)) == 2
    assert in_flight_microbatches(Layout(pp=4, microbatches=8, virtual_stages=2)) == 4 * (1 + 3 / 8)


def test_the_planner_weighs_every_activation_checkpointing_mode_of_the_strategy():
    from typing import get_args

    from uma_lightning.parallel.apply import ActivationCheckpointing
    from uma_lightning.tools.planner.layout import AC_MODES

    assert sorted(AC_MODES) == sorted(get_args(ActivationCheckpointing))


def test_layouts_that_cannot_run_say_why():
    settings = Settings(16, Precision.of("bf16-mixed"), 0.4)
    model = facts()
    assert estimate(model, Layout(tp=8), CLUSTER, settings).rejected == "tp 8 crosses nodes (4 GPUs per node)"
    assert estimate(model, Layout(dp_shard=3), CLUSTER, settings).rejected == "global batch 16 does not split over dp 3"
    # The strategy's own refusals, word for word (layout.strategy_refusal).
    assert estimate(model, Layout(pp=2, dp_shard=4, microbatches=1), CLUSTER, settings).rejected.startswith(
        "pipeline.microbatches 1 is fewer than the 2 pipeline ranks"
    )
    assert estimate(model, Layout(pp=4, dp_shard=2, microbatches=4), CLUSTER, settings).rejected.startswith(
        "pp: 2 backbone layers do not divide into 4 stages"
    )
    tiny_memory = Cluster(2, 4, ACCELERATORS["h100"], 0.001, 989.0, Link(400.0, 3.0), LINK_PRESETS["ib-ndr"])
    assert estimate(model, Layout(dp_shard=8), tiny_memory, settings).rejected.startswith("needs 0.0")


def test_plan_ranks_layouts_and_emits_a_fragment_uma_fit_accepts(tmp_path, capsys):
    fragment = tmp_path / "layout.yaml"
    code, out, _ = run_main(
        [
            "plan",
            "--config",
            RECIPE,
            *SIZE_7B,
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--gpu",
            "h200",
            "--emit-config",
            str(fragment),
            "--json",
        ],
        capsys,
    )
    assert code == 0
    plan = json.loads(out)
    assert plan["model"]["throughput_unit"] == "tokens" and plan["model"]["tokens_per_sample"] > 1
    ranked = [e["tokens_per_s"] for e in plan["ranked"]]
    assert (
        all(a >= b * (1 - 1e-9) for a, b in zip(ranked, ranked[1:]))
        and plan["recommended"]["tokens_per_s"] == ranked[0]
    )
    assert any(r["reason"].startswith("tp 8 crosses nodes") for r in plan["rejected"])
    layout = plan["recommended"]["layout"]
    args = yaml.safe_load(fragment.read_text())["trainer"]["strategy"]["init_args"]["sizes"]
    assert (args["dp_replicate"], args["dp_shard"], args["tp"]) == (
        layout["dp_replicate"],
        layout["dp_shard"],
        layout["tp"],
    )
    code, out, _ = run_main(["fit", "--config", RECIPE, *SIZE_7B, "--config", str(fragment), "--print_config"], capsys)
    printed = yaml.safe_load(out)
    assert code in (0, None) and printed["trainer"]["strategy"]["init_args"]["sizes"]["dp_shard"] == layout["dp_shard"]
    assert printed["data"]["init_args"]["batch_size"] == plan["settings"]["global_batch"] // (
        layout["dp_replicate"] * layout["dp_shard"]
    )


def test_pipeline_and_expert_layouts_are_those_uma_fit_accepts(tmp_path, capsys):
    """The fastest pp, ep and ep_fsdp layouts of a mixture-of-experts model are fragments uma fit
    takes; what the strategy refuses (ep with pp, inside HSDP, with tp) is rejected with its message."""
    from uma_lightning.tools.planner import report
    from uma_lightning.tools.planner.estimate import rank
    from uma_lightning.tools.planner.model import facts_of_stage
    from uma_lightning.tools.planner.tool import build_cluster, build_parser, resolve

    size = ["--model.network.size", "tiny_moe"]
    args, overrides = build_parser().parse_known_args(
        ["--config", RECIPE, *size, "--nodes", "2", "--gpus-per-node", "4", "--gpu", "h200"]
    )
    stage, batch_size, _ = resolve(args.config, overrides)
    bf16 = Precision.of("bf16-mixed")
    cluster = build_cluster(args, bf16, args.nodes, args.gpus_per_node)
    settings = Settings(batch_size * cluster.world_size, bf16, 0.4)
    fits, rejected = rank(facts_of_stage(stage), cluster, settings)
    reasons = [e.rejected for e in rejected]
    for refused in (
        "with pipeline stages is not supported",
        "inside HSDP",
        "experts are either split over ep ranks or computed whole on each tp rank",
    ):
        assert any(refused in reason for reason in reasons), refused
    assert not any(
        e.layout.ep > 1 and (e.layout.pp > 1 or e.layout.tp > 1 or min(e.layout.dp_replicate, e.layout.dp_shard) > 1)
        for e in fits
    )
    for kind in (
        lambda layout: layout.pp > 1,
        lambda layout: layout.ep > 1 and layout.dp_shard == 1,
        lambda layout: layout.ep > 1 and layout.dp_shard > 1,
    ):
        best = next(e for e in fits if kind(e.layout))
        fragment = tmp_path / "layout.yaml"
        fragment.write_text(report.fragment(best, cluster, settings, RECIPE))
        code, out, _ = run_main(["fit", "--config", RECIPE, *size, "--config", str(fragment), "--print_config"], capsys)
        printed = yaml.safe_load(out)["trainer"]["strategy"]["init_args"]
        assert code in (0, None) and (
            printed["sizes"]["pp"],
            printed["sizes"]["ep"],
            printed["pipeline"]["microbatches"] or 1,
        ) == (
            best.layout.pp,
            best.layout.ep,
            best.layout.microbatches,
        )


def test_impossible_request_names_the_smallest_cluster(capsys):
    code, out, _ = run_main(
        [
            "plan",
            "--config",
            RECIPE,
            *SIZE_7B,
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            "--gpu",
            "a100",
            "--precision",
            "32-true",
        ],
        capsys,
    )
    assert code == 1
    assert "impossible: no layout fits 1 x 1 A100" in out
    assert re.search(r"B parameters, \d+ tokens per sample, ", out) and "samples/s" not in out, out
    assert "smallest cluster that fits: --nodes 1 --gpus-per-node 2" in out


@pytest.mark.parametrize(
    "option, value, message",
    [("--gpu", "h300", "--gpu: unknown accelerator 'h300'"), ("--nodes", "0", "--nodes: must be a positive integer, got 0"),
     ("--mfu", "1.5", "--mfu: must be a fraction in (0, 1], got 1.5"), ("--inter-node", "wifi", "--inter-node: unknown link preset 'wifi'"),
     ("--calibrate-from", "no/such/run", "--calibrate-from: no/such/run is not a run directory"),
     ("--precision", "fp8", "--precision: unknown precision 'fp8'"), ("--disk-gb-s", "0", "--disk-gb-s: must be > 0, got 0.0")],
)  # fmt: skip
def test_bad_cluster_options_are_one_line_errors(option, value, message, capsys):
    code, _, err = run_main(["plan", "--config", RECIPE, option, value], capsys)
    assert_short_error(code, err, "uma: error:", message)


@pytest.mark.parametrize("every_n_layers, n_shared", [(2, 1), (1, 0)])
def test_expert_layer_activations_match_a_real_forward(every_n_layers, n_shared):
    """In this process: what a mixture-of-experts model's forward saves (router, routed tokens, experts)."""
    import dataclasses

    from uma_lightning.models import RobotTransformer
    from uma_lightning.tools.planner.check import random_batch, saved_activation_bytes
    from uma_lightning.tools.planner.memory import activation_bytes

    moe = {"n_experts": 8, "top_k": 2, "n_shared": n_shared, "every_n_layers": every_n_layers, "expert_dim": 128}
    cfg = dataclasses.replace(CONFIG, backbone=load_size({"name": "tiny_moe", "n_layers": 4, "moe": moe}))
    inputs, saved = random_batch(cfg, 8, seed=0), {}
    with saved_activation_bytes(model := RobotTransformer(cfg), saved):
        model(*inputs, loss_targets=inputs[-1])
    predicted = activation_bytes(facts_of_config(cfg), Layout(), Precision.of("32-true"), 8)
    assert predicted == pytest.approx(saved["bytes"], rel=0.2)


@pytest.mark.slow
def test_predictions_match_a_real_step_of_every_strategy():
    """One launch of four gloo processes: ddp, fsdp, tp, hsdp, fsdp_tp, pp 4, pp 2 with ddp and with fsdp,
    and on tiny_moe ep and ep_fsdp (ep 2), each rank's own figures (per stage under pp). Under pp the
    activations are compared on the first stage only (``planner/check.py`` says why)."""
    import dataclasses

    from uma_lightning.tools.planner.check import EXPERT_LAYOUTS, LAYOUTS, compare

    moe = dataclasses.replace(CONFIG, backbone=load_size({"name": "tiny_moe", "n_layers": 4}))
    four_layers = dataclasses.replace(
        CONFIG, backbone=dataclasses.replace(CONFIG.backbone, n_layers=4)
    )  # a layer for each of pp 4's stages
    cases = {name: (four_layers if layout.pp > 2 else CONFIG, layout) for name, layout in LAYOUTS.items()}
    cases |= {name: (moe, layout) for name, layout in EXPERT_LAYOUTS.items()}
    results = compare(cases, global_batch=8)
    for name, ranks in results.items():
        # The outputs a rank's experts send back are the tokens routed to them, as many as the ranks send
        # on average only: the all-to-all bytes are compared over all ranks, the rest rank by rank.
        exchanged = [
            sum(r[side]["collectives"].get("all-to-all", 0) for r in ranks) for side in ("measured", "predicted")
        ]
        assert exchanged[1] == pytest.approx(exchanged[0], rel=0.05), (name, exchanged)
        for rank, result in enumerate(ranks):
            measured, predicted = (
                {k: v for k, v in r["collectives"].items() if k != "all-to-all"}
                for r in (result["measured"], result["predicted"])
            )
            for part in ("params", "grads", "optimizer"):
                assert result["measured"][part] == result["predicted"][part], (
                    name,
                    rank,
                    part,
                    result["measured"][part],
                    result["predicted"][part],
                )
            assert sum(predicted.values()) == pytest.approx(sum(measured.values()), rel=0.05), (
                name,
                measured,
                predicted,
            )
            for kind, size in measured.items():
                assert predicted.get(kind, 0) == pytest.approx(size, rel=0.05), (name, kind)
            measured, predicted = result["measured"], result["predicted"]
            if predicted["activations"] is not None:
                assert predicted["activations"] == pytest.approx(measured["activations"], rel=0.2), (name, rank)


def test_mfu_is_calibrated_from_the_median_a_run_logged(tmp_path, monkeypatch):
    from uma_lightning.tools.planner.calibrate import measured_mfu

    logged_run(tmp_path, monkeypatch, {"throughput/mfu_percent": [31.0, 45.0, 38.0]})
    assert measured_mfu(str(tmp_path)) == pytest.approx(0.38)
    with pytest.raises(ValueError, match="not a run directory"):
        measured_mfu(str(tmp_path / "checkpoints"))


@pytest.mark.slow(seconds=20)
def test_plan_sizes_paligemma_3b_with_a_300m_expert_from_its_config_alone(tmp_path, capsys):
    """pi0's shape: PaliGemma 3B and an action expert of width 1024 (about 300M parameters) on 8 nodes
    of 8 H200, from a directory holding config.json and a tokenizer only, built on the meta device."""
    import torch
    from hf_models import paligemma_3b_config_dir
    from suite import recipe

    from uma_lightning.models.vlm import import_transformers

    directory = paligemma_3b_config_dir(tmp_path)
    assert sorted(file.suffix for file in directory.iterdir()) == [".json", ".json", ".json"]  # no weights
    transformers = import_transformers()
    with torch.device("meta"):
        vlm = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.from_pretrained(directory))
    vlm_parameters = sum(parameter.numel() for parameter in vlm.parameters())
    assert vlm_parameters == pytest.approx(2.92e9, rel=0.002)  # the published size of PaliGemma 3B

    code, out, err = run_main(["plan", "--config", recipe("posttrain_vlm"), "--model.network.pretrained", str(directory),
                               "--model.expert", json.dumps({"dim": 1024, "ffn_dim": 4096}),
                               "--nodes", "8", "--gpus-per-node", "8", "--gpu", "h200", "--json"], capsys)  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    assert plan["model"]["network"] == "VLMFlowModel"
    assert (
        0.25e9 < plan["model"]["parameters"] - vlm_parameters < 0.35e9
    )  # the expert, the state and action projections
    recommended = plan["recommended"]
    layout = recommended["layout"]
    assert layout["dp_replicate"] * layout["dp_shard"] * layout["tp"] * layout["pp"] == 64
    assert recommended["peak_bytes"] < 139.8 * 2**30 and recommended["tokens_per_s"] > 0
    # Training needs the weights: refused before it starts, in one line naming the directory.
    code, _, err = run_main(["fit", "--config", recipe("posttrain_vlm"), "--model.network.pretrained", str(directory),
                             "--model.expert", json.dumps({"dim": 1024, "ffn_dim": 4096}), "--trainer.logger", "false"],
                            capsys)  # fmt: skip
    assert_short_error(code, err, f"model.network.pretrained: {directory}: cannot initialise VLMFlowModel from it: ",
                       f"is missing from {directory}")  # fmt: skip


@pytest.mark.slow
def test_plan_sizes_smolvlm_256m_from_its_config_alone(tmp_path, capsys):
    """The other family at its published size: SmolVLM-256M (Idefics3) with the post-training recipe's
    expert, on one node of 8 H200, from config.json and a tokenizer, on the meta device."""
    import torch
    from hf_models import smolvlm_256m_config_dir
    from suite import recipe

    from uma_lightning.models.vlm import import_transformers

    directory = smolvlm_256m_config_dir(tmp_path)
    transformers = import_transformers()
    with torch.device("meta"):
        vlm = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.from_pretrained(directory))
    vlm_parameters = sum(parameter.numel() for parameter in vlm.parameters())
    assert vlm_parameters == pytest.approx(2.56e8, rel=0.01)  # the published size, in its name
    code, out, err = run_main(["plan", "--config", recipe("posttrain_vlm"), "--model.network.pretrained", str(directory),
                               "--nodes", "1", "--gpus-per-node", "8", "--gpu", "h200", "--json"], capsys)  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    assert plan["model"]["network"] == "VLMFlowModel" and plan["model"]["parameters"] > vlm_parameters
    recommended = plan["recommended"]
    layout = recommended["layout"]
    assert layout["dp_replicate"] * layout["dp_shard"] * layout["tp"] * layout["pp"] == 8
    assert recommended["peak_bytes"] < 139.8 * 2**30 and recommended["tokens_per_s"] > 0
