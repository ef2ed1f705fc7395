"""Measuring a stage: memory counters kept apart, seconds, on any device."""
from .meter import StageMeter, is_oom, synchronize
from .tensors import LiveTensorTracker

__all__ = ["LiveTensorTracker", "StageMeter", "is_oom", "synchronize"]
