"""A default CPU schedule for every kernel of a training step.

TVM's default CPU pipeline schedules nothing: each stage of a fused kernel (a convolution's
padding, every elementwise op fused after it) is computed whole into its own buffer, served from
the workspace pool, one scalar loop nest after another on one core. On MobileNetV2 that scratch
alone rivals a sparse update's whole budget, and the step runs many times slower than it could.

`DefaultCPU` does what any hand schedule would do first: inline every stage that can be inlined
(producers into consumers, epilogues into their reduction), then run the remaining blocks'
spatial loops in parallel across cores and vectorise the innermost spatial loop. dlight's CPU
rules (GEMV, reductions) get the kernels they recognise first.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline

VECTOR_LANES = 8  # fp32 lanes of a 256-bit vector; LLVM splits or widens for the real ISA


def _extent(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV) -> int | None:
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _lanes(extent: int | None) -> int:
    """The widest power-of-two vector (<= VECTOR_LANES) that divides `extent`: no tail predicate."""
    lanes = VECTOR_LANES
    while extent and lanes > 1 and extent % lanes:
        lanes //= 2
    return lanes if extent else 1


def _schedule_block(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, kinds: str, vectorize: bool) -> None:
    """Spatial loops fused, outermost and parallel; with `vectorize`, its innermost `lanes`
    iterations become one vector, under any reduction loops."""
    loops = sch.get_loops(block)
    spatial = [loop for loop, k in zip(loops, kinds) if k == "S"]
    reduce = [loop for loop, k in zip(loops, kinds) if k == "R"]
    sch.reorder(*spatial, *reduce)
    fused = sch.fuse(*spatial)
    lanes = _lanes(_extent(sch, fused)) if vectorize else 1
    if lanes == 1:
        sch.parallel(fused)
        if reduce:
            sch.decompose_reduction(block, reduce[0])
        return
    outer, inner = sch.split(fused, factors=[None, lanes])
    sch.parallel(outer)
    if reduce:
        sch.reorder(outer, *reduce, inner)
        sch.decompose_reduction(block, reduce[0])
    sch.vectorize(inner)


class DefaultCPU(dlight.ScheduleRule):
    """Inline what can be inlined; parallel outer spatial loop; vectorised inner spatial loop.

    Each block is scheduled on a copy, most ambitious first (vectorised, then parallel only); a
    block no variant suits is left as TVM emitted it, so the rule never breaks a kernel.
    """

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        sch = s_tir.Schedule(func)
        blocks = normalize_prim_func(sch)
        if blocks is None:
            return None
        for info in try_inline(sch, blocks):
            kinds = info.dom_kind()
            if len(sch.get_loops(info.block_rv)) != len(kinds) or "S" not in kinds or set(kinds) - {"S", "R"}:
                continue  # opaque iteration or nothing to parallelise: leave it as it is
            for vectorize in (True, False):
                trial = sch.copy()
                try:
                    _schedule_block(trial, info.block_rv, kinds, vectorize)
                except s_tir.schedule.ScheduleError:
                    continue
                sch = trial
                break
        return sch


def default_schedule() -> tvm.transform.Pass:
    """Schedules every unscheduled kernel: dlight's CPU rules where they apply, else `DefaultCPU`."""
    return dlight.ApplyDefaultSchedule(DefaultCPU())
