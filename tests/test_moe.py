"""Mixture-of-experts feed-forward: the grouped experts equal the per-expert loop, routing picks top-k
with the bias steering only the choice, balancing moves the bias the right way and evens a skewed
router's load (selection noise splitting a block of near-identical tokens), capacity drops are
counted, parameters and FLOPs are counted total vs active, and checkpoints keep plain [E, ...] names."""

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from suite import counted_training_flops, random_inputs, small_config

from uma_lightning.callbacks import ExpertLoad
from uma_lightning.kernels import KernelConfig, expert_feed_forward
from uma_lightning.models import (
    MoEConfig,
    RobotTransformer,
    count_active_parameters,
    count_parameters,
    load_size,
    moe_layers,
    training_flops_per_sample,
)
from uma_lightning.models.moe import ExpertBalancing, combined_stats, sequence_balance_loss
from uma_lightning.models.transformer import TransformerConfig, build_feed_forward

DIM, HIDDEN = 16, 32


def moe_layer(**moe) -> torch.nn.Module:
    cfg = TransformerConfig(
        dim=DIM, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=HIDDEN, moe=MoEConfig(**{"n_experts": 4, **moe})
    )
    torch.manual_seed(0)
    layer = build_feed_forward(cfg, 0)
    layer.init_weights(0.5, 0.5)  # large weights: differences show
    return layer


def moe_model_config(**moe):
    cfg = small_config()
    return dataclasses.replace(
        cfg, backbone=dataclasses.replace(cfg.backbone, moe=MoEConfig(**{"n_experts": 4, "expert_dim": 32, **moe}))
    )


# ---- expert kernels --------------------------------------------------------------------------------


def test_grouped_experts_equal_the_loop_in_values_and_gradients():
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2])  # an expert without tokens too
    x = torch.randn(int(counts.sum()), DIM)
    weights = [torch.randn(4, DIM, HIDDEN), torch.randn(4, DIM, HIDDEN), torch.randn(4, HIDDEN, DIM)]
    results = {}
    for backend in ("loop", "grouped"):
        inputs = [t.clone().requires_grad_() for t in (x, *weights)]
        out = expert_feed_forward(inputs[0], counts, *inputs[1:], backend=backend)
        out.sum().backward()  # a zero-stride gradient, which grouped_mm's own backward rejects
        results[backend] = (out, [t.grad for t in inputs])
    torch.testing.assert_close(results["grouped"][0], results["loop"][0])
    for grouped, loop in zip(results["grouped"][1], results["loop"][1]):
        torch.testing.assert_close(grouped, loop)
    # The loop really is per expert: expert 0's output uses expert 0's weights only.
    first = F.silu(x[:5] @ weights[0][0]) * (x[:5] @ weights[1][0]) @ weights[2][0]
    torch.testing.assert_close(results["loop"][0][:5], first)


def test_grouped_experts_need_aligned_rows_and_auto_falls_back_to_the_loop():
    x, counts = torch.randn(3, 5), torch.tensor([3])
    w13, w2 = torch.randn(1, 5, 8), torch.randn(1, 8, 5)
    with pytest.raises(
        ValueError, match="kernels.experts=grouped needs dim and expert hidden sizes .* got dim 5, hidden 8"
    ):
        expert_feed_forward(x, counts, w13, w13, w2, backend="grouped")
    torch.testing.assert_close(
        expert_feed_forward(x, counts, w13, w13, w2, backend="auto"),
        expert_feed_forward(x, counts, w13, w13, w2, backend="loop"),
    )
    # Aligned rows in float64 (uma parity's dtype), which grouped_mm does not take: the loop, bit for bit.
    x, w13, w2 = (
        torch.randn(3, 8, dtype=torch.float64),
        torch.randn(1, 8, 8, dtype=torch.float64),
        torch.randn(1, 8, 8, dtype=torch.float64),
    )
    assert torch.equal(
        expert_feed_forward(x, counts, w13, w13, w2, backend="auto"),
        expert_feed_forward(x, counts, w13, w13, w2, backend="loop"),
    )
    with pytest.raises(ValueError, match="kernels.experts: unknown backend 'fast'"):
        KernelConfig(experts="fast")


