"""Measure a compiled step in this process, on this machine's CPU."""

from __future__ import annotations

import numpy as np

from planner.backend.compile import CompiledStep
from planner.backend.session import TrainingSession
from planner.measurement import Measurement
from planner.measurement.latency import time_step


def measure_local(compiled: CompiledStep, weights: dict[str, np.ndarray], repeats: int) -> Measurement:
    session = TrainingSession(compiled.library, compiled.signature, weights)
    return Measurement(latency=time_step(session, repeats, device="local"), board="local")
