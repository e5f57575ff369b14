"""Expert parallelism on two gloo ranks: each rank keeps half the experts and exchanges tokens with
all-to-all. Outputs and gradients equal one process running both ranks' samples; checkpoints keep
whole [E, ...] tensors under plain names, so an ep=2 checkpoint loads into one unsharded process
(optimizer state included) and a one-process checkpoint loads under ep=2."""

import os
from pathlib import Path

import pytest
import torch

import forked_cli
from checkpoint_helpers import full_state, save_module
from suite import free_port
from uma_lightning.checkpoint.state import load_module
from uma_lightning.models import MoEConfig, Transformer, TransformerConfig
from uma_lightning.parallel.plans.experts import apply_expert_parallel, check_expert_parallel

CONFIG = TransformerConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64,
                           moe=MoEConfig(n_experts=4, top_k=2, n_shared=1, expert_dim=32))  # fmt: skip
BATCH, SEQ = 4, 8


def moe_backbone(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CONFIG, max_seq_len=SEQ)


def inputs(seed: int = 3) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, CONFIG.dim, generator=torch.Generator().manual_seed(seed))


def optimizer_for(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)  # plain tensors beside DTensors


def ep_rank(rank: int, world_size: int, port: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    reference, model = moe_backbone(0), moe_backbone(0)
    apply_expert_parallel(model, mesh["ep"])
    batch, mine = inputs(), slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)

    # One process, every sample; summed losses, so each rank's share adds up to it.
    expected = reference(batch)
    expected.square().sum().backward()
    out = model(batch[mine])
    out.square().sum().backward()
    torch.testing.assert_close(out, expected[mine], rtol=1e-5, atol=1e-6)
    owned = slice(rank * 2, rank * 2 + 2)  # 4 experts over 2 ranks
    for (name, parameter), (_, whole) in zip(model.named_parameters(), reference.named_parameters()):
        if ".experts." in name:
            assert parameter.to_local().shape[0] == 2
            torch.testing.assert_close(parameter.grad.to_local(), whole.grad[owned], rtol=1e-5, atol=1e-6, msg=name)
        else:  # replicated: this rank's samples' share of the gradient, summed as data parallelism would
            dist.all_reduce(parameter.grad)
            torch.testing.assert_close(parameter.grad, whole.grad, rtol=1e-5, atol=1e-6, msg=name)

    # ep=2 -> one process: whole tensors under plain names (the parent test loads them).
    optimizer = optimizer_for(model)
    optimizer.step()
    save_module(Path(root) / "ep2", 1, model, optimizer, process_group=dist.new_group(backend="gloo"))
    state = full_state(model, optimizer)
    if rank == 0:
        torch.save(state, Path(root) / "ep2.pt")

    # one process -> ep=2: the parent saved an unsharded run before starting the ranks.
    fresh = moe_backbone(1)
    apply_expert_parallel(fresh, mesh["ep"])
    fresh_optimizer = optimizer_for(fresh)
    load_module(fresh, Path(root) / "plain" / "step-000000001", [fresh_optimizer], dist.new_group(backend="gloo"))
    saved = torch.load(Path(root) / "plain.pt", weights_only=True)
    loaded = full_state(fresh, fresh_optimizer)
    assert loaded.keys() == saved.keys()
    different = [key for key in saved if not torch.equal(loaded[key], saved[key])]
    assert not different, different[:5]
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_matches_one_process_and_checkpoints_reshard(tmp_path):
    plain = moe_backbone(2)
    plain_optimizer = optimizer_for(plain)
    plain(inputs(5)).square().mean().backward()
    plain_optimizer.step()
    save_module(tmp_path / "plain", 1, plain, plain_optimizer)
    torch.save(full_state(plain, plain_optimizer), tmp_path / "plain.pt")

    forked_cli.run_ranks(ep_rank, 2, free_port(), str(tmp_path), timeout=600)

    saved = torch.load(tmp_path / "ep2.pt", weights_only=True)
    assert saved["model/layers.0.ffn.experts.w1"].shape == (4, 32, 32)  # whole, under its plain name
    model = moe_backbone(1)
    optimizer = optimizer_for(model)
    load_module(model, tmp_path / "ep2" / "step-000000001", [optimizer])
    loaded = full_state(model, optimizer)
    assert loaded.keys() == saved.keys()
    different = [key for key in saved if not torch.equal(loaded[key], saved[key])]
    assert not different, different[:5]


def test_expert_parallel_is_checked_before_any_work():
    model = moe_backbone(0)
    check_expert_parallel(model, 2, 4)  # fits
    with pytest.raises(ValueError, match=r"^ep 3 does not divide the world size 4$"):
        check_expert_parallel(model, 3, 4)
    with pytest.raises(ValueError, match=r"^ep 8 does not divide the 4 experts of layers.0.ffn$"):
        check_expert_parallel(model, 8, 8)
    dense = Transformer(TransformerConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64), max_seq_len=SEQ)
    with pytest.raises(ValueError, match="ep 2 needs a model with mixture-of-experts layers"):
        check_expert_parallel(dense, 2, 2)
