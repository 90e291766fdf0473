"""`planner run`'s check of a plan by its own execution: when a figure is a warning."""

from __future__ import annotations

import pytest

from planner.measurement.selfcheck import RESOLUTION_BYTES, check, heap_in_use

PLANNED = {"planned_step_ms": 2.0, "planned_memory_bytes": 4 << 20, "device": "local"}


@pytest.mark.parametrize(
    "seconds, gained, words",
    [
        ([0.0021] * 9, (4 << 20) - 1000, []),  # 5 % off: as planned
        ([0.0030] * 9, 4 << 20, ["step took 3.000 ms (median of 9), 50 % above the plan's 2.000 ms"]),
        ([0.0010] * 9, 4 << 20, ["50 % below the plan's 2.000 ms"]),
        ([0.002] * 9, 6 << 20, ["the step held 6,144.0 KiB, 50 % above the plan's 4,096.0 KiB"]),
        ([0.002] * 9, None, []),  # no heap to read: not measured, no warning
    ],
)
def test_a_figure_more_than_a_fifth_off_the_plans_is_a_warning(seconds, gained, words):
    c = check(step_seconds=seconds, heap_gained=gained, resident_bytes=0, **PLANNED)
    assert len(c.warnings) == len(words) and all(w in line for w, line in zip(words, c.warnings)), c.warnings
    assert (c.memory_bytes is None) == (gained is None) and ("not measured" in c.how) == (gained is None)


def test_differences_below_what_a_run_can_measure_are_no_warning():
    """A tiny step: 0.03 ms off a 0.03 ms plan is a call's overhead, 100 KB a heap's noise."""
    small = check(
        step_seconds=[0.00006] * 5,
        heap_gained=100_000,
        resident_bytes=0,
        planned_step_ms=0.03,
        planned_memory_bytes=20_000,
        device="local",
    )
    assert small.warnings == ()
    big = check(
        step_seconds=[0.00007] * 5,
        heap_gained=RESOLUTION_BYTES + 30_000,
        resident_bytes=0,
        planned_step_ms=0.01,
        planned_memory_bytes=20_000,
        device="local",
    )
    assert len(big.warnings) == 2


def test_the_heap_is_read_here():
    held = heap_in_use()
    block = bytearray(8 << 20)  # an mmapped chunk
    assert held is not None and heap_in_use() >= held + (8 << 20)
    del block
