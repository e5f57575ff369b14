"""Recorded training runs on fixed global batches, for ``uma parity``'s strategy and precision checks.

A run trains a fresh copy of a module on one process or in a local process group; rank 0 saves
what it did (``Recorder``). With a trajectory (a reference run's weights after every step), each
step starts from the reference's weights, so differences cannot compound from step to step.
"""

from __future__ import annotations

import copy
import logging
import pickle
from pathlib import Path

import torch
from lightning.pytorch import Callback

from uma_lightning.models.moe import moe_layers
from uma_lightning.parallel.moe_stats import sum_per_moe_layer
from uma_lightning.tools.fixed_batches import fit_on_batches

COMPARE_DTYPE = torch.float64  # what every record holds, whatever the run's precision


def train(job: dict, strategy, out: Path, micro_batches: int = 1, activations: bool = False) -> dict:
    """Train a fresh copy of the job's module under ``strategy`` (None: one process, accumulating
    gradients over ``micro_batches`` slices of each global batch), each step from the weights of
    ``job["trajectory"]`` if given; rank 0 saves the record to ``out`` and returns it."""
    recorder = Recorder(out, micro_batches, job.get("trajectory"), activations)
    # Compiled as in a process of its own: code compiled for an earlier run's other batch shape made
    # dynamo recompile for dynamic shapes, and trace the next run 3x slower (4 ranks: 25 s, not 8).
    torch._dynamo.reset()
    module = copy.deepcopy(job["module"])  # every run starts from the unconfigured module
    # One thread in every run, references and ranks alike: a product split over threads sums in
    # another order, and a DDP rank must match its accumulating reference bit for bit.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = fit_on_batches(
            module, job["batches"], strategy or "auto", [recorder], micro_batches, **job["trainer_args"]
        )
    finally:
        torch.set_num_threads(threads)
    return torch.load(out, weights_only=True) if trainer.is_global_zero else {}


def worker(runs_file: str) -> None:
    """One rank of a group: trains each job of ``runs_file`` under each of its strategies in turn, in the same process group."""
    from uma_lightning.parallel import MeshStrategy

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with open(runs_file, "rb") as f:
        runs = pickle.load(f)  # written by check_parity a moment ago, in its private folder
    for job, strategies in runs:
        for run in strategies:
            train(
                job,
                MeshStrategy(run["sizes"], **job["strategy_args"]),
                Path(run["out"]),
                activations=job.get("activations", False),
            )


