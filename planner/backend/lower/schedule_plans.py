"""The plans `DefaultCPU` (`schedule`) tries on a kernel's block, and the schedule primitives they
share: elementwise blocks flat or by broadcast runs, reductions row by row (inside their
epilogue, or as vector partial sums when they have few outputs), convolutions and matmuls
lane-tiled in registers, transposed convolutions by taps tiled by stride phase.

Each plan schedules its block on the schedule it is given or raises a `RuntimeError` (TVM's
`ScheduleError` is one), and the rule moves on to its next plan. They are apart from the rule so
that how a block may be scheduled reads apart from which plan a block gets and the guards
against TVM's miscompiles (`schedule`).
"""

from __future__ import annotations

import math
from typing import TypeAlias

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from planner.backend.lower.kernels import TAPS_STRIDES


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
    """A transposed convolution by taps (`planner.backend.lower.kernels`), lane-tiled like `_lane_tiled`, with
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
