"""Measure a compiled step on its device: this machine, or a board behind a TVM RPC tracker.

Only this package knows local from RPC; callers get a `Measurement` either way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from planner.types import Latency

if TYPE_CHECKING:  # not imported at run time: the board side (`board.py`) imports this package on
    from planner.backend.compile import CompiledStep  # a board that has only TVM's runtime


@dataclass(frozen=True)
class Measurement:
    latency: Latency
    board: str  # "local" or the RPC server's address
    board_memory: dict | None = None  # {peak_rss_growth_bytes, method}, where the board reports it

    def to_json(self) -> dict:
        return asdict(self)


def measure_step(compiled: CompiledStep, weights: dict[str, np.ndarray], target, repeats: int) -> Measurement:
    """Time `compiled` on `target`'s device (a HardwareTarget): in-process, or on a tracker's board."""
    if target.runner == "rpc":
        from planner.measurement.rpc import BoardPool

        return BoardPool.for_target(target).measure(compiled, weights, repeats)
    from planner.measurement.local import measure_local

    return measure_local(compiled, weights, repeats)


def capacity(target) -> int:
    """How many candidates can be measured at once: one per board of an RPC key, else one.

    Also fails fast (BoardUnreachable, exit 3) when the tracker is down or has no such board.
    """
    if target.runner != "rpc":
        return 1
    from planner.measurement.rpc import BoardPool

    return max(1, BoardPool.for_target(target).check().total)
