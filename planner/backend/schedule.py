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
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from functools import partial
from typing import TypeAlias

import tvm
import tvm_ffi
from tvm import s_tir, te, tirx, topi
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import SBlockInfo, normalize_prim_func

from planner.backend.kernels import TAPS_STRIDES

VECTOR_LANES = 8  # fp32 lanes of a 256-bit vector; LLVM splits or widens for the real ISA


def _extent(sch: s_tir.Schedule, loop: Loop) -> int | None:
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _lanes(extent: int | None, cap: int) -> int:
    """The widest power-of-two vector (<= cap) that divides `extent`: no tail predicate."""
    lanes = cap
    while extent and lanes > 1 and extent % lanes:
        lanes //= 2
    return lanes if extent else 1


Loop: TypeAlias = s_tir.schedule.LoopRV
Block: TypeAlias = s_tir.schedule.SBlockRV


def _loops(sch: s_tir.Schedule, block: Block, kinds: str) -> tuple[list[Loop], list[Loop]]:
    """The block's (spatial, reduction) loops, given its iteration kinds ("S"/"R" per loop)."""
    loops = sch.get_loops(block)[-len(kinds) :]
    return [lp for lp, k in zip(loops, kinds) if k == "S"], [lp for lp, k in zip(loops, kinds) if k == "R"]


def _vector_tail(sch: s_tir.Schedule, loop: Loop, cap: int, row: int | None = None) -> None:
    """Vectorise the innermost `lanes` iterations of `loop` (when its extent allows). `loop` may
    be several axes fused, the innermost `row` long (`_row_lanes`)."""
    lanes = _row_lanes(row, _lanes(_extent(sch, loop), cap))
    if lanes > 1:
        sch.vectorize(sch.split(loop, factors=[None, lanes])[1])


def _row_lanes(row: int | None, lanes: int) -> int:
    """Lanes for a vector over fused axes whose innermost is `row` long: `lanes`, or where those
    would straddle two rows, the widest power of two that divides the row (when it is 4 or more;
    else `lanes` after all).

    Why: TVM vectorises before it simplifies the flattened index, so a vector that straddles
    rows recovers each lane's position per axis by division and loads lane by lane: a ReLU
    gradient over 28x28 maps took 207-316 us with 8 lanes, on every x86 target; 4 lanes that
    stay within a row load whole vectors. (Left serial for LLVM instead, the index simplifies
    and LLVM vectorises it with AVX2 or AVX-512, 22-44 us, but not with SSE or NEON: 744 us.)"""
    if row is None or lanes == 1 or row % lanes == 0:  # no vector crosses a row's end
        return lanes
    within = row & -row  # its largest power-of-two factor
    return within if within >= 4 else lanes


def _spatial(sch: s_tir.Schedule, block: Block, kinds: str, cap: int) -> None:
    """An elementwise block: all outputs in one parallel loop, vectorised innermost (within a
    row, `_row_lanes`)."""
    spatial = _loops(sch, block, kinds)[0]
    row = _extent(sch, spatial[-1])
    fused = sch.fuse(*spatial)
    lanes = _row_lanes(row, _lanes(_extent(sch, fused), cap))
    if lanes == 1:
        sch.parallel(fused)
        return
    outer, inner = sch.split(fused, factors=[None, lanes])
    sch.parallel(outer)
    sch.vectorize(inner)


