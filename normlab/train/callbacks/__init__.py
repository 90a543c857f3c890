"""Callbacks: everything the training loop does beside training, each a class with named hooks.

base.py holds Callback, its hooks in the order of a step, and Diverged; each other module holds one
callback (progress.py the progress bar and its log-line stand-in). A new monitor is one class passed to
train(); the loop does not change.
"""

from normlab.train.callbacks.base import Callback, Diverged
from normlab.train.callbacks.batchnorm_steps import BatchNormSteps
from normlab.train.callbacks.checkpointing import PREEMPT_CHECK_EVERY, Checkpointing
from normlab.train.callbacks.divergence import DivergenceGuard
from normlab.train.callbacks.products import TelemetryProducts
from normlab.train.callbacks.progress import ProgressBar, ProgressLog, progress
from normlab.train.callbacks.report import RunReport
from normlab.train.callbacks.rundir_watch import RunDirWatch
from normlab.train.callbacks.telemetry import Telemetry
from normlab.train.callbacks.throughput import ThroughputClock

__all__ = [
    "PREEMPT_CHECK_EVERY",
    "BatchNormSteps", "Callback", "Checkpointing", "DivergenceGuard", "Diverged", "ProgressBar", "ProgressLog",
    "RunDirWatch", "RunReport", "Telemetry", "TelemetryProducts", "ThroughputClock",
    "progress",
]
