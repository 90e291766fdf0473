"""A default CPU schedule for every kernel of a training step.

TVM's default CPU pipeline schedules nothing: each stage of a fused kernel (a convolution's
padding, every elementwise op fused after it) is computed whole into its own buffer, served from
the workspace pool, one scalar loop nest after another on one core. On MobileNetV2 that scratch
alone rivals a sparse update's whole budget, and the step runs many times slower than it could.

`DefaultCPU` does what any hand schedule would do first: inline every stage that can be inlined
(padding into the convolution, elementwise chains into one loop), compute a convolution or matmul
as register-blocked broadcast-FMAs over its output channels with its epilogue applied in
registers (`_lane_tiled`), else each reduction row by row inside its elementwise consumer (so its
output never exists whole; depthwise convolutions, pooling), rows in parallel across cores and a
row's outputs as one vector. It is the floor under every kernel; tuned schedules (MetaSchedule)
are what beats it.

It steers around two ways TVM turns a valid schedule into silently wrong code: inlining a consumer
into a reduction whose loops all have extent 1 (`_inline`) and vectorising a let binding
(`_vectorizes_a_let`). tests/test_schedule.py checks every kind of kernel a step has, scheduled,
against TVM's unscheduled lowering.

This module is the rule: which plans a block gets, in which order, and those guards. The plans
themselves are `schedule_plans`'; `default_schedule` runs the rule between `fast_math`'s erf and
exp rewrites.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func

from planner.backend.lower.fast_math import _vector_erf_tanh, _vector_exp
from planner.backend.lower.kernels import TAPS_STRIDES
from planner.backend.lower.schedule_plans import (
    Block,
    _broadcast_runs,
    _few_outputs,
    _lane_tiled,
    _loops,
    _reduction,
    _reduction_into_epilogue,
    _rows,
    _spatial,
    _taps_tiled,
    _vector_tail,
)

VECTOR_LANES = 8  # fp32 lanes of a 256-bit vector; LLVM splits or widens for the real ISA


def _vectorizes_a_let(func: tirx.PrimFunc) -> bool:
    """Whether a vectorised loop of `func` holds a let binding (`T.let`: a tuple reduction's, as
    MaxPool's backward argmax binds its index and value before storing them).

    TVM (0.27) miscompiles that whenever the bound value cannot be vectorised: VectorizeLoop then
    scalarises the binding on its own, into a serial loop over the lanes, and the stores that use
    it stay vectorised and store one lane's value (the last) to every lane. What cannot be
    vectorised is anything whose `if_then_else` condition varies across the lanes, such as a
    padded input inlined into the block; MaxPool's gradient came out silently wrong whenever its
    output row was vectorised and its window overhangs the input (padding, ceil mode). A store
    whose value must be scalarised without a let is scalarised whole and computes correctly, and
    a let that vectorises computes correctly too; but which values vectorise depends on what was
    inlined and on TVM's vectorizer, so no let is vectorised at all.
    """
    lets: list[tirx.Bind] = []

    def visit(loop: tirx.For) -> None:
        if loop.kind == tirx.ForKind.VECTORIZED:
            tvm_ffi.structural_walk(loop.body, [(tirx.Bind, lets.append)])

    tvm_ffi.structural_walk(func.body, [(tirx.For, visit)])
    return bool(lets)


def _attempt(sch: s_tir.Schedule, plans: list[Callable[[s_tir.Schedule], object]]) -> s_tir.Schedule:
    """The schedule after the first plan that succeeds on a copy (and vectorises no let binding,
    which TVM would miscompile: `_vectorizes_a_let`); unchanged if none does."""
    for plan in plans:
        trial = sch.copy()
        try:
            plan(trial)
        except RuntimeError:  # ScheduleError, or an InternalError from TVM's loop analysis
            continue
        if not _vectorizes_a_let(trial.mod["main"]):
            return trial
    return sch


class DefaultCPU(dlight.ScheduleRule):
    """Inline what can be inlined; reductions lane-tiled, else row by row (inside their epilogue
    when they have one), rows in parallel, outputs of a row as vectors; elementwise blocks flat,
    in parallel, or by whole runs when an operand is broadcast over them (`_broadcast_runs`).

    Every plan runs on a copy of the schedule, the most ambitious first; a block no plan suits is
    left as TVM emitted it, so the rule never breaks a kernel.

    Scheduling is deterministic, and candidates of one model share most kernels: results are
    remembered by the kernel's structural hash, so a study schedules each distinct kernel once.
    """

    MEMO_SIZE = 4096

    def __init__(self) -> None:
        self._memo: dict[tuple[int, str], tirx.PrimFunc | None] = {}

    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or target.kind.name != "llvm":
            return None
        key = (tvm_ffi.structural_hash(func), str(target))
        if key not in self._memo:
            if len(self._memo) >= self.MEMO_SIZE:
                self._memo.pop(next(iter(self._memo)))
            sch = self._schedule(func)
            self._memo[key] = None if sch is None else sch.mod["main"]
        done = self._memo[key]
        return None if done is None else s_tir.Schedule(done)

    def _schedule(self, func: tirx.PrimFunc) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        blocks = normalize_prim_func(sch)
        if blocks is None:
            return None
        cap = 1 if _stores_bf16(func) else VECTOR_LANES  # TVM's bf16 storage lowering is scalar-only
        remaining = _inline(sch, blocks)
        kinds = {sch.get(b.block_rv).name_hint: b.dom_kind() for b in remaining}
        done: set[str] = set()
        for name, k in kinds.items():
            if name in done or "S" not in k or set(k) - {"S", "R"}:
                continue  # scheduled with its reduction, opaque, or nothing to parallelise
            block = sch.get_sblock(name)
            if len(sch.get_loops(block)) != len(k):
                continue
            if "R" not in k:
                plans: list[Callable[[s_tir.Schedule], object]] = [
                    partial(_broadcast_runs, block=block, kinds=k, cap=cap),
                    *(partial(_spatial, block=block, kinds=k, cap=n) for n in (cap, 1)),
                ]
                consumers = sch.get_consumers(block)
                into = _init_into_consumer(sch, block, consumers, kinds)
                if into is not None:
                    plans = [lambda t, n=n: into(t, n) for n in (cap, 1)] + plans
                sch = _attempt(sch, plans)
                if into is not None and _fused_epilogue(sch, block, consumers):
                    done.add(sch.get(consumers[0]).name_hint)
                continue
            plans = []
            # TVM miscompiles a transposed convolution by taps (its indices divide the output
            # position) vectorised along a row, and even parallel over fused rows: it takes the
            # taps plan, where the phase split keeps those divisions exact, or stays unscheduled
            taps = TAPS_STRIDES in sch.get(block).annotations
            tiled = _taps_tiled if taps else _lane_tiled
            consumers = sch.get_consumers(block)
            if len(consumers) == 1:
                epi = consumers[0]
                epi_name = sch.get(epi).name_hint
                ek = kinds.get(epi_name, "R")
                if set(ek) == {"S"} and len(sch.get_loops(epi)) == len(ek):
                    plans.append(lambda t: tiled(t, block, k, epi, cap))
                    if not taps:  # ... scalar when its vector would hold a let (`_vectorizes_a_let`)
                        plans += [
                            partial(_reduction_into_epilogue, block=block, kinds=k, epilogue=epi, epilogue_kinds=ek, cap=n)
                            for n in (cap, 1)
                        ]
            plans.append(lambda t: tiled(t, block, k, None, cap))
            if not taps:
                plans.insert(0, partial(_few_outputs, block=block, kinds=k, cap=cap))
                plans += [lambda t, n=n: _reduction(t, block, k, n) for n in (cap, 1)] + [lambda t: _rows(t, block, k)]
            sch = _attempt(sch, plans)
            if len(consumers) == 1 and (not _exists(sch, epi_name) or _fused_epilogue(sch, block, consumers)):
                done.add(epi_name)
        return sch


def _inline(sch: s_tir.Schedule, blocks: list[SBlockInfo]) -> list[SBlockInfo]:
    """Inline every block that can be (into its consumers, else its consumer into it), as dlight's
    `try_inline` does, except that nothing is inlined into a block that has an init (a reduction).
    Returns the blocks left.

    Why: `normalize_prim_func` drops a reduction's unit-extent loops, so a reduction whose loops
    all have extent 1 (a 2x2 stride-2 pooling gradient's window, a 1x1 depthwise convolution's
    taps, a weight gradient summed over a batch of one) comes out as an all-spatial block that
    still has its init. `reverse_compute_inline` takes it for a complete block and applies the
    consumer e to both the init and the update, which reads the init's result back: the block
    computes e(e(0) + x), not e(x). At batch size 1 the classifier's SGD update (e(g) = w - lr g)
    came out wrong, and MaxPool 2x2's gradient whenever more than the ReLU mask was fused after it
    (e(e(0) + x) = e(x) by luck for a mask alone). Inlining a block that has an init, into its
    consumers or its producer, TVM refuses itself.
    """

    def into_producer(block: Block) -> None:
        if any(sch.get(producer).init is not None for producer in sch.get_producers(block)):
            raise RuntimeError("its producer is a reduction")
        sch.reverse_compute_inline(block)

    def first(inline: Callable[[Block], None]) -> int | None:
        for i, info in enumerate(remaining):
            try:
                inline(info.block_rv)
            except RuntimeError:  # ScheduleError: it cannot be inlined
                continue
            return i
        return None

    remaining = list(blocks)
    while (i := first(sch.compute_inline)) is not None or (i := first(into_producer)) is not None:
        remaining.pop(i)
    return remaining


def _init_into_consumer(
    sch: s_tir.Schedule, block: Block, consumers: list[Block], kinds: dict[str, str]
) -> Callable[[s_tir.Schedule, int], None] | None:
    """For a reduction whose reduction loops all have extent 1 (it looks spatial but keeps its
    init, see `_inline`), a plan computing it row by row inside its one elementwise consumer,
    as `_reduction_into_epilogue` does for any reduction: its output is one row of scratch, not
    a whole tensor (a 2x2 max-pool's gradient, scattered back over the input grid, fused with the
    ReLU mask before it). None when it has no init or no such consumer."""
    if sch.get(block).init is None or len(consumers) != 1:
        return None
    consumer = consumers[0]
    ck = kinds.get(sch.get(consumer).name_hint, "R")
    if set(ck) != {"S"} or len(sch.get_loops(consumer)) != len(ck):
        return None

    def plan(t: s_tir.Schedule, cap: int) -> None:
        spatial, _ = _loops(t, consumer, ck)
        outer = _rows(t, consumer, ck)
        _vector_tail(t, spatial[-1], cap)
        t.compute_at(block, outer, preserve_unit_loops=True)

    return plan


def _exists(sch: s_tir.Schedule, name: str) -> bool:
    try:
        sch.get_sblock(name)
    except Exception:  # inlined into its producer's register write-back
        return False
    return True


def _stores_bf16(func: tirx.PrimFunc) -> bool:
    found = False

    def visit(store: tirx.BufferStore) -> None:
        nonlocal found
        found = found or str(store.buffer.dtype) == "bfloat16"

    tvm_ffi.structural_walk(func.body, [(tirx.BufferStore, visit)], order="post")
    return found


def _fused_epilogue(sch: s_tir.Schedule, block: Block, consumers: list[Block]) -> bool:
    """Whether `block` now runs inside its consumer's loops (so the consumer is scheduled too)."""
    if len(consumers) != 1:
        return False
    outer = sch.get_loops(block)
    inner = sch.get_loops(consumers[0])
    return bool(outer) and bool(inner) and sch.get(outer[0]).same_as(sch.get(inner[0]))


_RULE = DefaultCPU()  # one per process, so its memo serves every compile


def default_schedule() -> tvm.transform.Pass:
    """Schedules every kernel not scheduled yet with `DefaultCPU`, its `erf`s made vectorisable
    first and the `exp`s it vectorises after (`_vector_erf_tanh`, `_vector_exp`)."""
    erf = tirx.transform.prim_func_pass(_vector_erf_tanh, opt_level=0, name="planner.VectorErfTanh")
    exp = tirx.transform.prim_func_pass(_vector_exp, opt_level=0, name="planner.VectorExp")
    return tvm.transform.Sequential([erf, dlight.ApplyDefaultSchedule(_RULE), exp])