def test_the_moe_layer_is_the_same_through_either_kernel():
    layer = moe_layer(top_k=2, n_shared=1)
    x = torch.randn(2, 7, DIM, requires_grad=True)
    grads = {}
    for backend in ("loop", "grouped"):
        layer.experts.kernels = KernelConfig(experts=backend)
        layer.zero_grad()
        x.grad = None
        out = layer(x)
        out.square().sum().backward()
        grads[backend] = [out.detach(), x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    for grouped, loop in zip(grads["grouped"], grads["loop"]):
        torch.testing.assert_close(grouped, loop)


# ---- routing and balancing ---------------------------------------------------------------------------


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_each_token_gets_its_top_k_experts_weighted_by_renormalised_scores(score):
    layer = moe_layer(top_k=2, score=score)
    tokens = torch.randn(6, DIM)
    x = tokens.view(1, 6, DIM)
    scores = layer.router(tokens).softmax(-1) if score == "softmax" else layer.router(tokens).sigmoid()
    expected = torch.zeros(6, DIM)
    for t in range(6):
        top = scores[t].topk(2).indices
        for e in top.tolist():
            w1, w3, w2 = (w[e] for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2))
            expected[t] += scores[t, e] / scores[t, top].sum() * (F.silu(tokens[t] @ w1) * (tokens[t] @ w3) @ w2)
    torch.testing.assert_close(layer(x).view(6, DIM), expected)
    assert layer.stats["routed"].sum() == 12 and layer.stats["dropped"] == 0


def test_the_bias_steers_the_choice_but_not_the_combine_weights():
    layer = moe_layer(top_k=1)
    x = torch.randn(1, 8, DIM)
    layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 0.0]))
    out = layer(x).view(8, DIM)
    assert layer.stats["routed"].tolist() == [0, 0, 8, 0]  # every token chose expert 2
    tokens = x.view(8, DIM)
    w1, w3, w2 = (w[2] for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2))
    # top-1: its own score renormalised over itself is 1, whatever the bias
    torch.testing.assert_close(out, F.silu(tokens @ w1) * (tokens @ w3) @ w2)


def test_bias_update_moves_overloaded_experts_down_and_underloaded_up():
    layer = moe_layer(bias_update_rate=0.01)
    layer.update_bias(torch.tensor([10, 2, 4, 4]))  # mean 5
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    frozen = moe_layer(bias_update_rate=0.0)
    frozen.update_bias(torch.tensor([10, 2, 4, 4]))
    assert not frozen.expert_bias.any()
    # proportional: the step times (mean - load) / mean, so nearly even loads barely move it
    proportional = moe_layer(bias_update_rate=0.01, bias_update="proportional")
    proportional.update_bias(torch.tensor([10, 2, 4, 4]))
    torch.testing.assert_close(proportional.expert_bias, torch.tensor([-0.01, 0.006, 0.002, 0.002]))


def test_biases_move_once_per_optimizer_step_from_every_micro_batch():
    model = RobotTransformer(moe_model_config(bias_update_rate=0.5))
    balancing, layer = ExpertBalancing(), moe_layers(model)[0][1]
    for bias in (0.0, 0.0, 0.0, 9.0), (9.0, 0.0, 0.0, 0.0):  # two micro-batches: every token to expert 3, then to 0
        layer.expert_bias.copy_(torch.tensor(bias))
        model(*random_inputs(model))
        balancing.record(model)
    layer.expert_bias.zero_()
    routed = balancing.routed["backbone.layers.0.ffn"].float()
    assert routed[0] > routed.mean() and routed[3] > routed.mean()
    reduced = []
    balancing.update(model, lambda t: reduced.append(t) or t)
    assert len(reduced) == 1  # one collective for every layer
    torch.testing.assert_close(layer.expert_bias, 0.5 * torch.sign(routed.mean() - routed))
    assert balancing.routed == {}


