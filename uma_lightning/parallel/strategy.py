"""``MeshStrategy``: one Lightning strategy for DDP, FSDP2, tensor parallel, pipeline parallel and their hybrids.

The strategy owns a pp x dp_replicate x dp_shard x tp device mesh, with ep inside the data-parallel
ranks for mixture-of-experts models (``mesh.py``). After the module's
``configure_model()`` has built the model, it looks up the parallel plan registered for each of
the module's submodules (``plans/``) and applies it; a module without one gets the generic plan
(``plans/generic.py``: data parallelism for any network, tensor parallelism from a layout it
declares). A module that parallelizes itself in ``configure_model()``, as Lightning's
ModelParallelStrategy expects, is left as it is. After the plan, every mesh dimension above one
must hold something (``check_laid_out``): a plan that ignores tp is refused, not run as replicas.

Its settings are three sections (``sizes``, ``pipeline``, ``wrapping``). ``register_strategies()``
adds the names in ``PRESETS`` (ddp, fsdp, tp, hsdp, fsdp_tp, pp, pp_fsdp, pp_fsdp_tp, ep, ep_fsdp) to
Lightning's registry (``Trainer(strategy=NAME)``, ``--trainer.strategy NAME``), ours in place of its
own ddp and fsdp; Lightning's classes stay available by class path.

Under pp the plan's pipeline split (``Plan.pipeline``; the robot transformer's: ``plans/pipeline.py``)
cuts the model into stages and the training step runs the schedule (``pipeline.py``): forward and
backward of every microbatch happen inside the module's forward call, and this strategy's
``backward`` then only runs the hooks around it.

Other layouts take explicit sections (``configs/strategy/*.yaml``, which hold what differs from the defaults).
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta
from typing import ClassVar, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from uma_lightning.lightning_compat import optimizers_to_device, release_strategy_name
from uma_lightning.parallel.apply import ParallelConfig, reshard_data_parallel
from uma_lightning.parallel.mesh import MeshShape, MeshSizes, build_mesh, describe_sizes, resolve_mesh_shape
from uma_lightning.parallel.pipeline import PipelineConfig, pipeline_of
from uma_lightning.parallel.plans import Plan, plan_for
from uma_lightning.parallel.plans.generic import GENERIC_PLAN, plan_or_generic

log = logging.getLogger("uma_lightning")


class MeshStrategy(ModelParallelStrategy):
    """Its settings come in sections, each declared once: ``sizes`` (``MeshSizes``), ``pipeline``
    (``PipelineConfig``) and ``wrapping`` (``ParallelConfig``)."""

    #: Arguments of earlier versions that moved into a section: old name -> new key.
    moved_settings: ClassVar[dict[str, str]] = {
        **{f.name: f"sizes.{f.name}" for f in dataclasses.fields(MeshSizes)},
        **{f"pp_{f.name}": f"pipeline.{f.name}" for f in dataclasses.fields(PipelineConfig)},
        **{f.name: f"wrapping.{f.name}" for f in dataclasses.fields(ParallelConfig) if f.init},
    }

    def __init__(
        self,
        sizes: MeshSizes = MeshSizes(),
        pipeline: PipelineConfig = PipelineConfig(),
        wrapping: ParallelConfig = ParallelConfig(),
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        """
        Args:
            sizes: The mesh: dp_replicate, dp_shard, tp, pp, ep (see ``MeshSizes``).
            pipeline: Under pp: schedule, microbatches, virtual_stages, split (see ``PipelineConfig``).
            wrapping: What the plan applies besides the layout: activation checkpointing, compile, FSDP's
                resharding and CPU offload (see ``ParallelConfig``).
            save_distributed_checkpoint: Each rank saves its own shard (a folder); False gathers one file on rank 0.
            process_group_backend: nccl, gloo...; None picks the device's default.
            timeout: Collective timeout.
        """
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.sizes, self.pipeline, self.wrapping = sizes, pipeline, wrapping
        self.shape: MeshShape | None = None

    # ---- the mesh ------------------------------------------------------------------------------

    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        # Called when the Trainer is built, once devices and nodes are known: a mesh that does not
        # fit the world fails here, before any process is launched.
        if self.parallel_devices:
            self.shape = resolve_mesh_shape(dataclasses.asdict(self.sizes), self.world_size, self.num_processes)

    def setup_environment(self) -> None:
        self._setup_distributed()
        assert self.shape is not None
        self._device_mesh = build_mesh(self.shape, self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh  # Lightning's convention: module.device_mesh
        self._log(
            f"strategy: {describe(self.shape)} on mesh {self.shape} ({self.world_size} processes, "
            f"{self._get_process_group_backend()} backend; sizes asked: {describe_sizes(dataclasses.asdict(self.sizes))})"
        )

    @property
    def shards_parameters(self) -> bool:
        """Whether each process holds only its part of the parameters (FSDP, tensor parallel): a stage
        module then loads the weights it starts from after the layout (``StageModule.initialise_weights``).
        Pipeline stages are cut from a whole model."""
        return self.shape.pp == 1 and (self.shape.dp_shard > 1 or self.shape.tp > 1)

    @property
    def distributed_sampler_kwargs(self) -> dict:
        # Tensor-parallel ranks and pipeline stages see the same batch; only data-parallel ranks get
        # different samples. tp is the innermost mesh dimension and pp the outermost.
        return {"num_replicas": self.shape.dp, "rank": self.global_rank // self.shape.tp % self.shape.dp}

    # ---- the plan ------------------------------------------------------------------------------

    def check_module(self, module: nn.Module, batch_size: int | None = None) -> None:
        """Raise a one-line ValueError if ``module`` cannot be laid out on this mesh (under pp: in
        stages, on batches of ``batch_size`` samples per data-parallel rank).

        Before ``configure_model()`` has run, a module with ``build_model()`` (PretrainModule and
        its subclasses) is built on the meta device for the check, which costs no memory.
        """
        assert self.shape is not None, "the Trainer sets the mesh shape"
        targets = _planned_submodules(module)
        if not targets and callable(getattr(module, "build_model", None)):
            with torch.device("meta"):
                built = module.build_model()
            targets = [(built, plan_or_generic(built))]
        if not targets:
            raise ValueError(f"{type(module).__name__} holds no parameters to lay out on mesh {self.shape}")
        for model, plan in targets:
            plan.check(model, self.shape, self.wrapping)
            if self.shape.pp > 1:
                self.pipeline.check(self.shape.pp, batch_size)
                _pipeline_split(model, plan, self.shape).check(model, self.shape, self.pipeline)

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        # Cast before sharding: FSDP keeps the dtype its parameters have when it wraps them.
        self.model = self.precision_plugin.convert_module(self.model)
        self._parallelize(self.lightning_module, bf16_params=trainer.precision == "bf16-mixed")
        if getattr(self.lightning_module, "weights_pending", False):
            self.lightning_module.initialise_weights(self.root_device)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: nn.Module, bf16_params: bool) -> None:
        if _is_parallelized(module):
            # configure_model() parallelized it itself (Lightning's convention), or an earlier stage did.
            self._log(f"parallel plan: none applied, {type(module).__name__}'s model is already parallelized")
            return
        targets = _planned_submodules(module)
        if not targets:
            raise ValueError(f"{type(module).__name__} holds no parameters to lay out on mesh {self.shape}")
        config = self.wrapping.with_bf16_params(bf16_params)
        for model, plan in targets:
            plan.check(model, self.shape, config)
            model_class = type(model).__name__  # before data parallelism renames the class (FSDPRobotTransformer...)
            if self.shape.pp > 1:
                split = _pipeline_split(model, plan, self.shape)
                applied = split.apply(model, self.device_mesh, config, self.pipeline, self.root_device)
            else:
                applied = plan.parallelize(model, self.device_mesh, config)
            check_laid_out(model, self.shape, plan.name)
            self._log(
                f"parallel plan {plan.name} on {model_class}: {'; '.join(applied) or 'nothing to apply on one process'}"
            )

    def on_validation_end(self) -> None:
        # Validation runs forward only, and FSDP2 puts gathered parameters back in their shards only in
        # backward (the root's, and every replicated module's): without this, a checkpoint taken right
        # after a validation (the final one, at max_steps) failed in FSDP's state-dict hook.
        super().on_validation_end()
        reshard_data_parallel(self.lightning_module)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args, **kwargs) -> torch.Tensor:
        if self.shape.pp == 1:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The pipeline schedule ran every microbatch's backward inside the training step's forward
        # call: what is left of Lightning's backward is to hand its gradients back (the loop cleared
        # them after the training step) between the hooks around it, which callbacks rely on.
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        pipeline_of(module).restore_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _log(self, message: str) -> None:
        if self.is_global_zero:
            log.info(message)


def describe(shape: MeshShape) -> str:
    """FSDP, HSDP, DDP, TP or their product, from the sizes that are above one."""
    if shape.dp_replicate > 1 and shape.dp_shard > 1:
        data = "HSDP"
    elif shape.dp_shard > 1:
        data = "FSDP"
    elif shape.dp_replicate > 1:
        data = "DDP"
    else:
        data = ""
    parts = [
        p for p in ("PP" if shape.pp > 1 else "", data, "TP" if shape.tp > 1 else "", "EP" if shape.ep > 1 else "") if p
    ]
    return " x ".join(parts) or "one process"


def _planned_submodules(module: nn.Module) -> list[tuple[nn.Module, Plan]]:
    """The submodules with a registered plan; where none has one, every submodule holding
    parameters, under the generic plan."""
    planned = [(child, plan_for(child)) for child in module.children() if plan_for(child) is not None]
    if planned:
        return planned
    return [(child, GENERIC_PLAN) for child in module.children() if next(child.parameters(), None) is not None]


def _pipeline_split(model: nn.Module, plan: Plan, shape: MeshShape):
    if plan.pipeline is None:
        raise ValueError(
            f"pp {shape.pp}: the {plan.name} plan of {type(model).__name__} has no pipeline split; register a plan "
            "with one (uma_lightning.parallel.register_plan(..., pipeline=PipelineSplit(check, apply))), or train it without pp"
        )
    return plan.pipeline


def _is_parallelized(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters()) or any(
        isinstance(m, FSDPModule) for m in module.modules()
    )


def laid_out_dims(model: nn.Module) -> set[str]:
    """The mesh dimensions ``model``'s parameters are laid out on: data-parallel dimensions a
    parameter's mesh has (sharded or replicated), tp and ep where a parameter is split over them,
    pp where the model runs a pipeline schedule."""
    from torch.distributed.tensor import DTensor

    dims = {"pp"} if getattr(model, "pipeline", None) is not None else set()
    for param in model.parameters():
        if isinstance(param, DTensor):
            for name, placement in zip(param.device_mesh.mesh_dim_names or (), param.placements):
                if name not in ("tp", "ep") or placement.is_shard():
                    dims.add(name)
    return dims


def check_laid_out(model: nn.Module, shape: MeshShape, plan_name: str) -> None:
    """One-line ValueError where a plan left a mesh dimension above one with nothing on it (a tp run
    that trains whole replicas, data-parallel ranks that never average their gradients). The
    data-parallel dimensions count together: whether the layout is the right one (gradients
    averaged over the right group, the right dim split) is ``uma parity``'s question."""
    laid_out = laid_out_dims(model)
    data_parallel = {"dp_replicate", "dp_shard", "expert_shard", "expert_replicate"} & laid_out
    missing = [
        f"{name} {size}"
        for name, size in (("pp", shape.pp), ("tp", shape.tp), ("ep", shape.ep))
        if size > 1 and name not in laid_out
    ]
    if shape.dp > 1 and not data_parallel:
        missing.append(f"dp {shape.dp}")
    if missing:
        raise ValueError(
            f"the {plan_name} plan left {type(model).__name__} unsharded on {', '.join(missing)} of mesh {shape}: "
            "no parameter is laid out there, so those ranks would train copies; lay it out in the plan's parallelize"
        )


