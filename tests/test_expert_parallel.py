"""Expert parallelism on two gloo ranks, composed with FSDP as the ep_fsdp strategy lays them out:
each rank keeps half the experts and exchanges tokens with all-to-all, the other parameters are
FSDP-sharded over both. Outputs, gradients and the clipping norm equal one process running both
ranks' samples.
Checkpoints keep whole [E, ...] tensors under plain names, so the resharding matrix holds,
optimizer state included: ep=2 loads into one unsharded process and under plain FSDP, and a
one-process or plain-FSDP checkpoint loads under ep=2."""

import json
import math
import os
import time
from pathlib import Path

import forked_cli
import pytest
import torch
from checkpoint_helpers import assert_bitwise_equal, checkpoint_tensors, full_state, save_module
from checkpoint_modules import resume_recipe
from suite import REPO, free_port

from uma_lightning.checkpoint import committed
from uma_lightning.checkpoint.state import load_module
from uma_lightning.models import MoEConfig, Transformer, TransformerConfig
from uma_lightning.parallel import MeshShape, ParallelConfig
from uma_lightning.parallel.apply import apply_fsdp
from uma_lightning.parallel.grad_norm import clip_grad_norm
from uma_lightning.parallel.mesh import build_mesh
from uma_lightning.parallel.plans.experts import apply_expert_parallel, check_expert_parallel, expert_parameters

CONFIG = TransformerConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64,
                           moe=MoEConfig(n_experts=4, top_k=2, n_shared=1, expert_dim=32))  # fmt: skip
BATCH, SEQ = 4, 8
FIT_DATA = ["--data.generation.n_episodes", "6", "--data.batch_size", "4", "--data.loader.num_workers", "0"]


def moe_backbone(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CONFIG, max_seq_len=SEQ)


def inputs(seed: int = 3) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, CONFIG.dim, generator=torch.Generator().manual_seed(seed))


def optimizer_for(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)  # DTensors of two meshes


def sharded(model: Transformer, mesh, ep: bool) -> Transformer:
    """The layout of ep_fsdp (experts over ep, the rest FSDP) or, without ``ep``, of plain fsdp."""
    if ep:
        apply_expert_parallel(model, mesh["ep"])
    apply_fsdp(
        list(model.layers), model, mesh["dp_shard"], ParallelConfig(), ignored=expert_parameters(model) if ep else None
    )
    return model


def assert_same_state(loaded: dict, saved: dict) -> None:
    assert loaded.keys() == saved.keys()
    different = [key for key in saved if not torch.equal(loaded[key], saved[key])]
    assert not different, different[:5]


def ep_rank(rank: int, world_size: int, port: int, root: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    mesh = build_mesh(MeshShape(dp_replicate=1, dp_shard=world_size, tp=1, ep=world_size), "cpu")
    group = dist.new_group(backend="gloo")
    root = Path(root)
    reference, model = moe_backbone(0), sharded(moe_backbone(0), mesh, ep=True)
    batch, mine = inputs(), slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)

    # One process, every sample, the summed loss; each rank sums over its samples and data
    # parallelism averages over ranks, so every gradient is the reference's over the world size.
    expected = reference(batch)
    expected.square().sum().backward()
    out = model(batch[mine])
    out.square().sum().backward()
    torch.testing.assert_close(out, expected[mine], rtol=1e-5, atol=1e-6)
    owned = slice(rank * 2, rank * 2 + 2)  # 4 experts over 2 ranks
    for (name, parameter), (_, whole) in zip(model.named_parameters(), reference.named_parameters()):
        if ".experts." in name:
            assert parameter.to_local().shape[0] == 2
            torch.testing.assert_close(
                parameter.grad.to_local(), whole.grad[owned] / world_size, rtol=1e-5, atol=1e-6, msg=name
            )
        else:
            torch.testing.assert_close(
                parameter.grad.full_tensor(), whole.grad / world_size, rtol=1e-5, atol=1e-6, msg=name
            )
    # The clipping norm spans both meshes (experts on ep, the rest on dp_shard): one process's norm,
    # in either order (the experts' part is small: first, a norm that missed the rest would show).
    expected_norm = torch.nn.utils.get_total_norm([p.grad / world_size for p in reference.parameters()])
    experts = expert_parameters(model)
    experts_first = [p for p in model.parameters() if p in experts] + [
        p for p in model.parameters() if p not in experts
    ]
    for order in (list(model.parameters()), experts_first):
        torch.testing.assert_close(clip_grad_norm(order, math.inf), expected_norm)
    clip_grad_norm(list(model.parameters()), float(expected_norm) / 2)
    torch.testing.assert_close(clip_grad_norm(list(model.parameters()), math.inf), expected_norm / 2, rtol=1e-5, atol=0)
    optimizer = optimizer_for(model)
    optimizer.step()

    # ep=2 -> one process (the parent test loads it) and -> plain FSDP.
    save_module(root / "ep2", 1, model, optimizer, process_group=group)
    saved = full_state(model, optimizer)
    if rank == 0:
        torch.save(saved, root / "ep2.pt")
    fsdp = sharded(moe_backbone(1), mesh, ep=False)
    fsdp_optimizer = optimizer_for(fsdp)
    load_module(fsdp, root / "ep2" / "step-000000001", [fsdp_optimizer], group)
    assert_same_state(full_state(fsdp, fsdp_optimizer), saved)

    # plain FSDP -> ep=2, after a step of its own; and one process -> ep=2 (the parent saved it).
    fsdp(inputs(7)[mine]).square().sum().backward()
    fsdp_optimizer.step()
    save_module(root / "fsdp", 1, fsdp, fsdp_optimizer, process_group=group)
    sources = {"fsdp": full_state(fsdp, fsdp_optimizer), "plain": torch.load(root / "plain.pt", weights_only=True)}
    for source, expected_state in sources.items():
        fresh = sharded(moe_backbone(2), mesh, ep=True)
        fresh_optimizer = optimizer_for(fresh)
        load_module(fresh, root / source / "step-000000001", [fresh_optimizer], group)
        assert_same_state(full_state(fresh, fresh_optimizer), expected_state)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_expert_parallel_with_fsdp_matches_one_process_and_checkpoints_reshard(tmp_path):
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
    assert_same_state(full_state(model, optimizer), saved)


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


