"""Backbones from pretrained Hugging Face vision-language models (``uma_lightning/models/vlm.py``), on
tiny random models of two families built in the test (``hf_models.py``)."""

import sys

import numpy as np
import pytest
import torch
from hf_models import FAMILIES
from suite import quiet_trainer, small_data

from uma_lightning.checkpoint.hf import load_pretrained
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
    load_pretrained(model)
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
def test_every_stage_trains_on_a_pretrained_vlm(tiny_vlms, tmp_path):
    """Pretraining (token head), mid-training from it, post-training from that with pi0's flow expert,
    the vision tower frozen by the config key, LoRA on the language model and an EMA; the policy is
    rebuilt from the checkpoint and acts. (The tutorial's walk in tests/test_docs.py runs the recipe.)"""
    from uma_lightning import Policy
    from uma_lightning.checkpoint.weights import read_checkpoint
    from uma_lightning.modules import MidtrainModule, PosttrainModule, PretrainModule

    network = {"pretrained": str(tiny_vlms["idefics3"]), "max_text_len": 8}
    torch.manual_seed(0)
    pre_data = small_data()
    pretrain = PretrainModule(spec=pre_data.spec, network=network, normalization=pre_data.normalization(),
                              n_action_bins=16)  # fmt: skip
    pretrain.configure_model()
    loaded = {name: tensor.clone() for name, tensor in pretrain.model.vlm.state_dict().items()}
    quiet_trainer(tmp_path / "pretrain", 2).fit(pretrain, pre_data)
    pretrain.trainer.save_checkpoint(tmp_path / "pretrain.ckpt")

    midtrain = MidtrainModule(spec=pre_data.spec, network=network, normalization=pre_data.normalization(),
                              n_action_bins=16, init_from=str(tmp_path / "pretrain.ckpt"))  # fmt: skip
    quiet_trainer(tmp_path / "midtrain", 1).fit(midtrain, pre_data)
    midtrain.trainer.save_checkpoint(tmp_path / "midtrain.ckpt")

    post_data = small_data(n_obs_steps=2, action_horizon=4)
    decoder = "model.text_model"  # SmolVLM's language model
    lora = [f"vlm.{decoder}.layers.*.self_attn.q_proj"]
    posttrain = PosttrainModule(
        spec=post_data.spec, network={**network, "freeze_vision": True}, normalization=post_data.normalization(),
        init_from=str(tmp_path / "midtrain.ckpt"), expert={"dim": 32, "ffn_dim": 64},
        lora={"targets": lora, "rank": 2}, ema_decay=0.5, optimizer={"lr": 1e-2, "warmup_steps": 1},
    )  # fmt: skip
    quiet_trainer(tmp_path / "posttrain", 3).fit(posttrain, post_data)
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


def test_a_directory_that_is_not_a_vlm_is_named(tmp_path):
    from uma_lightning.models.network import NetworkConfig

    with pytest.raises(ValueError, match=f"^network.pretrained {tmp_path}: no config.json there"):
        NetworkConfig(pretrained=str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match="model_type 'bert' is not a supported vision-language family"):
        NetworkConfig(pretrained=str(tmp_path))


def test_the_house_models_need_no_transformers(tiny_vlms, monkeypatch):
    """No module of the package imports transformers or tokenizers when it is imported (only the VLM
    family does, when it builds a model); without them, a pretrained backbone names the extra."""
    import ast
    from pathlib import Path

    import uma_lightning
    from uma_lightning.modules import PosttrainModule

    top_level = []
    for path in Path(uma_lightning.__file__).parent.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            top_level += [(path.name, name) for name in names if name.split(".")[0] in ("transformers", "tokenizers")]
    assert top_level == []
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    spec = SPEC
    with pytest.raises(ValueError, match=r"^network.pretrained needs transformers: pip install 'uma-lightning\[hf\]'$"):
        PosttrainModule(spec=spec, network={"pretrained": str(tiny_vlms["idefics3"])}).build_model()


def test_what_a_family_lacks_for_a_strategy_is_refused_in_one_line(tiny_vlms, tmp_path):
    """Checked on the network built on the meta device, before any work: tp that does not divide the
    key/value heads (PaliGemma 3B's Gemma has one), and pp, which the generic plan cannot split."""
    import json
    import shutil

    from lightning.pytorch import Trainer

    from uma_lightning.modules import PretrainModule
    from uma_lightning.parallel import register_strategies

    register_strategies()
    one_kv_head = shutil.copytree(tiny_vlms["paligemma"], tmp_path / "one-kv-head")
    config = json.loads((one_kv_head / "config.json").read_text())
    config["text_config"]["num_key_value_heads"] = 1
    (one_kv_head / "config.json").write_text(json.dumps(config))

    def check(strategy: str, directory) -> None:
        module = PretrainModule(spec=SPEC, network={"pretrained": str(directory), "max_text_len": 8})
        Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False).strategy.check_module(
            module, batch_size=4
        )

    check("tp", tiny_vlms["paligemma"])  # two key/value heads: split
    with pytest.raises(ValueError, match=r"^tp 2 does not divide the 1 key value heads of paligemma's language model"):
        check("tp", one_kv_head)
    with pytest.raises(ValueError, match=r"^pp 2: the generic plan of VLMTokenModel has no pipeline split"):
        check("pp", tiny_vlms["idefics3"])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_through_the_familys_cache_is_the_teacher_forced_argmax(tiny_vlms, family):
    """Each action token decoded one at a time, reading the family's cache of the prefix and earlier
    tokens, is the argmax of the full forward given the same tokens."""
    from uma_lightning.models.vlm import VLMModelConfig, VLMTokenModel

    torch.manual_seed(0)
    model = VLMTokenModel(VLMModelConfig(str(tiny_vlms[family]), SPEC, max_text_len=8, n_action_bins=16)).eval()
    load_pretrained(model)
    images, state = observation(seed=1)
    text_ids, text_mask = model.text_tokenizer(INSTRUCTIONS)
    with torch.no_grad():
        chunk = model.predict_actions(images, state, text_ids, text_mask)
        tokens = model.action_binner.encode(chunk).flatten(1)
        logits = model(images, state, text_ids, text_mask, tokens)
    assert chunk.shape == (2, SPEC.action_horizon, SPEC.action_dim)
    assert torch.equal(logits.argmax(-1), tokens)
    assert len(tokens.unique()) > 1  # not a constant the check would pass on by chance


@pytest.mark.parametrize("family", FAMILIES)
def test_the_flops_of_a_vlm_step_are_counted_on_fake_tensors_as_a_real_step_counts_them(tiny_vlms, family):
    """MFU, MLflow and uma plan count a step on fake tensors: for a VLM, the count equals torch's flop
    counter over a real step of the loaded model (Idefics3's image path once made it fall back and fail)."""
    from torch.utils.flop_counter import FlopCounterMode

    from uma_lightning.modules import PretrainModule

    data = small_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    module = PretrainModule(spec=data.spec, network={"pretrained": str(tiny_vlms[family]), "max_text_len": 8},
                            normalization=data.normalization())  # fmt: skip
    module.configure_model()
    load_pretrained(module.model)
    with FlopCounterMode(display=False) as counter:
        module.compute_loss(batch)["loss"].backward()
    assert module.count_flops_per_sample(batch) == round(counter.get_total_flops() / len(batch["sample_id"]))
    assert module.flops_problem is None
