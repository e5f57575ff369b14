"""The action expert of ``RobotFlowTransformer`` (uma_lightning.models.flow) as a head of the robot
backbone family's plan (``plans/robot.py``).

- its blocks are wrapped one by one (activation checkpointing, compile, FSDP or DDP), as the backbone's;
- tensor parallel: its attention and feed-forward are split as the backbone's, with sequence
  parallelism over the action tokens. Each expert layer attends to the backbone's cached keys and
  values of the prefix: those cover the whole prefix (computed after the backbone's all-gather) and
  this rank's key/value heads. The expert shares the backbone's key/value heads and head size, and
  its column-wise wk and wv give each rank the same contiguous range of them, so the rank's
  query heads find their groups' keys in its slice of the cache;
- its input and output projections and the action-time MLP (small) are replicated; the velocity
  comes out as a plain tensor.
"""

from __future__ import annotations

from uma_lightning.models import RobotFlowTransformer
from uma_lightning.parallel.plans.registry import HeadPlan
from uma_lightning.parallel.plans.robot import apply_sequence_parallel_transformer, replicated


def action_expert_layout(model: RobotFlowTransformer, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate, distribute_module
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    distribute_module(model.action_in, tp_mesh)
    distribute_module(model.action_time_mlp, tp_mesh)
    # The sine-cosine features of the (replicated) times are made from plain tensors, and mixed with
    # the replicated action embeddings as a replicated DTensor.
    parallelize_module(
        model,
        tp_mesh,
        {
            "time_embed": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        },
    )
    parallelize_module(
        model,
        tp_mesh,
        {
            "time_embed": PrepareModuleOutput(
                output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),), use_local_output=False
            )
        },
    )
    apply_sequence_parallel_transformer(model.expert, tp_mesh)
    replicated("action_out")(model, tp_mesh)


def action_expert_sizes(model: RobotFlowTransformer) -> dict[str, int]:
    expert = model.expert_config
    return {
        "action expert n_heads": expert.n_heads,
        "action expert ffn_dim": expert.ffn_dim,
        "action_horizon": model.cfg.spec.action_horizon,
    }


ACTION_EXPERT = HeadPlan(
    "action expert",
    blocks=lambda model: list(model.expert.layers),
    tp_sizes=action_expert_sizes,
    tp_layout=action_expert_layout,
    forward_inputs=2,  # the noisy action chunk and the flow time
)
