import dataclasses

import pytest
import torch
from suite import SPEC, counted_training_flops, random_inputs, small_config

from uma_lightning.data.spec import DataSpec
from uma_lightning.kernels import KernelConfig, attention
from uma_lightning.models import (
    RobotModelConfig,
    RobotTransformer,
    VisionConfig,
    count_parameters,
    load_size,
    preset_names,
    training_flops_per_sample,
)
from uma_lightning.models.tokenizers import ActionBinner, ByteTokenizer, ImageKeypointTokenizer
from uma_lightning.models.transformer import apply_rotary, rotary_tables

VISION = {
    "patches": VisionConfig(),
    "keypoints": VisionConfig(tokenizer="keypoints", n_keypoints=6, channels=4),
    "keypoints_film": VisionConfig(tokenizer="keypoints", n_keypoints=6, channels=4, film=True),
}


# ---- attention entry point ----------------------------------------------------------------------


@pytest.mark.parametrize("causal,prefix_len", [(False, 0), (True, 0), (True, 5)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_matches_reference(causal, prefix_len, kv_heads):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 11, 16)
    k, v = torch.randn(2, kv_heads, 11, 16), torch.randn(2, kv_heads, 11, 16)
    padding = torch.ones(2, 11, dtype=torch.bool)
    padding[1, 2:4] = False
    for mask in (None, padding):
        kwargs = dict(causal=causal, prefix_len=prefix_len, key_padding_mask=mask)
        torch.testing.assert_close(
            attention(q, k, v, backend="sdpa", **kwargs),
            attention(q, k, v, backend="reference", **kwargs),
            atol=1e-5,
            rtol=1e-5,
        )


def test_block_causal_mask_semantics():
    """Prefix tokens see the whole prefix; later tokens never see the future."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    out = attention(q, k, v, causal=True, prefix_len=4)
    # Changing key/value 3 (inside the prefix) changes output 0: the prefix is bidirectional.
    v2 = v.clone()
    v2[..., 3, :] += 1
    assert not torch.allclose(attention(q, k, v2, causal=True, prefix_len=4)[..., 0, :], out[..., 0, :])
    # Changing key/value 6 (an action token) leaves outputs 0..5 untouched: actions are causal.
    v3 = v.clone()
    v3[..., 6, :] += 1
    torch.testing.assert_close(attention(q, k, v3, causal=True, prefix_len=4)[..., :6, :], out[..., :6, :])


def test_unknown_attention_backend_is_a_clear_error():
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="unknown attention backend 'flash3'"):
        attention(q, q, q, backend="flash3")


# ---- building blocks --------------------------------------------------------------------------


def test_rotary_scores_depend_only_on_relative_position():
    cos, sin = rotary_tables(16, 8, 10000.0)
    q, k = torch.randn(8), torch.randn(8)
    rotated_q = apply_rotary(q.expand(1, 1, 16, 8), cos, sin)[0, 0]
    rotated_k = apply_rotary(k.expand(1, 1, 16, 8), cos, sin)[0, 0]
    assert torch.allclose(rotated_q[3] @ rotated_k[1], rotated_q[10] @ rotated_k[8], atol=1e-5)
    assert torch.allclose(rotated_q.norm(dim=-1), q.norm().expand(16), atol=1e-5)


def test_byte_tokenizer_round_trip_and_padding():
    tok = ByteTokenizer(max_len=8)
    ids, mask = tok(["héllo", "a much longer instruction"])
    assert tok.decode(ids[0]) == "héllo"
    assert mask[0].tolist() == [True] * 6 + [False] * 2  # "é" is two UTF-8 bytes
    assert mask[1].all() and tok.decode(ids[1]) == "a much l"


def test_action_binner_bins_and_clamps():
    binner = ActionBinner(8)
    bins = torch.arange(8)
    assert torch.equal(binner.encode(binner.decode(bins)), bins)
    assert binner.encode(torch.tensor([-5.0, -1.0, 1.0, 7.0])).tolist() == [0, 0, 7, 7]


# ---- the robot transformer --------------------------------------------------------------------


def colour_keypoint_tokenizer(film: bool) -> ImageKeypointTokenizer:
    """32x32 frames, one keypoint whose map is set by hand: feature channel 0 is the red pixels, 1 the green."""
    tokenizer = ImageKeypointTokenizer((32, 32), n_keypoints=1, channels=2, dim=8, film=film)
    first, second, third = (layer for layer in tokenizer.features if isinstance(layer, torch.nn.Conv2d))
    with torch.no_grad():
        for layer in (first, second, third):
            layer.weight.zero_(), layer.bias.zero_()
        tokenizer.keypoint_maps.weight.zero_()
        for colour in (0, 1):
            first.weight[colour, colour, 2, 2] = 1.0  # that colour channel at the centre tap
            second.weight[colour, colour, 1, 1] = 1.0  # stride 2: the pixel at (2i, 2j)
            third.weight[colour, colour, 1, 1] = 1.0
            tokenizer.keypoint_maps.weight[0, colour] = 1.0
        tokenizer.sharpness.fill_(20.0)  # a sharp softmax: all mass on the brightest cells
    return tokenizer


def square_centres(frames: torch.Tensor, squares: list[tuple[int, int]], channel: int) -> torch.Tensor:
    """Paints 4x4 squares at (row, column) of the given colour channel; their centres on the 16x16 keypoint grid."""
    grid = torch.linspace(-1, 1, 16)
    for frame, (row, column) in zip(frames, squares):
        frame[row : row + 4, column : column + 4, channel] = 255
    return torch.stack(
        [torch.stack((grid[c // 2 : c // 2 + 2].mean(), grid[r // 2 : r // 2 + 2].mean())) for r, c in squares]
    )


def test_keypoint_is_the_centre_of_what_its_feature_map_responds_to():
    tokenizer = colour_keypoint_tokenizer(film=False)
    frames = torch.zeros(2, 32, 32, 3, dtype=torch.uint8)
    expected = square_centres(frames, [(8, 20), (24, 4)], channel=0)
    with torch.no_grad():
        tokenizer.keypoint_maps.weight[0, 1] = 0.0  # red only
        torch.testing.assert_close(tokenizer.positions(frames)[:, 0], expected, atol=1e-4, rtol=0)
        tokens = tokenizer(frames)
        torch.testing.assert_close(
            tokens[:, 0], tokenizer.coordinates(expected) + tokenizer.identity[0], atol=1e-4, rtol=0
        )


def test_film_lets_the_instruction_choose_what_a_keypoint_follows():
    """The same frames, two instructions: each scales one colour's features up and the other's to zero."""
    tokenizer = colour_keypoint_tokenizer(film=True)
    frames = torch.zeros(2, 32, 32, 3, dtype=torch.uint8)
    red = square_centres(frames, [(8, 20), (24, 4)], channel=0)
    green = square_centres(frames, [(20, 8), (2, 26)], channel=1)
    with torch.no_grad():
        tokenizer.film.weight[0, 0], tokenizer.film.weight[1, 0] = 0.5, -0.5  # scales of channels 0 and 1
        towards_red = torch.tensor([[1.0, -1.0, 0, 0, 0, 0, 0, 0]]).expand(2, -1)  # layer-normed: [2, -2, 0...]
        torch.testing.assert_close(tokenizer.positions(frames, towards_red)[:, 0], red, atol=1e-4, rtol=0)
        torch.testing.assert_close(tokenizer.positions(frames, -towards_red)[:, 0], green, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="conditioned on the instruction"):
        tokenizer(frames)


def test_unknown_image_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="vision.tokenizer must be 'patches' or 'keypoints', got 'keypoint'"):
        VisionConfig(tokenizer="keypoint")


def test_action_logits_are_causal_in_actions():
    torch.manual_seed(0)
    model = RobotTransformer(small_config())
    images, state, text_ids, text_mask, actions = random_inputs(model)
    logits = model(images, state, text_ids, text_mask, actions)
    assert logits.shape == (3, SPEC.action_horizon * SPEC.action_dim, 32)
    changed = actions.clone()
    changed[:, 5] = (changed[:, 5] + 7) % 32
    # logits[j] predicts token j from tokens < j: changing token 5 may only move logits 6 onward.
    new_logits = model(images, state, text_ids, text_mask, changed)
    torch.testing.assert_close(new_logits[:, :6], logits[:, :6])
    assert not torch.allclose(new_logits[:, 6:], logits[:, 6:])


@pytest.mark.parametrize("vision", [VISION["patches"], VISION["keypoints_film"]], ids=["patches", "keypoints_film"])
def test_padding_bytes_do_not_leak_into_outputs(vision):
    torch.manual_seed(0)
    model = RobotTransformer(small_config(vision=vision))
    if vision.film:  # starts at zero, which would hide a leak through the instruction's conditioning
        torch.nn.init.normal_(model.image_tokenizer.film.weight)
    images, state, text_ids, text_mask, actions = random_inputs(model)
    garbage = text_ids.masked_fill(~text_mask, 17)
    torch.testing.assert_close(
        model(images, state, garbage, text_mask, actions), model(images, state, text_ids, text_mask, actions)
    )


@pytest.mark.parametrize("vision", VISION.values(), ids=VISION.keys())
def test_parameter_count_matches_the_module(vision):
    cfg = small_config(vision=vision)
    assert count_parameters(cfg) == sum(p.numel() for p in RobotTransformer(cfg).parameters())


@pytest.mark.parametrize("vision", VISION.values(), ids=VISION.keys())
def test_training_flops_match_torch_flop_counter(vision):
    cfg = small_config(vision=vision)
    model = RobotTransformer(cfg)
    # The reference backend is plain matmuls, which the flop counter sees one by one.
    model.backbone.set_kernels(KernelConfig(attention="reference"))
    assert counted_training_flops(model) == 3 * training_flops_per_sample(cfg)


def test_size_presets_have_the_advertised_parameter_counts():
    spec = DataSpec(
        cameras=("top",), image_size=(64, 64), state_dim=4, action_dim=3, n_obs_steps=1, action_horizon=8, fps=10
    )
    counts = {name: count_parameters(RobotModelConfig(backbone=load_size(name), spec=spec)) for name in preset_names()}
    assert set(counts) >= {"tiny", "small", "1b", "7b"}
    assert counts["tiny"] <= 5e6
    assert 80e6 <= counts["small"] <= 130e6
    assert 0.9e9 <= counts["1b"] <= 1.3e9
    assert 6.5e9 <= counts["7b"] <= 7.5e9


def test_size_resolution_errors_and_overrides(tmp_path):
    with pytest.raises(ValueError, match="unknown model size 'smal'; did you mean 'small'"):
        load_size("smal")
    assert load_size({"name": "small", "n_layers": 6}) == dataclasses.replace(load_size("small"), n_layers=6)
    custom = tmp_path / "mine.yaml"
    custom.write_text("dim: 64\nn_layers: 1\nn_heads: 2\nn_kv_heads: 1\nffn_dim: 96\n")
    assert load_size(str(custom)).ffn_dim == 96
    custom.write_text("dim: 64\nn_layerz: 1\n")
    with pytest.raises(ValueError, match=r"unknown model size key\(s\) \['n_layerz'\]"):
        load_size(str(custom))
    with pytest.raises(ValueError, match="not divisible by n_kv_heads"):
        load_size({"dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 3, "ffn_dim": 8})