# A mixture of experts small enough for four gloo processes on two cores.
SMALL_MOE = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64,
             "moe": {"n_experts": 4, "top_k": 2, "n_shared": 1, "every_n_layers": 2, "expert_dim": 32}}  # fmt: skip
FIT_STEPS = 8


@pytest.mark.slow(seconds=35)
@pytest.mark.crowd  # four ranks
@pytest.mark.timeout(600)
def test_uma_fit_under_ep_fsdp_resumes_bit_for_bit_after_sigkill(tmp_path):
    """The pretrain recipe with experts under the ep_fsdp fragment on 4 processes, ep 2 (each rank's
    experts FSDP-sharded over the 2 ranks that hold the same ones; the rest FSDP over all 4). Every
    rank killed (SIGKILL) after a checkpoint, the same command run again: it resumes and ends bit for
    bit where an uninterrupted run ends, in every model and optimizer tensor."""
    runs = {}
    for name in ("reference", "interrupted"):
        recipe = resume_recipe(tmp_path / f"{name}.yaml", tmp_path / name / "record", every_n_steps=2,
                               trainer={"max_steps": FIT_STEPS, "accelerator": "cpu", "devices": 4})  # fmt: skip
        runs[name] = ["fit", "--config", recipe, "--config", str(REPO / "configs" / "strategy" / "ep_fsdp.yaml"), "--trainer.strategy.init_args.sizes.ep", "2",
                      "--model.network.size", json.dumps(SMALL_MOE), *FIT_DATA, "--trainer.default_root_dir", str(tmp_path / name / "run")]  # fmt: skip
    assert forked_cli.run_as_ranks(runs["reference"], tmp_path / "reference.log", tmp_path, world_size=4) == [0] * 4
    assert (
        "strategy: FSDP x EP on mesh dp_replicate 1 x dp_shard 4 x tp 1 (ep 2: experts split over 2 ranks, held by 2)"
        in (tmp_path / "reference.log").read_text()
    )

    checkpoints = tmp_path / "interrupted" / "run" / "checkpoints"
    ranks = forked_cli.start_ranks(runs["interrupted"], tmp_path / "killed.log", tmp_path, world_size=4)
    deadline = time.monotonic() + 300
    while not committed(checkpoints):
        assert all(rank.is_alive() for rank in ranks) and time.monotonic() < deadline, "no checkpoint before the kill"
        time.sleep(0.005)
    for rank in ranks:
        rank.kill()  # SIGKILL
        rank.join()
    killed_at = max(step for step, _ in committed(checkpoints))
    assert killed_at < FIT_STEPS

    assert forked_cli.run_as_ranks(runs["interrupted"], tmp_path / "resumed.log", tmp_path, world_size=4) == [0] * 4
    assert (
        f"resumed from {checkpoints / f'step-{killed_at:09d}'}: step {killed_at}"
        in (tmp_path / "resumed.log").read_text()
    )
    final = f"run/checkpoints/step-{FIT_STEPS:09d}"
    expected = checkpoint_tensors(tmp_path / "reference" / final)
    assert expected["model/model.backbone.layers.1.ffn.experts.w1"].shape == (4, 32, 32)  # whole, under its plain name
    assert_bitwise_equal(checkpoint_tensors(tmp_path / "interrupted" / final), expected)
