"""Training callbacks, one concern per file; recipes switch them on through config."""

from uma_lightning.callbacks.progress import ProgressLog
from uma_lightning.callbacks.rl_progress import RolloutProgressLog
from uma_lightning.callbacks.throughput import ThroughputLogger

__all__ = ["ProgressLog", "RolloutProgressLog", "ThroughputLogger"]
