"""The pieces the training stages add to the models: the key/value cache, greedy decoding, the
flow-matching action expert, LoRA, mapping checkpoints by name, and the action-error metric."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from uma_lightning.checkpoint.weights import CheckpointWeights, load_weights
from uma_lightning.data.spec import DataSpec
from uma_lightning.kernels import KernelConfig
from uma_lightning.models import (
    ActionExpertConfig,
    FlowMatchingConfig,
    RobotFlowTransformer,
    RobotModelConfig,
    RobotTransformer,
    Transformer,
    VisionConfig,
    flow_training_flops_per_sample,
    load_size,
)
from uma_lightning.models.lora import LoRALinear, add_lora, merge_lora
from uma_lightning.models.transformer import KVCache
from uma_lightning.modules.metrics import ActionError
from uma_lightning.modules.posttrain import PosttrainModule

SPEC = DataSpec(
    cameras=("top",), image_size=(16, 16), state_dim=5, action_dim=3, n_obs_steps=2, action_horizon=4, fps=10
)
BACKBONE = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64}


def config(**overrides) -> RobotModelConfig:
    return RobotModelConfig(backbone=load_size(BACKBONE), spec=SPEC, max_text_len=12, n_action_bins=16, **overrides)


def observations(model, batch: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, SPEC.n_obs_steps, 1, *SPEC.image_size, 3), dtype=torch.uint8, generator=gen)
    state = torch.randn(batch, SPEC.n_obs_steps, SPEC.state_dim, generator=gen)
    text_ids, text_mask = model.text_tokenizer(["reach the red square", "go", "touch blue"][:batch])
    return images, state, text_ids, text_mask


# ---- the key/value cache ------------------------------------------------------------------------


def test_cached_decoding_matches_one_pass_over_the_whole_sequence():
    torch.manual_seed(0)
    backbone = Transformer(load_size(BACKBONE), max_seq_len=12)
    h = torch.randn(2, 12, 32)
    padding = torch.ones(2, 7, dtype=torch.bool)
    padding[1, 1:3] = False
    full_mask = torch.cat((padding, torch.ones(2, 5, dtype=torch.bool)), dim=1)
    expected = backbone(h, prefix_len=7, key_padding_mask=full_mask)

    cache = KVCache.empty(2)
    outputs = [backbone(h[:, :7], prefix_len=7, key_padding_mask=padding, cache=cache)]
    for position in range(7, 12):  # one token at a time, each attending to everything before it
        outputs.append(backbone(h[:, position : position + 1], cache=cache))
    torch.testing.assert_close(torch.cat(outputs, dim=1)[:, :], expected, atol=1e-5, rtol=1e-5)
    assert cache.length == 12
    with pytest.raises(ValueError, match="13 tokens exceeds max_seq_len=12"):
        backbone(h[:, :1], cache=cache)


def test_greedy_decoding_picks_the_argmax_of_the_teacher_forced_logits():
    torch.manual_seed(0)
    model = RobotTransformer(config()).eval()
    images, state, text_ids, text_mask = observations(model)
    with torch.no_grad():
        actions = model.predict_actions(images, state, text_ids, text_mask)
        tokens = model.action_binner.encode(actions).flatten(1)
        logits = model(images, state, text_ids, text_mask, tokens)
    assert actions.shape == (3, SPEC.action_horizon, SPEC.action_dim)
    assert torch.equal(logits.argmax(-1), tokens)


# ---- the flow-matching action expert ----------------------------------------------------------


def test_sampler_encodes_the_prefix_once_and_reuses_its_cache_for_every_step():
    torch.manual_seed(0)
    model = RobotFlowTransformer(config(), ActionExpertConfig(dim=16, ffn_dim=32)).eval()
    calls = {"backbone": 0, "expert": 0}
    model.backbone.register_forward_hook(lambda *_: calls.__setitem__("backbone", calls["backbone"] + 1))
    model.expert.register_forward_hook(lambda *_: calls.__setitem__("expert", calls["expert"] + 1))
    images, state, text_ids, text_mask = observations(model)
    noise = torch.randn(3, SPEC.action_horizon, SPEC.action_dim)
    with torch.no_grad():
        actions = model.predict_actions(images, state, text_ids, text_mask, steps=5, noise=noise)
    assert calls == {"backbone": 1, "expert": 5}
    # The same integration, recomputing the prefix at every step, gives the same chunk.
    with torch.no_grad():
        x = noise
        for step in range(5):
            t = torch.full((3,), 1 - step / 5)
            x = x - 0.2 * model(images, state, text_ids, text_mask, x, t)
    torch.testing.assert_close(actions, x, atol=1e-5, rtol=1e-5)


def test_noise_scale_scales_the_starting_noise_and_zero_is_deterministic():
    torch.manual_seed(0)
    model = RobotFlowTransformer(config(), ActionExpertConfig(dim=16, ffn_dim=32)).eval()
    images, state, text_ids, text_mask = observations(model)
    shape = (3, SPEC.action_horizon, SPEC.action_dim)
    with torch.no_grad():
        torch.manual_seed(1)
        scaled = model.predict_actions(images, state, text_ids, text_mask, steps=3, noise_scale=0.5)
        torch.manual_seed(1)
        expected = model.predict_actions(images, state, text_ids, text_mask, steps=3, noise=0.5 * torch.randn(shape))
        mean_path = model.predict_actions(images, state, text_ids, text_mask, steps=3, noise_scale=0.0)
        from_zeros = model.predict_actions(images, state, text_ids, text_mask, steps=3, noise=torch.zeros(shape))
    torch.testing.assert_close(scaled, expected)
    assert torch.equal(mean_path, from_zeros)
    with pytest.raises(ValueError, match="noise_scale must be >= 0, got -1"):
        FlowMatchingConfig(noise_scale=-1)


def test_action_tokens_see_each_other_and_the_observations_but_not_padding():
    torch.manual_seed(0)
    model = RobotFlowTransformer(config(), ActionExpertConfig(dim=16)).eval()
    images, state, text_ids, text_mask = observations(model)
    noisy, t = torch.randn(3, SPEC.action_horizon, SPEC.action_dim), torch.rand(3)
    with torch.no_grad():
        velocity = model(images, state, text_ids, text_mask, noisy, t)
        later_step = noisy.clone()
        later_step[:, 3] += 1.0
        assert not torch.allclose(
            model(images, state, text_ids, text_mask, later_step, t)[:, 0], velocity[:, 0]
        )  # bidirectional
        assert not torch.allclose(model(images, state + 1, text_ids, text_mask, noisy, t), velocity)
        garbage = text_ids.masked_fill(~text_mask, 7)
        torch.testing.assert_close(model(images, state, garbage, text_mask, noisy, t), velocity)


@pytest.mark.parametrize(
    "vision",
    [VisionConfig(), VisionConfig(tokenizer="keypoints", n_keypoints=6, channels=4, film=True)],
    ids=["patches", "keypoints_film"],
)
def test_flow_training_flops_match_torch_flop_counter(vision):
    cfg = config(vision=vision)
    model = RobotFlowTransformer(cfg, ActionExpertConfig(dim=16, ffn_dim=40))
    model.set_kernels(KernelConfig(attention="reference"))  # plain matmuls, which the counter sees one by one
    images, state, text_ids, text_mask = observations(model)
    noisy, t = torch.randn(3, SPEC.action_horizon, SPEC.action_dim), torch.rand(3)
    model.backbone.norm.weight.requires_grad_(True)  # count as if everything trains
    with FlopCounterMode(display=False) as counter:
        F.mse_loss(model(images, state, text_ids, text_mask, noisy, t), noisy).backward()
    assert counter.get_total_flops() == 3 * flow_training_flops_per_sample(cfg, model.expert_config)


def test_expert_width_must_fit_the_backbone_heads():
    with pytest.raises(
        ValueError,
        match="action expert dim 24 must be a multiple of head size 8 times the backbone's 2 key/value heads",
    ):
        RobotFlowTransformer(config(), ActionExpertConfig(dim=24))


# ---- LoRA -------------------------------------------------------------------------------------


def test_lora_starts_as_the_base_model_trains_only_adapters_and_merges_exactly():
    torch.manual_seed(0)
    model = RobotFlowTransformer(config(), ActionExpertConfig(dim=16))
    images, state, text_ids, text_mask = observations(model)
    noisy, t = torch.randn(3, SPEC.action_horizon, SPEC.action_dim), torch.rand(3)
    before = model(images, state, text_ids, text_mask, noisy, t).detach()
    wrapped = add_lora(model, ["backbone.layers.*.attn.wq", "backbone.layers.*.attn.wv"], rank=2, alpha=4)
    assert wrapped == [f"backbone.layers.{i}.attn.{w}" for i in (0, 1) for w in ("wq", "wv")]
    assert "backbone.layers.0.attn.wq.weight" in model.state_dict()  # the base weight keeps its name
    torch.testing.assert_close(model(images, state, text_ids, text_mask, noisy, t), before)  # B starts at zero
    layer = model.backbone.layers[0].attn.wq
    assert isinstance(layer, LoRALinear) and not layer.weight.requires_grad and layer.lora_a.requires_grad
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_()
        adapted = model(images, state, text_ids, text_mask, noisy, t)
    assert not torch.allclose(adapted, before)
    assert merge_lora(model) == 4
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(images, state, text_ids, text_mask, noisy, t), adapted, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"LoRA target\(s\) \['backbone.layer.\*.wq'\] match no linear layer"):
        add_lora(model, ["backbone.layer.*.wq"])


# ---- mapping checkpoints by name ---------------------------------------------------------------


def weights_of(model) -> CheckpointWeights:
    return CheckpointWeights(
        "stage.ckpt", {}, {k: v.clone() for k, v in model.state_dict().items()}, ema=False, module_class=None
    )


def test_posttraining_takes_the_backbone_and_drops_the_action_token_head():
    torch.manual_seed(0)
    pretrained = RobotTransformer(config())
    flow = RobotFlowTransformer(config(), ActionExpertConfig(dim=16))
    expert_before = flow.expert.layers[0].attn.wq.weight.clone()
    load_weights(flow, weights_of(pretrained), PosttrainModule.key_mapping)
    torch.testing.assert_close(flow.backbone.layers[1].ffn.w2.weight, pretrained.backbone.layers[1].ffn.w2.weight)
    torch.testing.assert_close(flow.image_tokenizer.position, pretrained.image_tokenizer.position)
    torch.testing.assert_close(flow.expert.layers[0].attn.wq.weight, expert_before)  # fresh: left as initialised


def test_another_model_family_or_other_shapes_fail_listing_the_keys():
    pretrained, flow = RobotTransformer(config()), RobotFlowTransformer(config(), ActionExpertConfig(dim=16))
    with pytest.raises(ValueError) as info:
        load_weights(pretrained, weights_of(flow))  # a flow model's checkpoint into the action-token model
    message = str(info.value)
    assert message.startswith("stage.ckpt: cannot initialise RobotTransformer from it;")
    assert "missing from the checkpoint: action_dim_embed.weight, action_embed.weight, action_head.weight" in message
    assert "not in this model: action_in.bias, action_in.weight" in message
    wider = RobotTransformer(
        RobotModelConfig(backbone=load_size({**BACKBONE, "ffn_dim": 48}), spec=SPEC, max_text_len=12, n_action_bins=16)
    )
    with pytest.raises(ValueError, match=r"shapes differ: backbone.layers.0.ffn.w1.weight \(64, 32\) -> \(48, 32\)"):
        load_weights(wider, weights_of(pretrained))
    foreign = CheckpointWeights(
        "vit.ckpt", {}, {"encoder.blocks.0.weight": torch.zeros(2)}, ema=False, module_class=None
    )
    with pytest.raises(ValueError, match=r"no names in common: another model family\?"):
        load_weights(pretrained, foreign)


# ---- evaluation metric ------------------------------------------------------------------------


def test_action_error_is_per_dimension_and_per_step_over_real_steps():
    rng = np.random.default_rng(0)
    predicted, target = rng.normal(size=(2, 5, 4, 3)), rng.normal(size=(2, 5, 4, 3))
    mask = rng.random(size=(2, 5, 4)) > 0.3
    metric = ActionError(horizon=4, dimension_names=["a", "b", "c"], prefix="val/")
    for i in range(2):  # two batches
        metric.update(torch.tensor(predicted[i]), torch.tensor(target[i]), torch.tensor(mask[i]))
    out = {k: float(v) for k, v in metric.compute().items()}
    error, real = (predicted - target).reshape(-1, 4, 3), mask.reshape(-1, 4)
    assert out["val/action_mse"] == pytest.approx((error[real] ** 2).mean(), rel=1e-6)
    assert out["val/action_l1/b"] == pytest.approx(np.abs(error[real][:, 1]).mean(), rel=1e-6)
    assert out["val/action_mse/step_2"] == pytest.approx((error[:, 2][real[:, 2]] ** 2).mean(), rel=1e-6)
