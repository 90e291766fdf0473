"""Where a training step's time goes: each kernel's time per step and its GFLOP/s.

The step's latency says how slow it is; the profile says which kernel to fix next. TVM 0.27's
Relax VM has no profiler, but it calls an instrument before and after every call it makes: the
time between the two is the kernel's (the instrument's own Python runs outside that interval).
The VM's calls that are not kernels (allocations, tuple and shape bookkeeping) are summed as
`(runtime)`. Measured on this machine, in-process: a board over RPC cannot call back into Python.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import numpy as np

from planner.backend import BuiltArtifact
from planner.backend.vm import CompiledStep
from planner.errors import BadInput
from planner.runtime.session import TrainingSession, example_batch
from planner.types import KernelTime, StepProfile

RUNTIME = "(runtime)"


def profile_step(compiled: BuiltArtifact, weights: dict[str, np.ndarray], *, steps: int = 5, seed: int = 0) -> StepProfile:
    """Times every call of `steps` training steps of `compiled` (after as many warm-up steps:
    the first steps fault pages in and fill OpenBLAS's and TVM's pools, at twice the time), on
    random inputs of the step's shape: kernel times do not depend on the values. Only a VM
    library has the table of kernels this names the calls by: another step is `BadInput`."""
    if not isinstance(compiled, CompiledStep):
        raise BadInput(f"`profile` times the kernels of a VM library, not of a {compiled.kind} step")
    session = TrainingSession(compiled.library, compiled.signature, weights)
    sig = compiled.signature
    rng = np.random.default_rng(seed)
    x, y = example_batch(sig, rng)
    for _ in range(steps):
        session.step(x, y)
    seconds: defaultdict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    started = [0.0]

    def instrument(func, symbol, before, ret, *args) -> int:
        if before:
            started[0] = time.perf_counter()
        else:
            seconds[symbol] += time.perf_counter() - started[0]
            calls[symbol] += 1
        return 0  # VMInstrumentReturnKind.NO_OP: run the call as usual

    session.vm.set_instrument(instrument)
    t0 = time.perf_counter()
    for _ in range(steps):
        session.step(x, y)
    step_seconds = (time.perf_counter() - t0) / steps
    table = {k.symbol: k for k in compiled.kernel_table}
    kernels, runtime, runtime_calls = [], 0.0, 0
    for symbol, total in seconds.items():
        kernel = table.get(symbol)
        if kernel is None:
            runtime += total
            runtime_calls += calls[symbol]
            continue
        n = calls[symbol] // steps
        kernels.append(KernelTime(kernel.name, symbol, n, total / steps, kernel.flops * n))
    kernels.append(KernelTime(RUNTIME, "", runtime_calls // steps, runtime / steps, 0))
    kernels.sort(key=lambda k: -k.seconds)
    return StepProfile(tuple(kernels), step_seconds, steps)
