"""Lightning callbacks: the step token pre-count, throughput, export of the student, the
head check."""

from distill.callbacks.export import ExportStudent
from distill.callbacks.head_check import HeadCheck
from distill.callbacks.step_tokens import StepTokenCounter
from distill.callbacks.throughput import TokenThroughput

__all__ = ["ExportStudent", "HeadCheck", "StepTokenCounter", "TokenThroughput"]