def test_microbatches_statistics_combine_to_the_whole_batchs():
    """What a pipeline stage leaves on its MoE layers after a step: from each microbatch's forward,
    the statistics of one forward over the whole batch (counts exactly; means of equal parts)."""
    layer = moe_layer(aux_loss_weight=0.1)
    x = torch.randn(4, 6, DIM)
    parts = []
    for microbatch in x.chunk(2):
        layer(microbatch)
        parts.append(layer.stats)
    layer(x)
    combined = combined_stats(parts)
    assert combined.keys() == layer.stats.keys()
    assert torch.equal(combined["routed"], layer.stats["routed"]) and combined["routed"].sum() == 4 * 6 * 2
    assert combined["dropped"] == layer.stats["dropped"] == 0
    torch.testing.assert_close(combined["entropy"], layer.stats["entropy"])
    torch.testing.assert_close(combined["aux_loss"], layer.stats["aux_loss"])


def per_step_imbalance_under_balancing(steps: int = 300, window: int = 50, **moe) -> float:
    """A skewed router (every token leans one way) over batches of 360 varied tokens and 240 near-copies
    of one background token; the busiest expert's choices over the mean, per step, over the last steps."""
    layer = moe_layer(n_experts=8, top_k=2, **moe)
    generator = torch.Generator().manual_seed(1)
    skew, background = torch.randn(2, DIM, generator=generator)
    imbalances = []
    for _ in range(steps):
        varied = torch.randn(360, DIM, generator=generator)
        block = background + 0.01 * torch.randn(240, DIM, generator=generator)
        layer(torch.cat((varied, block)).add(skew).unsqueeze(0))
        routed = layer.stats["routed"].float()
        layer.update_bias(routed)
        imbalances.append((routed.max() / routed.mean()).item())
    return sum(imbalances[-window:]) / window


@pytest.mark.parametrize("bias_update, rate", [("sign", 0.003), ("proportional", 0.01)])
def test_bias_balancing_evens_a_skewed_routers_load_and_needs_the_selection_noise_for_a_block_of_like_tokens(
    bias_update, rate
):
    balanced = per_step_imbalance_under_balancing(bias_update=bias_update, bias_update_rate=rate)
    unbalanced = per_step_imbalance_under_balancing(bias_update=bias_update, bias_update_rate=0.0)
    # Without the noise the near-copies choose alike, so the bias moves them between experts as one block.
    swinging = per_step_imbalance_under_balancing(bias_update=bias_update, bias_update_rate=rate, selection_noise=0.0)
    assert balanced < 1.3 and unbalanced > 3.0 and swinging > 1.8, (balanced, unbalanced, swinging)


def test_selection_noise_chooses_alike_in_any_batch_and_is_off_outside_training():
    layer = moe_layer(top_k=2, selection_noise=1.0)
    tokens = torch.randn(64, DIM)
    exact = layer.scores(tokens).topk(2, dim=-1).indices
    noisy = layer.route(layer.scores(tokens)).chosen
    assert not torch.equal(noisy, exact)
    # a function of each token's scores: the same choices in a slice of the batch (a rank's, a recompute's)
    assert torch.equal(layer.route(layer.scores(tokens[40:])).chosen, noisy[40:])
    assert torch.equal(layer.eval().route(layer.scores(tokens)).chosen, exact)


def test_capacity_drops_the_overflow_in_token_order_and_counts_it():
    layer = moe_layer(top_k=1, capacity_factor=1.0)  # capacity ceil(1.0 * 8 * 1 / 4) = 2 per expert
    layer.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # every token wants expert 0
    x = torch.randn(1, 8, DIM)
    out = layer(x).view(8, DIM)
    assert layer.stats["routed"].tolist() == [8, 0, 0, 0]
    assert layer.stats["dropped"] == 6
    tokens = x.view(8, DIM)
    w1, w3, w2 = (w[0] for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2))
    torch.testing.assert_close(out[:2], F.silu(tokens[:2] @ w1) * (tokens[:2] @ w3) @ w2)  # the first two got in
    assert not out[2:].any()  # the rest dropped: no expert output (and no shared expert here)
    dropless = moe_layer(top_k=1)
    dropless.expert_bias.copy_(layer.expert_bias)
    dropless(x)
    assert dropless.stats["dropped"] == 0


