"""Training callbacks, one concern per file; recipes switch them on through config."""

from uma_lightning.callbacks.anomalies import GradientAnomalies, TrainingHalted
from uma_lightning.callbacks.bad_data import BadDataCounter
from uma_lightning.callbacks.checkpointing import ShardedCheckpoint
from uma_lightning.callbacks.closed_loop import ClosedLoopEval
from uma_lightning.callbacks.expert_load import ExpertLoad
from uma_lightning.callbacks.memory import MemoryMonitor
from uma_lightning.callbacks.predictions import PredictionWriter
from uma_lightning.callbacks.preemption import Preemption
from uma_lightning.callbacks.profiler import ProfilerTraces
from uma_lightning.callbacks.progress import ProgressLog
from uma_lightning.callbacks.replica_checksum import ReplicaChecksum
from uma_lightning.callbacks.rl_progress import RolloutProgressLog
from uma_lightning.callbacks.step_time import StepTimeBreakdown
from uma_lightning.callbacks.throughput import ThroughputLogger
from uma_lightning.callbacks.watchdog import HangWatchdog

__all__ = [
    "BadDataCounter",
    "ClosedLoopEval",
    "ExpertLoad",
    "GradientAnomalies",
    "HangWatchdog",
    "MemoryMonitor",
    "PredictionWriter",
    "Preemption",
    "ProfilerTraces",
    "ProgressLog",
    "ReplicaChecksum",
    "RolloutProgressLog",
    "ShardedCheckpoint",
    "StepTimeBreakdown",
    "ThroughputLogger",
    "TrainingHalted",
]
