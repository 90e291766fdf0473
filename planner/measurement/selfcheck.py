"""A plan checked by its own execution: the step time and memory `planner run` measures while it
trains, beside the figures the plan was chosen on.

Why: a plan's numbers were measured once, during the search — on another host perhaps, under
another load, with a build since re-targeted. A run is the plan meeting its real workload, and
the first place a wrong figure can show: a step slower than planned misses its latency budget,
more memory than planned may not fit the board. Both are reported beside the plan's, and a
figure more than `TOLERANCE` off is a one-line warning.

- Step time: each training step's call of the compiled step, timed around the VM's
  `invoke_stateful` (the inputs already set, as the plan's `time_evaluator` times it) — on a
  board over RPC by the board itself (`board.TIMED_INVOKE`), without the round trip; the median
  and the 10th-90th percentiles over the run's steps.
- Memory: what the C heap (glibc's `mallinfo2`) gained over one call of the step on a probe
  batch, its inputs already set, run before anything else in the session — the VM's pooled
  allocator and the kernels' workspace pool never return memory, so their high-water mark is
  what they hold after it — plus the step's resident tensors (weights, optimizer state, the
  batch) counted from their shapes. The library's own heap (its code and constants) is not part
  of a plan's peak: the probe starts after the step is loaded. (`tests/test_memory.py` holds
  the plan's figure to this method.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import tvm

from planner.measurement._base import Session
from planner.measurement.board import heap_in_use
from planner.runtime.convention import STEP_FUNC
from planner.runtime.session import TrainingSession, example_batch
from planner.types import RunCheck

T = TypeVar("T")

TOLERANCE = 0.20  # a measured figure this far off the plan's (either way) is a warning, and
# farther than the run's measurements can tell apart: a call into the VM costs ~0.02 ms of
# Python, and one step's heap moves by up to ~0.15 MB with the allocator's state (measured on
# tests' steps of 60 KB)
RESOLUTION_MS, RESOLUTION_BYTES = 0.05, 256 * 1024


MEMORY_HOW = (
    "memory: the C heap one step gained on a probe batch before training (glibc mallinfo2; TVM's "
    "pools keep their high-water mark) plus the step's resident tensors from their shapes"
)


def step_heap(session: TrainingSession, weights: dict[str, np.ndarray]) -> int | None:
    """The C heap one training step gains in a session that has run nothing yet: its
    activations, gradients and kernels' workspace, held by TVM's pools from then on. The step
    runs on a probe batch before anything else (an evaluation would leave pooled blocks and
    workspace the step then reuses), and the session starts over from `weights` after it."""
    heap = session.heap or heap_in_use  # (a board's, over RPC)
    if session.heap is None:  # blocks an earlier step of this process left in TVM's pool would be reused
        tvm.get_global_func("vm.builtin.memory_manager.clear")()
    session.vm.set_input(STEP_FUNC, *session.step_args(*example_batch(session.sig, np.random.default_rng(0))))
    held = heap()
    session.vm.invoke_stateful(STEP_FUNC)  # (as tests/test_memory.py measures it)
    now = heap()
    session.set_weights(weights)  # (an in-place update wrote over the weights it was given)
    return now - held if now is not None and held is not None else None


@dataclass(frozen=True)
class Usage:
    """What a session measured of the run `checked` wrapped: each step's seconds, the heap one
    step gained (None where it cannot be read) and the step's resident tensors' bytes."""

    step_seconds: list[float]
    heap_gained: int | None
    resident_bytes: int


def checked(work: Callable[[Session], T], weights: dict[str, np.ndarray]) -> Callable[[Session], tuple[T, Usage | None]]:
    """`work` for `Runner.train`, and what its session measured of the run (`Usage`): None for a
    step TVM's VM does not run (a microcontroller's, counted on its emulator: no check yet)."""

    def run(session: Session) -> tuple[T, Usage | None]:
        if not isinstance(session, TrainingSession):
            return work(session), None
        heap = step_heap(session, weights)
        done = work(session)
        return done, Usage(session.step_seconds, heap, session.resident_bytes())

    return run


def check(
    *,
    step_seconds: list[float],
    heap_gained: int | None,
    resident_bytes: int,
    planned_step_ms: float,
    planned_memory_bytes: int,
    device: str,
) -> RunCheck:
    """The run's figures beside the plan's, with a warning for each more than `TOLERANCE` off."""
    times = np.asarray(step_seconds, dtype=float) * 1e3
    step_ms = float(np.median(times)) if len(times) else None
    memory = heap_gained + resident_bytes if heap_gained is not None else None
    warnings = []
    if step_ms is not None and _off(step_ms, planned_step_ms, RESOLUTION_MS):
        warnings.append(
            f"the step took {step_ms:.3f} ms (median of {len(times)}), {_pct(step_ms, planned_step_ms)} the plan's "
            f"{planned_step_ms:.3f} ms: another load on {device}, or not the board it was measured on?"
        )
    if memory is not None and _off(memory, planned_memory_bytes, RESOLUTION_BYTES):
        warnings.append(
            f"the step held {memory / 1024:,.1f} KiB, {_pct(memory, planned_memory_bytes)} the plan's "
            f"{planned_memory_bytes / 1024:,.1f} KiB"
        )
    how = (
        f"step time: the compiled step's call timed on {device}, median and p10-p90 over the run's steps; "
        + (MEMORY_HOW if memory is not None else "memory: not measured here (no glibc mallinfo2)")
        + f"; a warning when either is over {TOLERANCE:.0%} off the plan's and by more than "
        f"{RESOLUTION_MS} ms or {RESOLUTION_BYTES // 1024} KiB (what a run can tell apart)"
    )
    return RunCheck(
        step_ms=step_ms,
        step_ms_p10=float(np.percentile(times, 10)) if len(times) else None,
        step_ms_p90=float(np.percentile(times, 90)) if len(times) else None,
        steps_timed=len(times),
        planned_step_ms=planned_step_ms,
        memory_bytes=memory,
        planned_memory_bytes=planned_memory_bytes,
        how=how,
        warnings=tuple(warnings),
    )


def _off(measured: float, planned: float, resolution: float) -> bool:
    return planned > 0 and abs(measured - planned) > max(TOLERANCE * planned, resolution)


def _pct(measured: float, planned: float) -> str:
    change = (measured - planned) / planned * 100
    return f"{abs(change):.0f} % {'above' if change > 0 else 'below'}"
