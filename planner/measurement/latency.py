"""Step latency with the VM's own time evaluator — the same code for a local and a remote VM."""

from __future__ import annotations

import math

import numpy as np

from planner.backend.graph import STEP_FUNC
from planner.backend.session import TrainingSession, example_batch
from planner.types import Latency


def time_step(session: TrainingSession, repeats: int, device: str, repeat_ms: float = 20.0) -> Latency:
    """Time the whole training step (forward, backward, update) on a representative batch.

    Inputs are set once and the VM is invoked statefully, so the timing holds the compiled step
    alone — no Python, no host-device copies, no RPC round trips (the evaluator runs on the
    device). One timed warm-up step sets how many steps each repeat averages (~`repeat_ms`).
    """
    sig = session.sig
    x, y = example_batch(sig, np.random.default_rng(0))
    vm = session.vm
    vm.set_input(STEP_FUNC, *session.step_args(x, y))
    warm = vm.time_evaluator("invoke_stateful", session.device, number=1, repeat=1)(STEP_FUNC)
    number = max(1, math.ceil(repeat_ms / max(warm.mean * 1e3, 1e-3)))
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


def method(where: str, latency: Latency) -> str:
    """How `time_step` timed `latency`, `where` it ran, in the words plan.json records."""
    return (
        f"TVM VM time_evaluator {where}, whole step (forward+backward+update); median and "
        f"p90 over {latency.repeats} repeats, each the mean of {latency.number} back-to-back steps; spread "
        f"{latency.min:.3f}-{latency.max:.3f} ms"
    )
