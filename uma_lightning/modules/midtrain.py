"""Mid-training: pretraining's objective, continued from a pretrained checkpoint on another data
mixture and a longer context (more history frames, longer action chunks).

The checkpoint may come from any strategy or world size: weights are mapped by name, and the
rotary position tables are derived from the context, so a longer context extends the position
range (stated in a log line). The optimizer and learning-rate schedule start afresh, so the
learning rate warms up again. Overrides the same extension points as ``PretrainModule``.
"""

from __future__ import annotations

from uma_lightning.modules.pretrain import PretrainModule


class MidtrainModule(PretrainModule):
    key_metric = "val/action_mse"  # what the longer action chunks are for

    def setup(self, stage: str) -> None:
        if stage == "fit" and not self.init_from:
            raise ValueError(
                "mid-training continues a pretrained model: set model.init_from to a pretraining checkpoint"
            )
        super().setup(stage)