def test_sequence_balance_loss_is_one_when_balanced_and_reaches_the_router_through_the_output():
    layer = moe_layer(top_k=1, aux_loss_weight=0.1)
    uniform = torch.full((1, 4, 4), 0.25)
    routing = layer.route(uniform.view(4, 4).clone())
    routing.chosen.copy_(torch.arange(4).view(4, 1))
    assert sequence_balance_loss(uniform, routing, layer.cfg).item() == pytest.approx(1.0)
    # Gradients through the layer's output equal those of adding weight x loss to the training loss.
    x = torch.randn(2, 5, DIM)
    layer.train()
    layer(x).sum().backward()
    assert layer.stats["aux_loss"] > 0  # logged by ExpertLoad
    through_output = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer.cfg = dataclasses.replace(layer.cfg, aux_loss_weight=0.0)
    out = layer(x)
    layer.cfg = dataclasses.replace(layer.cfg, aux_loss_weight=0.1)
    scores = layer.scores(x.view(-1, DIM))
    explicit = out.sum() + 0.1 * sequence_balance_loss(scores.view(2, 5, -1), layer.route(scores), layer.cfg)
    explicit.backward()
    torch.testing.assert_close(through_output, layer.router.weight.grad)


def test_bad_moe_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="moe.top_k must be between 1 and n_experts=4, got 5"):
        MoEConfig(n_experts=4, top_k=5)
    with pytest.raises(ValueError, match="moe.score must be one of softmax, sigmoid, got 'relu'"):
        MoEConfig(score="relu")
    with pytest.raises(ValueError, match="moe.bias_update must be one of sign, proportional, got 'linear'"):
        MoEConfig(bias_update="linear")
    with pytest.raises(ValueError, match=r"model size: unknown moe key\(s\) \['experts'\]"):
        load_size({"name": "tiny_moe", "moe": {"experts": 8}})


# ---- counting, presets, checkpoints -------------------------------------------------------------------


def test_parameters_count_every_expert_and_flops_only_the_active_ones():
    cfg = moe_model_config(top_k=2, n_shared=1)
    model = RobotTransformer(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    per_layer_inactive = 2 * 3 * 64 * 32  # two of four experts a token does not use, in each of 2 layers
    assert count_parameters(cfg) - count_active_parameters(cfg) == 2 * per_layer_inactive
    model.set_kernels(KernelConfig(attention="reference", experts="loop"))  # plain matmuls, seen one by one
    assert counted_training_flops(model) == 3 * training_flops_per_sample(cfg)


def test_tiny_moe_preset_has_experts_in_every_second_layer():
    size = load_size("tiny_moe")
    assert size.moe.n_experts == 8 and size.moe.top_k == 2
    assert [size.is_moe_layer(i) for i in range(size.n_layers)] == [False, True, False, True]


def test_state_dict_holds_whole_stacked_experts_and_the_bias_under_plain_names():
    cfg = moe_model_config()
    model = RobotTransformer(cfg)
    state = model.state_dict()
    for index in range(cfg.backbone.n_layers):
        prefix = f"backbone.layers.{index}.ffn."
        assert state[prefix + "experts.w1"].shape == (4, 64, 32)
        assert state[prefix + "experts.w3"].shape == (4, 64, 32)
        assert state[prefix + "experts.w2"].shape == (4, 32, 64)
        assert state[prefix + "router.weight"].shape == (4, 64)
        assert state[prefix + "expert_bias"].shape == (4,)  # persistent: resumed runs balance on
    model.backbone.layers[0].ffn.expert_bias.fill_(0.25)
    restored = RobotTransformer(cfg)
    restored.load_state_dict(model.state_dict())
    assert restored.backbone.layers[0].ffn.expert_bias.eq(0.25).all()


# ---- observability ---------------------------------------------------------------------------------


def expert_load_step(callback, model, step, logged):
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(reduce=lambda t, reduce_op: t, root_device=torch.device("cpu")),
        global_step=step,
        is_global_zero=True,
    )
    module = SimpleNamespace(
        named_modules=model.named_modules, log_dict=lambda metrics, batch_size: logged.append(metrics)
    )
    callback.on_train_batch_end(trainer, module, None, None, 0)