def _broadcast_runs(sch: s_tir.Schedule, block: Block, kinds: str, cap: int) -> None:
    """An elementwise block with a broadcast operand (a bias or BatchNorm scale per channel, a
    pooled gradient per image and channel): the leading axes in one parallel loop, the trailing
    axes no operand indexes only in part (every pixel of a channel) as one vectorised run.

    Why: `_spatial`'s one flat loop recovers each lane's channel by dividing its position, so the
    per-channel operand is a gather of eight divisions per vector (ResNet-8's and the tiny CNN's
    bias-and-ReLU kernels ran at 1.5 GFLOP/s, a third of a sparse step). Over whole runs the
    operand is one value, loaded once. Raises when the flat loop has no such operand."""
    spatial, _ = _loops(sch, block, kinds)
    sblock = sch.get(block)
    axes = [iv.var.name for iv in sblock.iter_vars]
    used = [set().union(*(_names(r.min) for r in access.region)) & set(axes) for access in (*sblock.reads, *sblock.writes)]

    def whole(tail: set[str]) -> bool:
        return all(not (u & tail) or tail <= u for u in used)

    if whole(set(axes)):
        raise RuntimeError("no broadcast operand")  # the flat loop divides nothing it loads
    split = next((p for p in range(1, len(axes)) if whole(set(axes[p:]))), None)
    if split is None:
        raise RuntimeError("no trailing run every operand reads whole")
    row = _extent(sch, spatial[-1])
    outer = sch.fuse(*spatial[:split]) if split > 1 else spatial[0]
    run = sch.fuse(*spatial[split:]) if len(spatial) - split > 1 else spatial[split]
    sch.parallel(outer)
    _vector_tail(sch, run, cap, row)


def _rows(sch: s_tir.Schedule, block: Block, kinds: str) -> Loop:
    """Rows of the output (every spatial axis but the last) in one parallel loop; returns it.
    Reduction loops go inside, after the row's last spatial loop."""
    spatial, reduce = _loops(sch, block, kinds)
    sch.reorder(*spatial, *reduce)
    outer = sch.fuse(*spatial[:-1]) if len(spatial) > 1 else sch.add_unit_loop(spatial[0])
    sch.parallel(outer)
    return outer


def _reduction_row(sch: s_tir.Schedule, block: Block, kinds: str, cap: int) -> None:
    """Within a row: the reduction loops outside, the row's outputs innermost as a vector, so
    every reduction step updates a vector of independent outputs."""
    loops = sch.get_loops(block)
    n_reduce = kinds.count("R")
    reduce, last = loops[-n_reduce:], loops[-n_reduce - 1]
    sch.reorder(*reduce, last)
    _vector_tail(sch, last, cap)  # before decomposing: vectorize needs the block's init still attached
    sch.decompose_reduction(block, reduce[0])


def _reduction(sch: s_tir.Schedule, block: Block, kinds: str, cap: int) -> None:
    _rows(sch, block, kinds)
    _reduction_row(sch, block, kinds, cap)


def _reduction_into_epilogue(
    sch: s_tir.Schedule, block: Block, kinds: str, epilogue: Block, epilogue_kinds: str, cap: int
) -> None:
    """The reduction computed row by row inside its elementwise consumer's parallel loop: its
    output shrinks from a whole tensor of scratch to one row on the stack."""
    spatial, _ = _loops(sch, epilogue, epilogue_kinds)
    outer = _rows(sch, epilogue, epilogue_kinds)
    _vector_tail(sch, spatial[-1], cap)
    sch.compute_at(block, outer, preserve_unit_loops=True)
    _reduction_row(sch, block, kinds, cap)


FEW_OUTPUTS = 64  # a reduction this many times longer than its output: `_few_outputs`


def _few_outputs(sch: s_tir.Schedule, block: Block, kinds: str, cap: int) -> None:
    """A reduction to few outputs from many contiguous inputs (a BatchNorm's scale or bias
    gradient: per channel, the sum over the batch and every pixel) as vector partial sums: the
    contiguous innermost reduction run split into `cap` lanes, each lane its own accumulator
    (`rfactor`), summed across lanes at the end; outputs in parallel.

    Why: the row plans vectorise along the output, which here is the channel axis, a whole
    feature map apart in memory: one gathered vector per step, on one core (ResNet-8's
    BatchNorm gradients, batch 32: 0.5 GFLOP/s, the slowest kernel of the step)."""
    spatial, reduce = _loops(sch, block, kinds)
    sblock = sch.get(block)
    names = [iv.var.name for iv, k in zip(sblock.iter_vars, kinds) if k == "R"]
    outputs = math.prod(_extent(sch, lp) or 0 for lp in spatial)
    length = math.prod(_extent(sch, lp) or 0 for lp in reduce)
    if not outputs or length < FEW_OUTPUTS * outputs or not sblock.reads or not names:
        raise RuntimeError("not a long reduction to few outputs")
    largest = max(sblock.reads, key=_elements)
    if names[-1] not in _names(largest.region[-1].min):
        raise RuntimeError("not a long contiguous reduction to few outputs")
    sch.reorder(*spatial, *reduce)
    inner = sch.fuse(*reduce[-2:]) if len(reduce) >= 2 else reduce[-1]
    lanes = _lanes(_extent(sch, inner), cap)
    if lanes < 2:
        raise RuntimeError("no vector of lanes")
    _, lane = sch.split(inner, [None, lanes])
    partial_sums = sch.rfactor(lane, 0)
    outer = sch.fuse(*sch.get_loops(partial_sums)[: len(spatial)])
    sch.parallel(outer)
    sch.reverse_compute_at(block, outer)
    loops = sch.get_loops(partial_sums)
    sch.vectorize(loops[-1])
    sch.decompose_reduction(partial_sums, loops[1])


