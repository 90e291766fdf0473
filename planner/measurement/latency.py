"""Step latency with the VM's own time evaluator — the same code for a local and a remote VM."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from planner.runtime.convention import STEP_FUNC
from planner.runtime.session import TrainingSession, example_batch
from planner.types import Latency

# Below this (milliseconds a step on every thread), a step is tried on one thread as well and
# runs on the faster: see `time_step`.
SHORT_STEP_MS = 5.0


def time_step(
    session: TrainingSession, repeats: int, device: str, repeat_ms: float = 20.0, set_threads: Callable[[int], None] | None = None
) -> Latency:
    """Time the whole training step (forward, backward, update) on a representative batch.

    Inputs are set once and the VM is invoked statefully, so the timing holds the compiled step
    alone — no Python, no host-device copies, no RPC round trips (the evaluator runs on the
    device). One timed warm-up step sets how many steps each repeat averages (~`repeat_ms`).

    `set_threads(n)` sets how many of the pool's threads the step runs on (0: all). Where it is
    given, a short step is tried on one thread too, timed in full if its first repeat is faster,
    and the faster is kept (`Latency.threads`, which `planner run` then uses): a step of a few
    kernels at batch 1 spends more on waking and joining the pool's threads than it saves by
    splitting its loops. On a 2-vCPU VM a ViT head's step took 0.022 ms on one thread and 0.038
    or 0.07 ms on two, whichever mode the pool happened to be in: 2-4x slower and bimodal
    (docs/benchmarks.md, the one-block ViT under "Search quality").
    """
    sig = session.sig
    x, y = example_batch(sig, np.random.default_rng(0))
    vm = session.vm
    vm.set_input(STEP_FUNC, *session.step_args(x, y))

    def timed(threads: int, repeats: int) -> Latency:
        if set_threads is not None:
            set_threads(threads)
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
            threads=threads,
        )

    latency = timed(0, repeats)
    if set_threads is not None and latency.median < SHORT_STEP_MS:
        # one repeat first: where one thread is plainly slower (most steps over a millisecond),
        # that is all the comparison costs
        if timed(1, 1).median < latency.median:
            latency = min(latency, timed(1, repeats), key=lambda t: t.median)
        set_threads(0)
    return latency


def method(where: str, latency: Latency) -> str:
    """How `time_step` timed `latency`, `where` it ran, in the words plan.json records."""
    return (
        f"TVM VM time_evaluator {where}, whole step (forward+backward+update); median and "
        f"p90 over {latency.repeats} repeats, each the mean of {latency.number} back-to-back steps{_on(latency)}; "
        f"spread {latency.min:.3f}-{latency.max:.3f} ms"
    )


def _on(latency: Latency) -> str:
    return f", on {latency.threads} of the pool's threads (faster than all of them)" if latency.threads else ""
