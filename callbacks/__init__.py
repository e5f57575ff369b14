"""Training callbacks, one concern per file; recipes switch them on through config."""

from uma_lightning.callbacks.throughput import ThroughputLogger

__all__ = ["ThroughputLogger"]
