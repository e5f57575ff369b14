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
