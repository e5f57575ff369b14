"""The planner's predictions against one real training step on gloo processes.

Each rank builds the model, applies its plan as ``MeshStrategy`` does (the registered one, or the
generic plan of a network without one, on the strategy's mesh), and takes one AdamW step on its
slice of the global batch (random for the robot transformer of a configuration; of the data's
shapes through the stage's own loss for a stage module's network), while it measures:

- the bytes of its local parameter, gradient and optimizer-state tensors;
- every collective the step issues and its bytes (``CollectiveBytes``: the c10d ops FSDP and DDP call
  and the functional ones DTensor calls), by kind;
- what autograd saves in the forward (``saved_activation_bytes``: a saved-tensors hook, each
  storage counted once, weights left out).

Under pp the rank runs the pipeline plan and one schedule step (forward and backward of every
microbatch inside the model's call), after one unmeasured step: a stage's first step exchanges its
tensors' shapes, which no later step repeats. Its point-to-point sends and receives both count.
Its saved-tensors total is every microbatch's, which is the peak the planner predicts for the
first stage when the microbatches are as many as the stages (1F1B keeps them all alive there);
the other stages' activations are not predicted and not compared.

The prediction for the same rank comes from ``memory.py`` and ``comm.py``. Used by the tests
(tiny model, tiny_moe under ep, networks outside the robot family) and ``benchmarks/planner.py``
(tiny and small).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from uma_lightning.checkpoint.hf import materialise
from uma_lightning.models.robot import RobotModelConfig
from uma_lightning.tools.planner.comm import step_collectives
from uma_lightning.tools.planner.layout import Layout
from uma_lightning.tools.planner.memory import Precision, activation_bytes, rank_state
from uma_lightning.tools.planner.model import (
    ModelFacts,
    facts_of_config,
    facts_of_stage,
    local_tensor,
    saved_activation_bytes,
)

if TYPE_CHECKING:
    from uma_lightning.modules.base import StageModule

# The strategies on four processes, both dimensions of the 2-D ones real.
LAYOUTS = {
    "ddp": Layout(dp_replicate=4),
    "fsdp": Layout(dp_shard=4),
    "tp": Layout(tp=4),
    "hsdp": Layout(dp_replicate=2, dp_shard=2),
    "fsdp_tp": Layout(dp_shard=2, tp=2),
    "pp": Layout(pp=4, microbatches=4),
    "pp_ddp": Layout(pp=2, dp_replicate=2, microbatches=2),
    "pp_fsdp": Layout(pp=2, dp_shard=2, microbatches=2),
}
# For a model with mixture-of-experts layers: experts split over 2 ranks, replicated (ep) or sharded (ep_fsdp) over the other 2.
EXPERT_LAYOUTS = {
    "ep": Layout(dp_replicate=4, ep=2),
    "ep_fsdp": Layout(dp_shard=4, ep=2),
    "moe fsdp_tp": Layout(dp_shard=2, tp=2),  # each tp rank routes its slice through whole experts
}
WORLD_SIZE = 4
FP32 = Precision.of("32-true")
# What a case trains: the pretraining network of a robot configuration, or a stage module's network and loss.
Source = Union[RobotModelConfig, "StageModule"]


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# Per collective op: its kind and the bytes it moves under the planner's convention (comm.py).
_COLLECTIVES = {
    "c10d.allreduce_.default": ("all-reduce", lambda args: sum(_bytes(t) for t in args[0])),
    "c10d._allgather_base_.default": ("all-gather", lambda args: _bytes(args[0])),
    "c10d._reduce_scatter_base_.default": ("reduce-scatter", lambda args: _bytes(args[1])),
    "c10d.alltoall_base_.default": ("all-to-all", lambda args: _bytes(args[1])),
    "c10d.send.default": ("p2p", lambda args: sum(_bytes(t) for t in args[0])),
    "c10d.recv_.default": ("p2p", lambda args: sum(_bytes(t) for t in args[0])),
    "_c10d_functional.all_gather_into_tensor.default": ("all-gather", lambda args: _bytes(args[0]) * args[1]),
    "_c10d_functional.reduce_scatter_tensor.default": ("reduce-scatter", lambda args: _bytes(args[0])),
    "_c10d_functional.all_reduce.default": ("all-reduce", lambda args: _bytes(args[0])),
    "_c10d_functional.all_to_all_single.default": ("all-to-all", lambda args: _bytes(args[0])),
}


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes of every collective dispatched while active, by kind."""

    def __init__(self):
        super().__init__()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = _COLLECTIVES.get(str(func))
        if known:
            kind, size = known
            self.bytes[kind] += size(args)
        return func(*args, **(kwargs or {}))


def random_batch(cfg: RobotModelConfig, batch: int, seed: int):
    from uma_lightning.models.tokenizers import ActionBinner, ByteTokenizer

    gen = torch.Generator().manual_seed(seed)
    spec = cfg.spec
    images = torch.randint(
        0, 256, (batch, spec.n_obs_steps, len(spec.cameras), *spec.image_size, 3), dtype=torch.uint8, generator=gen
    )
    state = torch.randn(batch, spec.n_obs_steps, spec.state_dim, generator=gen)
    text_ids, text_mask = ByteTokenizer(cfg.max_text_len)(["reach the red square"] * batch)
    actions = torch.rand(batch, spec.action_horizon, spec.action_dim, generator=gen) * 2 - 1
    return images, state, text_ids, text_mask, ActionBinner(cfg.n_action_bins).encode(actions).flatten(1)


