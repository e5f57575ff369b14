"""Backbones from pretrained Hugging Face vision-language models (``uma_lightning/models/vlm.py``), on
tiny random models of two families built in the test (``hf_models.py``)."""

import numpy as np
import pytest
import torch
from hf_models import FAMILIES

from uma_lightning.data.spec import DataSpec
from uma_lightning.models.vlm import import_transformers

SPEC = DataSpec(cameras=("head", "wrist"), image_size=(32, 32), state_dim=5, action_dim=3, n_obs_steps=2,
                action_horizon=4, fps=10.0)  # fmt: skip
INSTRUCTIONS = ["pick up the red cube", "open the drawer then close it and move the arm up"]


def observation(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (2, SPEC.n_obs_steps, len(SPEC.cameras), 32, 32, 3), dtype=torch.uint8,
                           generator=generator)  # fmt: skip
    return images, torch.randn(2, SPEC.n_obs_steps, SPEC.state_dim, generator=generator)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prefix_is_the_familys_own_forward(tiny_vlms, family):
    """The hidden states of the images and the instruction are transformers' own forward on the same
    frames (through the family's image processor) and the same words, to 1e-5 in float32; the state
    tokens come after them and change nothing before them."""
    from uma_lightning.models.vlm import VLMModelConfig, VLMTokenModel

    transformers = import_transformers()

    directory = tiny_vlms[family]
    model = VLMTokenModel(VLMModelConfig(str(directory), SPEC, max_text_len=8)).eval()
    images, state = observation()
    text_ids, text_mask = model.text_tokenizer(INSTRUCTIONS)
    assert text_mask[0].sum() == 5 and text_mask[1].all()  # padded, and cut to max_text_len
    with torch.no_grad():
        ours = model.run_language_model(*model.embed_prefix(images, state, text_ids, text_mask)).last_hidden_state
        changed_state = model.run_language_model(*model.embed_prefix(images, state + 1, text_ids, text_mask))

    reference = transformers.AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(directory)
    frames = [[np.asarray(frame) for frame in sample.flatten(0, 1)] for sample in images]
    pixel_values = processor(images=frames, return_tensors="pt")["pixel_values"]
    if pixel_values.ndim == 4:  # one row per image, sample after sample
        assert pixel_values.shape[0] == images.shape[0] * SPEC.n_obs_steps * len(SPEC.cameras)
    n_image_tokens = SPEC.n_obs_steps * len(SPEC.cameras) * model.tokens_per_image
    image_ids = torch.full((2, n_image_tokens), reference.config.image_token_id)
    input_ids = torch.cat((image_ids, text_ids), dim=1)
    attention_mask = torch.cat((torch.ones_like(image_ids), text_mask.long()), dim=1)
    with torch.no_grad():
        theirs = reference.model(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask)
    theirs = theirs.last_hidden_state
    real = attention_mask.bool()  # padding positions' states are nobody's input
    assert ours.shape[1] == model.prefix_len == theirs.shape[1] + SPEC.n_obs_steps
    torch.testing.assert_close(ours[:, : theirs.shape[1]][real], theirs[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(changed_state.last_hidden_state[:, : theirs.shape[1]], ours[:, : theirs.shape[1]])
    assert not torch.allclose(changed_state.last_hidden_state[:, theirs.shape[1] :], ours[:, theirs.shape[1] :])


@pytest.mark.slow(seconds=20)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_stage_trains_on_a_pretrained_vlm(tiny_vlms, tmp_path, family):
    """Pretraining (token head), mid-training from it, post-training from that with pi0's flow expert,
    the vision tower frozen by the config key, LoRA on the language model and an EMA; the policy is
    rebuilt from the checkpoint and acts."""
    from test_stages import data, trainer

    from uma_lightning import Policy
    from uma_lightning.checkpoint.weights import read_checkpoint
    from uma_lightning.modules import MidtrainModule, PosttrainModule, PretrainModule

    network = {"pretrained": str(tiny_vlms[family]), "max_text_len": 8}
    torch.manual_seed(0)
    pre_data = data()
    pretrain = PretrainModule(spec=pre_data.spec, network=network, normalization=pre_data.normalization(),
                              n_action_bins=16)  # fmt: skip
    pretrain.configure_model()
    loaded = {name: tensor.clone() for name, tensor in pretrain.model.vlm.state_dict().items()}
    trainer(tmp_path / "pretrain", 2).fit(pretrain, pre_data)
    pretrain.trainer.save_checkpoint(tmp_path / "pretrain.ckpt")

    midtrain = MidtrainModule(spec=pre_data.spec, network=network, normalization=pre_data.normalization(),
                              n_action_bins=16, init_from=str(tmp_path / "pretrain.ckpt"))  # fmt: skip
    trainer(tmp_path / "midtrain", 1).fit(midtrain, pre_data)
    midtrain.trainer.save_checkpoint(tmp_path / "midtrain.ckpt")

    post_data = data(n_obs_steps=2, action_horizon=4)
    decoder = {"idefics3": "model.text_model", "paligemma": "model.language_model"}[family]
    lora = [f"vlm.{decoder}.layers.*.self_attn.q_proj"]
    posttrain = PosttrainModule(
        spec=post_data.spec, network={**network, "freeze_vision": True}, normalization=post_data.normalization(),
        init_from=str(tmp_path / "midtrain.ckpt"), expert={"dim": 32, "ffn_dim": 64},
        lora={"targets": lora, "rank": 2}, ema_decay=0.5, optimizer={"lr": 1e-2, "warmup_steps": 1},
    )  # fmt: skip
    trainer(tmp_path / "posttrain", 3).fit(posttrain, post_data)
    posttrain.trainer.save_checkpoint(tmp_path / "posttrain.ckpt")

    model, midtrained = posttrain.model, read_checkpoint(tmp_path / "midtrain.ckpt").weights
    vision = [name for name in loaded if not name.startswith((decoder, "lm_head"))]
    assert vision and all(torch.equal(model.vlm.state_dict()[name], midtrained[f"vlm.{name}"]) for name in vision)
    assert not torch.equal(midtrained[f"vlm.{decoder}.layers.0.mlp.up_proj.weight"],
                           model.language_model.layers[0].mlp.up_proj.weight)  # fmt: skip
    assert model.language_model.layers[0].self_attn.q_proj.lora_b.abs().sum() > 0
    assert not torch.equal(
        midtrained[f"vlm.{decoder}.layers.0.mlp.up_proj.weight"],
        loaded[f"{decoder}.layers.0.mlp.up_proj.weight"],
    )  # fmt: skip  pretraining trained it
    ema = posttrain.ema_model.expert.layers[0].ffn.w1.weight
    assert not torch.allclose(ema, model.expert.layers[0].ffn.w1.weight)

    policy = Policy.from_checkpoint(str(tmp_path / "posttrain.ckpt"))
    torch.testing.assert_close(policy.model.expert.layers[0].ffn.w1.weight, ema)
    batch = next(iter(post_data.val_dataloader()))
    with torch.no_grad():
        actions = policy.predict_normalized(batch["images"][:2], batch["state"][:2], batch["instruction"][:2])
    assert actions.shape == (2, 4, post_data.spec.action_dim) and torch.isfinite(actions).all()