class Recorder(Callback):
    """What a run did, saved by rank 0: per step the global loss, the full gradients and the full
    weights after the step (``params[0]``: the initial ones), and the tokens each expert of each
    mixture-of-experts layer got, summed over ranks (every stage's layers), with the layer's balancing
    bias after the step; how far the ranks' copies of each weight are
    apart at the start; and, if asked, rank 0's output of every layer in every step.

    With a ``trajectory`` (a reference's ``params``), each step starts from the reference's weights.
    """

    def __init__(
        self,
        out: Path,
        micro_batches: int,
        trajectory: list[dict] | None = None,
        activations: bool = False,
        seed: int = 0,
    ):
        self.out, self.micro_batches, self.trajectory, self.seed = out, micro_batches, trajectory, seed
        self.batch_losses: list[torch.Tensor] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.params: list[dict[str, torch.Tensor]] = []
        self.routing: list[dict[str, torch.Tensor]] = []  # per step: MoE layer -> tokens per expert
        self.expert_biases: list[dict[str, torch.Tensor]] = []  # per step: each MoE layer's balancing bias after it
        self.replica_spread: dict[str, float] = {}
        self.record_activations = activations
        self.activations: list[dict[str, torch.Tensor]] = []
        self.layer_order: list[str] = []

    def setup(self, trainer, pl_module, stage):
        torch.manual_seed(self.seed)  # configure_model runs next: the same initial weights in every run

    def on_fit_start(self, trainer, pl_module):
        self.params.append(full_parameters(pl_module))
        self.replica_spread = _replica_spread(self.params[0], trainer.strategy)
        if self.record_activations:
            self._hook_layers(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = batch_idx // self.micro_batches
        if self.trajectory is not None and batch_idx % self.micro_batches == 0 and step > 0:
            _loadfull_parameters(pl_module, self.trajectory[step])
        if self.record_activations and batch_idx % self.micro_batches == 0:
            self.activations.append({})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(
            _from_every_stage(
                {name: _full(p.grad) for name, p in pl_module.named_parameters() if p.grad is not None}, pl_module
            )
        )
        # The step's choices per expert (all its micro-batches), before the balancing bias consumes them.
        balancing = getattr(pl_module, "expert_balancing", None)
        if balancing is not None:
            self.routing.append(sum_per_moe_layer(balancing.routed, pl_module, trainer.strategy))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # The mean over all ranks is the global batch's loss: every data-parallel slice has the
        # same number of tensor-parallel copies. Under accumulation Lightning reports each
        # micro-batch's loss divided by their number; their sum is the step's loss.
        self.batch_losses.append(trainer.strategy.reduce(outputs["loss"].detach().double(), reduce_op="mean"))
        if (batch_idx + 1) % self.micro_batches == 0:
            self.params.append(full_parameters(pl_module))
            self.expert_biases.append(full_expert_biases(pl_module))

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            n = self.micro_batches
            losses = [float(sum(self.batch_losses[i : i + n])) for i in range(0, len(self.batch_losses), n)]
            record = {
                "losses": losses,
                "grads": self.grads,
                "params": self.params,
                "replica_spread": self.replica_spread,
                "routing": self.routing,
                "expert_biases": self.expert_biases,
            }
            if self.record_activations:
                record.update(activations=self.activations, layer_order=self.layer_order)
            torch.save(record, self.out)

    def _hook_layers(self, pl_module) -> None:
        """Record the output of every module that holds parameters of its own, in the first micro-batch of each step."""
        for name, module in pl_module.named_modules():
            if next(module.parameters(recurse=False), None) is not None:
                module.register_forward_hook(self._activation_hook(name))

    def _activation_hook(self, name: str):
        def hook(module, inputs, output):
            if not torch.is_grad_enabled() or not self.activations or name in self.activations[-1]:
                return  # recomputation under activation checkpointing, or a second use in the step
            tensor = _first_tensor(output)
            if tensor is not None:
                if name not in self.layer_order:
                    self.layer_order.append(name)
                self.activations[-1][name] = _local(tensor).detach().double().cpu().clone()

        return hook


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return None


def full_parameters(module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` whole, as float64 on the CPU, on every rank (collectives: call on all ranks)."""
    return _from_every_stage({name: _full(p) for name, p in module.named_parameters()}, module)


def full_expert_biases(module) -> dict[str, torch.Tensor]:
    """Every MoE layer's balancing bias (a buffer, which ``full_parameters`` leaves out), as it does the parameters."""
    return _from_every_stage(
        {f"{name}.expert_bias": _full(layer.expert_bias) for name, layer in moe_layers(module)}, module
    )


def _from_every_stage(tensors: dict[str, torch.Tensor], module) -> dict[str, torch.Tensor]:
    """Under pipeline parallelism each rank holds its stages' parameters: the union over the stages, on every rank."""
    mesh = module.device_mesh
    if mesh is None or "pp" not in (mesh.mesh_dim_names or ()) or mesh["pp"].size() == 1:
        return tensors
    import torch.distributed as dist

    stages = [None] * mesh["pp"].size()
    dist.all_gather_object(stages, tensors, group=mesh["pp"].get_group())
    return {name: tensor for stage in stages for name, tensor in stage.items()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for DTensors), as float64 on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to(COMPARE_DTYPE).cpu().clone()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def _loadfull_parameters(module, params: dict[str, torch.Tensor]) -> None:
    """Set every parameter to the full tensor in ``params``; a DTensor keeps its layout, each rank its own part."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in module.named_parameters():
        full = params[name].to(device=p.device, dtype=p.dtype)
        if isinstance(p, DTensor):
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        else:
            p.copy_(full)


def _replica_spread(params: dict[str, torch.Tensor], strategy) -> dict[str, float]:
    """Per parameter, the largest difference between the ranks' full copies (0 everywhere on one process or when all is well)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or strategy.world_size == 1:
        return {}
    spread = {}
    for name, tensor in params.items():
        copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, tensor.contiguous())
        spread[name] = max(float((c - tensor).abs().max()) if tensor.numel() else 0.0 for c in copies)
    return spread