def test_expert_load_logs_per_layer_metrics_and_names_an_idle_expert(caplog):
    layer = moe_layer(top_k=1)
    model = torch.nn.ModuleDict({"ffn": layer})
    callback, logged = ExpertLoad(dead_after_steps=3), []
    layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -10.0]))  # expert 3 never chosen
    with caplog.at_level(logging.WARNING, logger="uma_lightning"):
        for step in range(3):
            layer(torch.randn(1, 12, DIM))
            expert_load_step(callback, model, step, logged)
            if step < 2:
                assert "expert 3" not in caplog.text  # silent until the stretch is long enough
    assert "MoE layer ffn: expert 3 got no tokens for 3 steps in a row (step 2)" in caplog.text
    assert caplog.text.count("got no tokens") == 1  # only the idle expert, once
    metrics = logged[-1]
    counts = [metrics[f"moe/ffn/tokens/expert{i}"] for i in range(4)]
    assert sum(counts) == 12 and counts[3] == 0
    assert metrics["moe/ffn/imbalance"] == pytest.approx(max(counts) / 3.0)
    assert metrics["moe/ffn/dropped"] == 0
    assert 0 < metrics["moe/ffn/router_entropy"] < torch.log(torch.tensor(4.0)).item()


def test_expert_load_is_silent_on_balanced_experts_and_models_without_experts(caplog):
    layer = moe_layer(top_k=4)  # every token to every expert: none idle
    model = torch.nn.ModuleDict({"ffn": layer})
    callback, logged = ExpertLoad(dead_after_steps=1), []
    with caplog.at_level(logging.WARNING, logger="uma_lightning"):
        layer(torch.randn(1, 5, DIM))
        expert_load_step(callback, model, 0, logged)
        expert_load_step(callback, torch.nn.Linear(2, 2), 1, logged)  # no MoE layer: nothing logged
    assert "got no tokens" not in caplog.text
    assert len(logged) == 1 and logged[0]["moe/ffn/imbalance"] == 1.0


def test_gradient_anomalies_watch_the_router_and_the_experts(tmp_path):
    from uma_lightning.callbacks import GradientAnomalies, TrainingHalted

    model = RobotTransformer(moe_model_config())
    trainer = SimpleNamespace(optimizers=[], strategy=SimpleNamespace(reduce=lambda t, reduce_op: t), world_size=1,
                              global_step=7, is_global_zero=False, default_root_dir=str(tmp_path))  # fmt: skip
    callback = GradientAnomalies(nonfinite_action="halt")
    callback.on_fit_start(trainer, model)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)

    def step():
        callback.on_train_batch_start(trainer, model, {"sample_id": torch.arange(3)}, 0)
        callback.on_before_backward(trainer, model, torch.tensor(1.0))
        callback.on_before_optimizer_step(trainer, model, None)

    step()  # finite: silent
    model.backbone.layers[1].ffn.router.weight.grad[0, 0] = float("nan")
    model.backbone.layers[0].ffn.experts.w2.grad[3, 0, 0] = float("inf")
    with pytest.raises(
        TrainingHalted, match=r"culprits: backbone.layers.0.ffn.experts.w2, backbone.layers.1.ffn.router.weight;"
    ):
        step()


def test_experts_under_tensor_parallelism_are_checked_before_any_work():
    from uma_lightning.parallel.apply import ParallelConfig
    from uma_lightning.parallel.mesh import MeshShape
    from uma_lightning.parallel.plans.robot import check_robot

    model = RobotTransformer(moe_model_config())  # tp alone trains it (tests/test_parallel.py's experts parity)
    with pytest.raises(
        ValueError,
        match="^tp 2 with ep 2: experts are either split over ep ranks or computed whole on each tp rank, not both$",
    ):
        check_robot(model, MeshShape(dp_replicate=1, dp_shard=2, tp=2, ep=2), ParallelConfig())
    model = RobotTransformer(moe_model_config(aux_loss_weight=0.01))
    with pytest.raises(ValueError, match="^tp 2: moe.aux_loss_weight needs each sequence's tokens on one rank"):
        check_robot(model, MeshShape(dp_replicate=1, dp_shard=2, tp=2), ParallelConfig())
