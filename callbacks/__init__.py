"""Training callbacks, one concern per file; recipes switch them on through config."""

from uma_lightning.callbacks.data_wait import DataWaitLogger
from uma_lightning.callbacks.progress import ProgressLog
from uma_lightning.callbacks.throughput import ThroughputLogger

__all__ = ["DataWaitLogger", "ProgressLog", "ThroughputLogger"]
