"""Training callbacks, one concern per file; recipes switch them on through config."""

from uma_lightning.callbacks.checkpointing import ShardedCheckpoint
from uma_lightning.callbacks.preemption import Preemption
from uma_lightning.callbacks.progress import ProgressLog
from uma_lightning.callbacks.throughput import ThroughputLogger

__all__ = ["Preemption", "ProgressLog", "ShardedCheckpoint", "ThroughputLogger"]