def _names(expr) -> set[str]:
    found: set[str] = set()
    tvm_ffi.structural_walk(expr, [(tvm.ir.Var, lambda v: found.add(v.name))], order="post")
    return found


def _elements(region: tirx.TensorRegion) -> int:
    shape = region.source.ty.shape
    return math.prod(int(d) for d in shape) if all(isinstance(d, tirx.IntImm) for d in shape) else 0


LANE_TILE = 8  # outputs along the last axis kept in registers at once, per lane vector


def _lane_tiled(sch: s_tir.Schedule, block: Block, kinds: str, epilogue: Block | None, cap: int) -> None:
    """A convolution or matmul as broadcast-FMAs: vector lanes over an output axis the largest
    input does not index (output channels: each input value is loaded once and multiplied into
    `cap` channels), a few outputs of the last axis unrolled beside it, all accumulating in
    registers; an operand that does vary with the lane axis (the weight) is first copied with
    that axis innermost, so its lanes load as one vector. The epilogue (bias, activation, the
    optimizer update) runs on the registers before they are stored.

    Why: NCHW convolutions vectorised along the image row (the row plans below) load strided,
    masked input vectors and keep their accumulators in memory; this is the register-blocked
    direct convolution of oneDNN-style kernels, written as a schedule.
    """
    spatial, reduce = _loops(sch, block, kinds)
    sblock = sch.get(block)
    axes = [iv.var.name for iv, k in zip(sblock.iter_vars, kinds) if k == "S"]
    if epilogue is not None and [_extent(sch, lp) for lp in sch.get_loops(epilogue)] != [_extent(sch, lp) for lp in spatial]:
        raise RuntimeError("the epilogue reads part of the output")  # e.g. a strided slice of it
    reads = list(sblock.reads)
    if not reads:
        raise RuntimeError("nothing read")
    largest = max(reads, key=_elements)
    indexed = set().union(*(_names(r.min) for r in largest.region))
    extent = [_extent(sch, loop) or 0 for loop in spatial]
    lane_axes = [i for i, name in enumerate(axes) if name not in indexed and extent[i] % cap == 0]
    if cap < 4 or not lane_axes or len(spatial) < 2:
        raise RuntimeError("no lane axis")  # _attempt moves on to the next plan
    c = lane_axes[0]
    w = len(spatial) - 1 if c != len(spatial) - 1 else len(spatial) - 2
    _copy_lane_innermost(sch, block, reads, largest, axes[c])
    c_out, c_in = sch.split(spatial[c], [None, cap])
    w_out, w_in = sch.split(spatial[w], [None, _tile(extent[w])])
    rest = [loop for i, loop in enumerate(spatial) if i not in (c, w)]
    sch.reorder(*rest, c_out, w_out, *reduce, w_in, c_in)
    sch.parallel(sch.fuse(*rest, c_out))
    _in_registers(sch, block, w_out, w_in, c_in, reduce[0], epilogue)


def _tile(extent: int, most: int = LANE_TILE) -> int:
    return next(d for d in range(min(most, extent), 0, -1) if extent % d == 0)