def measure_rank(cases: dict[str, tuple[Source, Layout]], global_batch: int, out_dir: str) -> None:
    """One rank of the group: each case's step, measured; writes ``<name>-<rank>.json``."""
    import torch.distributed as dist

    from uma_lightning.parallel.apply import ParallelConfig
    from uma_lightning.parallel.mesh import build_mesh
    from uma_lightning.parallel.plans.generic import plan_or_generic

    dist.init_process_group("gloo")
    for name, (source, layout) in cases.items():
        mesh = build_mesh(layout, "cpu")  # a Layout is a MeshShape
        torch.manual_seed(0)
        dp_rank = mesh["dp_replicate"].get_local_rank() * layout.dp_shard + mesh["dp_shard"].get_local_rank()
        model, loss_of = _network_and_loss(source, global_batch // layout.dp, dp_rank)
        config = ParallelConfig(activation_checkpointing=layout.ac)
        plan = plan_or_generic(model)
        if layout.pp > 1:
            plan.pipeline.apply(model, mesh, config, layout.pipeline_config(), torch.device("cpu"))
            loss_of()  # the stages' shape exchange, left out of the measured step
        else:
            plan.parallelize(model, mesh, config)
        optimizer = torch.optim.AdamW(model.parameters())
        counter, saved = CollectiveBytes(), {}
        with counter:
            with saved_activation_bytes(model, saved):
                loss = loss_of()
            if layout.pp > 1:
                model.pipeline.restore_gradients()  # the schedule ran the backward; its gradients wait aside
            else:
                loss.backward()
            optimizer.step()
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        record = {
            "coords": {
                "stage": mesh["pp"].get_local_rank(),
                "tp_rank": mesh["tp"].get_local_rank(),
                "shard_rank": mesh["dp_shard"].get_local_rank(),
            },
            "params": sum(_bytes(local_tensor(p)) for p in model.parameters()),
            "grads": sum(_bytes(local_tensor(p.grad)) for p in model.parameters() if p.grad is not None),
            "optimizer": sum(_bytes(local_tensor(t)) for t in state),
            "activations": saved["bytes"],
            "collectives": dict(counter.bytes),
        }
        Path(out_dir, f"{name}-{dist.get_rank()}.json").write_text(json.dumps(record))
        dist.barrier()
    dist.destroy_process_group()


def _network_and_loss(source: Source, batch: int, seed: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """The network of ``source`` and its loss on a batch of ``batch`` samples (random for a robot
    configuration, the data's shapes for a stage module)."""
    if isinstance(source, RobotModelConfig):
        from uma_lightning.models import RobotTransformer

        model = RobotTransformer(source)
        inputs = random_batch(source, batch, seed)
        return model, lambda: model(*inputs, loss_targets=inputs[-1])[0]
    from uma_lightning.data.spec import example_batch

    source.model = model = source.build_model()
    materialise(model, "cpu")  # a pretrained model's part: its memory is measured, not its weights
    example = example_batch(source.spec, batch)
    return model, lambda: source.compute_loss(example)["loss"]


def predict_rank(
    facts: ModelFacts, layout: Layout, global_batch: int, stage: int, tp_rank: int, shard_rank: int
) -> dict:
    state = rank_state(facts, layout, FP32, stage, tp_rank, shard_rank)
    collectives: Counter[str] = Counter()
    for collective in step_collectives(facts, layout, FP32, global_batch, stage):
        collectives[collective.kind] += collective.total_bytes
    return {
        "params": state.params,
        "grads": state.grads,
        "optimizer": state.optimizer,
        "activations": activation_bytes(facts, layout, FP32, global_batch) if stage == 0 else None,
        "collectives": dict(collectives),
    }


def compare(
    cases: dict[str, tuple[Source, Layout]], global_batch: int, timeout: float = 600, world_size: int = WORLD_SIZE
) -> dict[str, list[dict]]:
    """Per case (a model and a layout), per rank: {"measured": ..., "predicted": ...}, from one launch of
    ``world_size`` processes."""
    import tempfile

    from uma_lightning.tools.launch import run_local_group

    with tempfile.TemporaryDirectory(prefix="uma-plan-check-") as out_dir:
        run_local_group(measure_rank, world_size, (cases, global_batch, out_dir), timeout)
        results = {}
        for name, (source, layout) in cases.items():
            facts = facts_of_config(source) if isinstance(source, RobotModelConfig) else facts_of_stage(source)
            ranks = [json.loads(Path(out_dir, f"{name}-{rank}.json").read_text()) for rank in range(world_size)]
            results[name] = [
                {"measured": r, "predicted": predict_rank(facts, layout, global_batch, **r["coords"])} for r in ranks
            ]
    return results
