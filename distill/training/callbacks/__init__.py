"""Lightning callbacks around the step: the step token pre-count, throughput, the head and
precision checks, the divergence and signal guards, and what the logs show (learning rate,
gradient norm, samples, the graphs torch.compile builds)."""

from distill.training.callbacks.compile_watch import CompileWatch
from distill.training.callbacks.guard import DivergenceGuard, StopOnSignal
from distill.training.callbacks.head_check import HeadCheck
from distill.training.callbacks.logs import FinalMetrics, QuietRun, RolloutSamples, StepLogs
from distill.training.callbacks.precision_check import PrecisionCheck
from distill.training.callbacks.step_tokens import StepTokenCounter
from distill.training.callbacks.throughput import TokenThroughput

__all__ = ["CompileWatch", "DivergenceGuard", "FinalMetrics", "HeadCheck",
           "PrecisionCheck", "QuietRun", "RolloutSamples", "StepLogs", "StepTokenCounter",
           "StopOnSignal", "TokenThroughput"]