# Each preset is MeshStrategy's defaults (FSDP over every process) with these arguments; the
# fragments in configs/strategy/ say the same in YAML (tests/test_parallel.py holds them to it).
PRESETS: dict[str, tuple[str, dict]] = {
    # Replicas hold whole tensors, so a DDP checkpoint is one file, loadable without a process group.
    "ddp": (
        "data parallel: full replicas, all-reduced gradients",
        {"sizes": MeshSizes(dp_replicate="auto", dp_shard=1), "save_distributed_checkpoint": False},
    ),
    "fsdp": ("FSDP2: parameters, gradients and optimizer state sharded over all processes", {}),
    "tp": ("tensor parallel over all processes", {"sizes": MeshSizes(dp_shard=1, tp="auto")}),
    "hsdp": (
        "HSDP: shard within each node, replicate across nodes",
        {"sizes": MeshSizes(dp_replicate="auto", dp_shard="node")},
    ),
    "fsdp_tp": ("tensor parallel within each node, FSDP across nodes", {"sizes": MeshSizes(tp="node")}),
    "pp": ("pipeline parallel: stages of layers over all processes", {"sizes": MeshSizes(pp="auto", dp_shard=1)}),
    "pp_fsdp": ("two pipeline stages, FSDP over the processes of each", {"sizes": MeshSizes(pp=2)}),
    "pp_fsdp_tp": (
        "two pipeline stages, tensor parallel over pairs of processes in each, FSDP over the pairs",
        {"sizes": MeshSizes(pp=2, tp=2)},
    ),
    "ep": (
        "expert parallel over all processes, other parameters replicated (DDP)",
        {"sizes": MeshSizes(dp_replicate="auto", dp_shard=1, ep="auto")},
    ),
    "ep_fsdp": (
        "FSDP over all processes, experts split within each node and sharded across nodes",
        {"sizes": MeshSizes(ep="node")},
    ),
}


def register_strategies() -> None:
    for name, (description, init_args) in PRESETS.items():
        StrategyRegistry.register(name, MeshStrategy, description=description, override=True, **init_args)
    # Lightning refuses the name "fsdp" off GPU because it meant its FSDP1 strategy; it means ours now.
    release_strategy_name(FSDPStrategy, "fsdp")