def _copy_lane_innermost(sch: s_tir.Schedule, block: Block, reads: list, largest, lane_axis: str) -> None:
    """Copy each weight-sized operand that varies along `lane_axis` with that axis innermost."""
    for i, read in enumerate(reads):
        dims = [d for d, r in enumerate(read.region) if lane_axis in _names(r.min)]
        if read is largest or len(dims) != 1 or dims[0] == len(read.region) - 1 or _elements(read) * 4 > _elements(largest):
            continue  # a weight-sized operand is copied; an activation-sized one is read in place
        copy = sch.cache_read(block, i, "global")
        index = [tirx.Var(f"i{k}", "int64") for k in range(len(read.region))]
        order = [index[k] for k in range(len(index)) if k != dims[0]] + [index[dims[0]]]
        sch.transform_layout(block, ("read", i), tirx.IndexMap(index, order, None))
        sch.parallel(sch.fuse(*sch.get_loops(copy)))


def _in_registers(
    sch: s_tir.Schedule, block: Block, tile_loop: Loop, unrolled: Loop, lanes: Loop, first_reduce: Loop, epilogue: Block | None
) -> None:
    """Accumulate the tile under `tile_loop` in registers (epilogue applied there), lanes as a
    vector, `unrolled` unrolled."""
    registers = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(registers, tile_loop, preserve_unit_loops=True)
    if epilogue is not None:
        sch.reverse_compute_inline(epilogue)
    sch.vectorize(lanes)
    sch.unroll(unrolled)
    sch.decompose_reduction(block, first_reduce)


