"""Training callbacks, one concern per file; recipes switch them on through config."""

from uma_lightning.callbacks.closed_loop import ClosedLoopEval
from uma_lightning.callbacks.predictions import PredictionWriter
from uma_lightning.callbacks.progress import ProgressLog
from uma_lightning.callbacks.throughput import ThroughputLogger

__all__ = ["ClosedLoopEval", "PredictionWriter", "ProgressLog", "ThroughputLogger"]
