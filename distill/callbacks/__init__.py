"""Lightning callbacks: the step token pre-count, throughput, export of the student, the
head and precision checks, the divergence and signal guards, and what the logs show
(learning rate, gradient norm, samples, the graphs torch.compile builds)."""

from distill.callbacks.compile_watch import CompileWatch
from distill.callbacks.export import ExportStudent
from distill.callbacks.guard import DivergenceGuard, StopOnSignal
from distill.callbacks.head_check import HeadCheck
from distill.callbacks.logs import FinalMetrics, QuietRun, RolloutSamples, StepLogs
from distill.callbacks.precision_check import PrecisionCheck
from distill.callbacks.step_tokens import StepTokenCounter
from distill.callbacks.throughput import TokenThroughput

__all__ = ["CompileWatch", "DivergenceGuard", "ExportStudent", "FinalMetrics", "HeadCheck",
           "PrecisionCheck", "QuietRun", "RolloutSamples", "StepLogs", "StepTokenCounter",
           "StopOnSignal", "TokenThroughput"]