def _taps_tiled(sch: s_tir.Schedule, block: Block, kinds: str, epilogue: Block | None, cap: int) -> None:
    """A transposed convolution by taps (`planner.kernels`), lane-tiled like `_lane_tiled`, with
    each output row split into its stride phases (a phase's rows all use the same kernel rows,
    so that arithmetic leaves the inner loops) and a tile of whole column groups (every phase
    of `x_in` columns) unrolled in registers: the tap indices of each unrolled output are then
    constants, and the tile's write-back is one contiguous run of the row."""
    sblock = sch.get(block)
    strides = [int(s) for s in sblock.annotations[TAPS_STRIDES]]
    spatial, reduce = _loops(sch, block, kinds)
    if len(spatial) != 4 or not reduce or not kinds.startswith("SSSS"):
        raise RuntimeError("not a 2-D transposed convolution")
    n, c, y, x = spatial
    extent = [_extent(sch, loop) or 0 for loop in (n, c, y, x)]
    if epilogue is not None and [_extent(sch, lp) for lp in sch.get_loops(epilogue)] != extent:
        raise RuntimeError("the epilogue reads part of the output")
    lanes = _lanes(extent[1], cap)
    if extent[2] % strides[0] or extent[3] % strides[1]:
        raise RuntimeError("no whole phases")
    reads = list(sblock.reads)
    largest = max(reads, key=_elements)
    _copy_lane_innermost(sch, block, reads, largest, sblock.iter_vars[1].var.name)
    y_out, y_phase = sch.split(y, [None, strides[0]])
    x_out, x_phase = sch.split(x, [None, strides[1]])
    c_out, c_in = sch.split(c, [None, lanes])
    # a tile's outputs (all phases of `x_in` columns) stay within LANE_TILE registers
    x_tile, x_in = sch.split(x_out, [None, _tile(extent[3] // strides[1], LANE_TILE // strides[1])])
    sch.reorder(n, y_out, c_out, y_phase, x_tile, *reduce, x_in, x_phase, c_in)
    sch.parallel(sch.fuse(n, y_out, c_out))
    sch.unroll(x_phase)
    _in_registers(sch, block, x_tile, x_in, c_in, reduce[0], epilogue)


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
_ERF = tvm.ir.Op.get("tirx.erf")
_EXP = tvm.ir.Op.get("tirx.exp")
_FLOOR = tvm.ir.Op.get("tirx.floor")
_TENSOR_LOAD = tvm.ir.Op.get("te.tensor_load")


@functools.cache
def _fast(op: tvm.ir.Op) -> tirx.PrimExpr:
    """TVM's vectorisable float32 form of `op` (topi's `fast_erf`, a rational polynomial within
    5e-7 of libm's, or `fast_exp`, Cephes' range reduction and polynomial, within 7e-7 relative
    for |x| < 20 and 2e-6 near the end of float32's range) of one
    placeholder element, which it loads with `te.tensor_load`; its `floor` as truncation less
    one where that rounded up, since SSE2 (x86-64's baseline, the generic `llvm` target) has no
    vector floor and LLVM called libm's `floorf` lane by lane. Made once per op for the process:
    it is asked for erf and exp only, so its unbounded cache holds two."""
    fast = topi.fast_erf if op.same_as(_ERF) else topi.fast_exp

    def floor(call: tvm.ir.Call) -> tirx.PrimExpr:
        if not call.op.same_as(_FLOOR):
            return call
        (y,) = call.args
        t = tirx.Cast("float32", tirx.Cast("int32", y))
        return tirx.Select(t > y, t - tirx.const(1.0, "float32"), t)

    return tvm_ffi.structural_map(fast(te.placeholder((1,), "float32", "x")).op.body[0], (tvm.ir.Call, floor))


def _calls_to_fast(expr, ops: tuple[tvm.ir.Op, ...]):
    """`expr` with every float32 call of one of `ops` computed by its `_fast` form."""

    def fast(call: tvm.ir.Call) -> tirx.PrimExpr:
        op = next((o for o in ops if call.op.same_as(o)), None)
        if op is None or str(call.ty) != "float32":
            return call
        (x,) = call.args
        return tvm_ffi.structural_map(_fast(op), (tvm.ir.Call, lambda c: x if c.op.same_as(_TENSOR_LOAD) else c))

    return tvm_ffi.structural_map(expr, (tvm.ir.Call, fast))


def _calls(func: tirx.PrimFunc, op: tvm.ir.Op) -> bool:
    found: list[tvm.ir.Call] = []
    tvm_ffi.structural_walk(func.body, [(tvm.ir.Call, lambda c: found.append(c) if c.op.same_as(op) else None)])
    return any(str(c.ty) == "float32" for c in found)


def _vector_erf(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tirx.PrimFunc:
    """`func` with every float32 `erf` computed by its `_fast` form.

    Why: TVM lowers `erf` to libm's scalar `erff`, so a vectorised GELU, or its gradient, calls
    it lane by lane: a BERT encoder's GELU kernels ran at 0.6-0.9 GFLOP/s, a quarter of its step
    once its products went through OpenBLAS; with the polynomial, 13-18x faster."""
    return func.with_body(_calls_to_fast(func.body, (_ERF,))) if _calls(func, _ERF) else func


def _vector_exp(func: tirx.PrimFunc, _mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tirx.PrimFunc:
    """`func` with every float32 `exp` inside a vectorised loop computed by its `_fast` form.

    Why: LLVM has no vector `exp` without a vector math library, so it splits one into a libm
    `expf` call per lane; the polynomial vectorises. Only inside vectorised loops: a scalar
    polynomial ran slower than libm's `expf` (a softmax's scalar row sums, 1.4x)."""
    if not _calls(func, _EXP):
        return func

    def loop(node: tirx.For) -> tirx.For:
        if node.kind != tirx.ForKind.VECTORIZED:
            return node
        body = _calls_to_fast(node.body, (_EXP,))
        return tirx.For(node.loop_var, node.min, node.extent, node.kind, body, node.thread_binding, node.annotations)

    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, loop)))


def default_schedule() -> tvm.transform.Pass:
    """Schedules every kernel not scheduled yet with `DefaultCPU`, its `erf`s made vectorisable
    first and the `exp`s it vectorises after (`_vector_erf`, `_vector_exp`)."""
    erf = tirx.transform.prim_func_pass(_vector_erf, opt_level=0, name="planner.VectorErf")
    exp = tirx.transform.prim_func_pass(_vector_exp, opt_level=0, name="planner.VectorExp")
    return tvm.transform.Sequential([erf, dlight.ApplyDefaultSchedule(_RULE), exp])
