"""Tiny random vision-language models of real Hugging Face families, built locally from their configs.

Each is what ``save_pretrained`` writes for a real checkpoint: ``config.json``, safetensors weights, the
tokenizer files and the image processor's config, in one directory. Nothing is downloaded: the
tokenizer is a word-level vocabulary trained here on a few sentences (the ``tokenizers`` library),
wrapped as the fast tokenizer the family's processor takes, and the weights are random.

``tiny_vlm_dir(family, path)`` writes one (or reuses one already written there) and returns the
directory. The families, by their ``model_type``: ``idefics3`` (SmolVLM's architecture: a SigLIP-style
vision tower, a pixel-shuffle connector, a Llama language model) and ``paligemma`` (a SigLIP vision
tower, a linear projector, a Gemma language model). Images are 32x32 in patches of 8.
"""

from __future__ import annotations

from pathlib import Path

from uma_lightning.models.vlm import import_transformers

#: The families a tiny model can be built of.
FAMILIES = ("idefics3", "paligemma")

IMAGE_SIZE = 32
PATCH_SIZE = 8

#: What the tokenizer learns its words from: the instructions of the generated robot data and a few more.
SENTENCES = (
    "pick up the red cube and place it in the bowl",
    "push the blue block to the left of the green one",
    "open the drawer then close it",
    "move the arm up and down slowly",
    "reach the target with the gripper",
    "stack the yellow block on top of the red block",
)
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>", "<image>", "<fake_token_around_image>", "<global-img>",
                  "<end_of_utterance>")  # fmt: skip


def trained_tokenizer(sentences=SENTENCES):
    """A fast tokenizer (``PreTrainedTokenizerFast``) over a word-level vocabulary trained on
    ``sentences``: lower-cased whitespace words, with the special tokens both families use."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.trainers import WordLevelTrainer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(sentences, WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS)))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )


def tiny_vlm_dir(family: str, path) -> Path:
    """A directory under ``path`` holding a tiny random model of ``family`` (one of ``FAMILIES``), its
    tokenizer and image processor, as ``save_pretrained`` writes them; written once, then reused."""
    return vlm_dir(family, Path(path) / f"tiny-{family}")


def vlm_dir(family: str, directory, vision: dict | None = None, text: dict | None = None, **config) -> Path:
    """``directory`` holding a random model of ``family``, its tokenizer and image processor, as
    ``save_pretrained`` writes them; the tiny model's settings, with ``vision`` and ``text`` updating
    its vision and language model configs and ``config`` the family's own (e.g. ``scale_factor``).
    Written once, then reused."""
    if family not in FAMILIES:
        raise ValueError(f"no model of family {family!r}: one of {FAMILIES}")
    directory = Path(directory)
    if any(directory.glob("*.safetensors")):
        return directory
    import torch

    import_transformers()  # before any `from transformers import`, which would find it shadowed here
    with torch.random.fork_rng():  # the builders seed torch's generator; the caller's draws stay as they were
        model, processor = _BUILDERS[family](vision or {}, text or {}, **config)
    directory.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(directory)
    model.save_pretrained(directory)
    return directory


def _idefics3(vision: dict, text: dict, scale_factor: int = 2):
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tokenizer = trained_tokenizer()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, **vision}  # fmt: skip
    config = Idefics3Config(
        vision_config=vision,
        text_config={"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 512, "pad_token_id": tokenizer.pad_token_id, **text},
        scale_factor=scale_factor,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    image_size = vision["image_size"]
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size}, do_image_splitting=False
    )
    tokens_per_image = (image_size // vision["patch_size"]) ** 2 // scale_factor**2
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=tokens_per_image)
    torch.manual_seed(0)
    return Idefics3ForConditionalGeneration(config).eval(), processor


def _paligemma(vision: dict, text: dict):
    import torch
    from transformers import (
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessorPil,
    )

    tokenizer = trained_tokenizer()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "projection_dim": 64, **vision}  # fmt: skip
    image_processor = SiglipImageProcessorPil(size={"height": vision["image_size"], "width": vision["image_size"]})
    image_processor.image_seq_length = (vision["image_size"] // vision["patch_size"]) ** 2
    processor = PaliGemmaProcessor(image_processor, tokenizer)  # adds its location and segmentation words
    config = PaliGemmaConfig(
        vision_config=vision,
        text_config={"model_type": "gemma", "vocab_size": len(processor.tokenizer), "hidden_size": 64,
                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
                     "pad_token_id": tokenizer.pad_token_id, **text},
        image_token_id=processor.image_token_id,
        projection_dim=vision["projection_dim"],
    )  # fmt: skip
    torch.manual_seed(0)
    return PaliGemmaForConditionalGeneration(config).eval(), processor


_BUILDERS = {"idefics3": _idefics3, "paligemma": _paligemma}


def paligemma_3b_config_dir(path) -> Path:
    """A directory under ``path`` holding what planning needs of PaliGemma 3B (224 px): its config.json,
    with the published hyperparameters (SigLIP So400m without its pooling head, Gemma 2B with
    PaliGemma's 257216 words), and a tokenizer; no weights, no image processor."""
    transformers = import_transformers()
    directory = Path(path) / "paligemma-3b-pt-224"
    config = transformers.PaliGemmaConfig(
        text_config={"model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18,
                     "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 257216},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                       "num_hidden_layers": 27, "num_attention_heads": 16, "patch_size": 14, "image_size": 224,
                       "projection_dim": 2048, "vision_use_head": False},
        projection_dim=2048,
        image_token_id=257152,
    )  # fmt: skip
    return _config_only_dir(directory, config)


def smolvlm_256m_config_dir(path) -> Path:
    """A directory under ``path`` holding what planning needs of SmolVLM-256M: its config.json, with
    the published hyperparameters (SigLIP base patch-16/512, SmolLM2-135M with SmolVLM's 49280 words
    and its own output layer, a 4x pixel shuffle), and a tokenizer; no weights, no image processor."""
    transformers = import_transformers()
    config = transformers.Idefics3Config(
        text_config={"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49280,
                     "tie_word_embeddings": False},
        vision_config={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                       "num_attention_heads": 12, "patch_size": 16, "image_size": 512},
        scale_factor=4,
        image_token_id=49190,
    )  # fmt: skip
    return _config_only_dir(Path(path) / "SmolVLM-256M-Instruct", config)


def _config_only_dir(directory: Path, config) -> Path:
    config.save_pretrained(directory)
    trained_tokenizer().save_pretrained(directory)
    return directory
