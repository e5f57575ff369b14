"""Resharding: a checkpoint saved under one parallel layout and world size loads under another.

Two gloo ranks save the same network under FSDP2, DDP, and compile + activation checkpointing + FSDP2,
then load: DDP -> FSDP2 and FSDP2 -> tensor parallel on two ranks; FSDP2 (2 ranks) -> one process and
compile + AC + FSDP2 -> the plain, unwrapped network here. Every loaded tensor must equal, bit for bit,
the unsharded state of the run that saved it. The layouts are built here with fully_shard and
parallelize_module, as the parallel strategies build them.
"""

import os
from pathlib import Path

import forked_cli
import pytest
import torch
from checkpoint_helpers import backbone, full_state, save_module, train_step
from suite import free_port

from uma_lightning.checkpoint.state import load_module
from uma_lightning.checkpoint.storage import tensor_metadata

# Two gloo ranks save and reshard for every test here.
pytestmark = pytest.mark.slow


def optimizer_for(model):
    # Not foreach: tensor parallelism leaves norm weights plain tensors beside DTensors.
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def compiled_checkpointed_fsdp(model, mesh):
    """Per block: activation checkpointing, then torch.compile, then FSDP2; the root sharded last."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    for index, layer in enumerate(model.layers):
        wrapped = torch.compile(checkpoint_wrapper(layer), backend="eager")
        fully_shard(wrapped, mesh=mesh)
        model.layers[index] = wrapped
    return fully_shard(model, mesh=mesh)


def tensor_parallel(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.layers:
        plan = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(),
            "ffn.w1": ColwiseParallel(),
            "ffn.w3": ColwiseParallel(),
            "ffn.w2": RowwiseParallel(),
        }
        parallelize_module(layer, mesh, plan)
    return model


def trained_under(layout, mesh, rank: int):
    model = layout(backbone(seed=0), mesh)
    optimizer = optimizer_for(model)
    for step in range(2):
        train_step(model, optimizer, seed=10 * step + rank)  # ranks see different data, as in training
    return model, optimizer


def save_and_reshard(rank: int, world_size: int, port: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world_size,))

    def save(name, model, optimizer):
        save_module(Path(root) / name, 1, model, optimizer, process_group=group)
        reference = full_state(model, optimizer)
        if rank == 0:
            torch.save(reference, Path(root) / f"{name}.pt")

    save("fsdp", *trained_under(fsdp, mesh, rank))
    save("ddp", *trained_under(lambda model, _: DistributedDataParallel(model), mesh, rank))
    save("compiled", *trained_under(compiled_checkpointed_fsdp, mesh, rank))

    for source, layout in (("ddp", fsdp), ("fsdp", tensor_parallel)):
        model = layout(backbone(seed=1), mesh)  # other initial weights, so loading must overwrite them
        optimizer = optimizer_for(model)
        load_module(model, Path(root) / source / "step-000000001", [optimizer], group)
        loaded = full_state(model, optimizer)
        expected = torch.load(Path(root) / f"{source}.pt", weights_only=True)
        assert loaded.keys() == expected.keys(), sorted(set(loaded) ^ set(expected))[:5]
        different = [key for key in expected if not torch.equal(loaded[key], expected[key])]
        assert not different, f"{source} -> {layout.__name__}: {different[:5]}"
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    forked_cli.run_ranks(save_and_reshard, 2, free_port(), str(root))
    return root


def test_ddp_to_fsdp_and_fsdp_to_tensor_parallel_on_two_ranks(saved):
    # Checked inside the ranks (see save_and_reshard); here, that they ran and left their checkpoints.
    assert all((saved / name / "step-000000001" / "manifest.json").is_file() for name in ("fsdp", "ddp", "compiled"))


def test_fsdp_on_two_ranks_loads_into_one_process(saved):
    model = backbone(seed=1)
    optimizer = optimizer_for(model)
    load_module(model, saved / "fsdp" / "step-000000001", [optimizer])
    expected = torch.load(saved / "fsdp.pt", weights_only=True)
    loaded = full_state(model, optimizer)
    assert loaded.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(loaded[key], expected[key])] == []


def test_compiled_checkpointed_fsdp_checkpoint_loads_into_the_plain_model(saved):
    checkpoint = saved / "compiled" / "step-000000001"
    names = [key.removeprefix("model/") for key in tensor_metadata(checkpoint) if key.startswith("model/")]
    assert names and not any(
        wrapper in name for name in names for wrapper in ("_orig_mod", "_checkpoint_wrapped", "_fsdp")
    )
    plain = backbone(seed=1)
    load_module(plain, checkpoint)
    expected = torch.load(saved / "compiled.pt", weights_only=True)
    assert sorted(f"model/{n}" for n in plain.state_dict()) == sorted(k for k in expected if k.startswith("model/"))
    assert all(torch.equal(value, expected[f"model/{name}"]) for name, value in plain.state_dict().items())
