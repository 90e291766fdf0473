"""Measure a compiled step in this process, on this machine's CPU."""

from __future__ import annotations

import numpy as np

from ..compile import CompiledStep
from ..session import TrainingSession
from . import Measurement
from .latency import time_step


def measure_local(compiled: CompiledStep, weights: dict[str, np.ndarray], repeats: int) -> Measurement:
    session = TrainingSession(compiled.library, compiled.signature, weights)
    return Measurement(latency=time_step(session, repeats, device="local"), board="local")
