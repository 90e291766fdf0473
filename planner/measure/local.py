"""Step latency on this machine, with the VM's own time evaluator."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..graph import STEP_FUNC
from ..session import TrainingSession


@dataclass(frozen=True)
class Latency:
    """Per-step latency over `repeats` timed repeats of `number` back-to-back steps each."""

    median: float  # ms
    p90: float  # ms
    min: float  # ms
    max: float  # ms
    repeats: int
    number: int
    device: str

    def to_json(self) -> dict:
        return asdict(self)


def time_step(session: TrainingSession, repeats: int = 10, repeat_ms: float = 20.0, device: str = "local") -> Latency:
    """Time the whole training step (forward, backward, update) on a representative batch.

    Inputs are set once and the VM is invoked statefully, so the timing holds the compiled step
    alone — no Python, no host-device copies. One warm-up call runs first.
    """
    sig = session.sig
    x = np.random.default_rng(0).standard_normal(sig.input_shape).astype("float32")
    y = np.arange(sig.batch_size) % sig.n_classes
    args = session.step_args(x, y)
    vm = session.vm
    vm.set_input(STEP_FUNC, *args)
    t0 = time.perf_counter()
    vm.invoke_stateful(STEP_FUNC)
    warm_ms = (time.perf_counter() - t0) * 1e3
    number = max(1, math.ceil(repeat_ms / max(warm_ms, 1e-3)))
    timer = vm.time_evaluator("invoke_stateful", session.device, number=number, repeat=repeats)
    per_step = np.asarray(timer(STEP_FUNC).results) * 1e3
    return Latency(
        median=float(np.median(per_step)),
        p90=float(np.percentile(per_step, 90)),
        min=float(per_step.min()),
        max=float(per_step.max()),
        repeats=repeats,
        number=number,
        device=device,
    )
