"""Shared by the checkpoint tests: a small real network, a training step, and a save outside Lightning."""

from pathlib import Path

import torch

from uma_lightning.checkpoint import CheckpointWriter
from uma_lightning.checkpoint.state import encode_parts, model_and_optimizer
from uma_lightning.checkpoint.storage import empty_like_saved, load_tensors, tensor_metadata
from uma_lightning.models import Transformer, TransformerConfig

BACKBONE = TransformerConfig(dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32)


def assert_bitwise_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    different = [key for key in expected if not torch.equal(actual[key], expected[key])]
    assert not different, f"differ: {different[:5]}"


def backbone(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(BACKBONE, max_seq_len=8)


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(2, 8, BACKBONE.dim, generator=generator)
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def save_module(
    root: Path, step: int, model, optimizer, async_save: bool = False, keep_last: int = 10, process_group=None
) -> None:
    """A checkpoint of a module and its optimizer, written as the training callback writes them."""
    state, tensors = encode_parts(model_and_optimizer(model, [optimizer]))
    writer = CheckpointWriter(root, keep_last, None, async_save, process_group)
    writer.save(step, state, tensors, {"epoch": 0, "world_size": 1})
    writer.close()


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor, unsharded, by checkpoint key (collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(model, [optimizer], options=StateDictOptions(full_state_dict=True))
    out = {f"model/{name}": value.detach().clone() for name, value in model_state.items()}
    for name, state in optimizer_state["state"].items():
        out.update({f"optimizer/{name}/{key}": value.detach().clone() for key, value in state.items()})
    return out


def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    entries = tensor_metadata(checkpoint)
    tensors = {
        key: empty_like_saved(entry) for key, entry in entries.items() if key.startswith(("model/", "optimizer/"))
    }
    load_tensors(tensors, checkpoint, None)
    return tensors
