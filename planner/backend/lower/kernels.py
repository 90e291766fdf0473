"""Relax ops lowered planner's way where TVM's default lowering wastes the work.

A strided convolution's input gradient is a transposed convolution, and TVM lowers
`conv2d_transpose` by dilating its input with zeros and convolving that: at stride 2 three of
every four multiply-adds multiply a zero (a tiny CNN's stride-2 layer: 58 MFLOP for 15 of work).
`conv2d_transpose_taps` computes each output from only the kernel taps that land on it.

A softmax over the last axis, TVM's way under planner's schedule, reduces each row's maximum with
the rows as vector lanes (a gather from rows a row apart) and its sum of exponentials one lane
at a time: 0.6 GFLOP/s, a BERT encoder's slowest kernel once its products went through OpenBLAS.
`softmax_rows` reads each row as vectors along it.
"""

from __future__ import annotations

import collections
import functools
import threading
from dataclasses import astuple
from pathlib import Path

import tvm
import tvm_ffi
from tvm import relax, te, tirx
from tvm.script import tirx as T

from planner.backend.lower import portable
from planner.backend.sgemm import gemm, gemm_kernels, matmul
from planner.backend.sgemm.gemm import Lowering
from planner.backend.tvmscript import parsed
from planner.runtime.libraries import load_openblas
from planner.types import Kernels

TAPS_STRIDES = "planner.taps_strides"  # block annotation: the stride phases `schedule` splits by


def conv2d_transpose_taps(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """NCHW/IOHW, ungrouped, undilated, strided: out[n, c, y, x] sums dy[n, o, iy, ix] * w[o, c, kh, kw]
    over the taps with y = iy * s - p + kh, enumerated directly: kh = (y + p) mod s + s * t for
    t < ceil(k / s). A tap off the kernel or the image contributes a selected zero, its loads
    clamped into range: a branch per tap (TVM's guarded load) measured twice as slow, and
    zero-padding the weight beforehand made the step hold an extra activation-sized buffer (the
    memory planner gave the padded weight the slot the input gradient had reused). Anything
    else falls back to TVM's own legalization."""
    a = call.attrs
    if not (
        (a.data_layout, a.kernel_layout, a.out_layout) == ("NCHW", "IOHW", "NCHW")
        and int(a.groups) == 1
        and all(int(d) == 1 for d in a.dilation)
        and any(int(s) > 1 for s in a.strides)
    ):
        return tvm.ir.Op.get("relax.nn.conv2d_transpose").get_attr("FLegalize")(bb, call)
    sh, sw = (int(s) for s in a.strides)
    ph, pw = int(a.padding[0]), int(a.padding[1])
    out_shape = [int(d) for d in call.ty.shape]
    shape = call.args[1].ty.shape
    kh_size, kw_size = int(shape[2]), int(shape[3])
    th_size, tw_size = -(-kh_size // sh), -(-kw_size // sw)

    def compute(dy: te.Tensor, w: te.Tensor) -> te.Tensor:
        _, channels, height, width = (int(d) for d in dy.shape)
        ro = te.reduce_axis((0, channels), "ro")
        th = te.reduce_axis((0, th_size), "th")
        tw = te.reduce_axis((0, tw_size), "tw")

        def tap(n, c, y, x):
            iy = tirx.floordiv(y + ph, sh) - th
            ix = tirx.floordiv(x + pw, sw) - tw
            kh = tirx.floormod(y + ph, sh) + sh * th
            kw = tirx.floormod(x + pw, sw) + sw * tw
            inside = tirx.all(iy >= 0, iy < height, ix >= 0, ix < width, kh < kh_size, kw < kw_size)
            # clamped (always valid) loads and a select, not a guarded load: no branch per tap
            value = dy[n, ro, tirx.max(tirx.min(iy, height - 1), 0), tirx.max(tirx.min(ix, width - 1), 0)]
            weight = w[ro, c, tirx.min(kh, kh_size - 1), tirx.min(kw, kw_size - 1)]
            product = tirx.Select(inside, value * weight, tirx.const(0, dy.dtype))
            return te.sum(product, axis=[ro, th, tw])

        return te.compute(out_shape, tap, name="conv2d_transpose_taps", attrs={TAPS_STRIDES: [sh, sw]})

    return bb.call_te(compute, call.args[0], call.args[1], primfunc_name_hint="conv2d_transpose_taps")


SOFTMAX_LANES = 8  # a row's partial maxima and sums, one per lane (fp32 lanes of a 256-bit vector)


def softmax_rows(bb: relax.BlockBuilder, call: relax.Call, *, threads: int) -> relax.Expr:
    """`relax.nn.softmax` over the last axis of a float32 tensor of static shape whose rows are
    a multiple of `SOFTMAX_LANES` long: the pool's threads take contiguous shares of the rows,
    each row read as vectors along it (`_softmax_kernel`). Anything else is TVM's lowering."""
    ty = call.args[0].ty
    shape = [int(d) for d in ty.shape] if ty.shape is not None and all(isinstance(d, tirx.IntImm) for d in ty.shape) else None
    axis = int(call.attrs.axis)
    if shape is None or ty.dtype != "float32" or axis not in (-1, len(shape) - 1) or shape[-1] % SOFTMAX_LANES:
        return tvm.ir.Op.get("relax.nn.softmax").get_attr("FLegalize")(bb, call)
    gv = bb.add_func(_softmax(tuple(shape), threads), "softmax_rows")
    return relax.call_tir(gv, relax.Tuple([call.args[0]]), out_ty=call.ty)


@functools.lru_cache(maxsize=256)
def _softmax(shape: tuple[int, ...], threads: int) -> tirx.PrimFunc:
    """`_softmax_kernel`, parsed once per shape (`planner.backend.tvmscript`)."""
    return parsed(_softmax_kernel, shape, threads)


def _softmax_kernel(shape: tuple[int, ...], threads: int) -> tirx.PrimFunc:
    """y = exp(x - max) / Σ exp(x - max) per row: the maximum and the sum as `SOFTMAX_LANES`
    partial ones, vectors along the row, folded into one at the row's end; the exponentials
    written once and scaled in place (their `exp` vectorised by `fast_math`'s fast form)."""
    length, lanes = shape[-1], SOFTMAX_LANES
    rows = functools.reduce(lambda a, b: a * b, shape[:-1], 1)
    share = -(-rows // threads)
    size = rows * length

    @T.prim_func(private=True, s_tir=True)  # (its annotations are TVMScript's, not types: ignored below)
    def softmax_rows(x: T.Buffer(shape, "float32"), y: T.Buffer(shape, "float32")):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        with T.sblock("root"):  # as TVM's reshape analysis expects of a kernel of one input
            xs = T.decl_buffer((size,), "float32", data=x.data)
            ys = T.decl_buffer((size,), "float32", data=y.data)
            for th in T.parallel(threads):
                part = T.decl_buffer((lanes,), "float32", scope="local")
                total = T.decl_buffer((1,), "float32", scope="local")
                for r in range(th * share, T.min((th + 1) * share, rows)):
                    for lane in T.vectorized(lanes):
                        part[lane] = xs[r * length + lane]
                    for j in range(1, length // lanes):
                        for lane in T.vectorized(lanes):
                            part[lane] = T.max(part[lane], xs[r * length + j * lanes + lane])
                    total[0] = part[0]
                    for lane in range(1, lanes):
                        total[0] = T.max(total[0], part[lane])
                    for lane in T.vectorized(lanes):
                        part[lane] = T.float32(0)
                    for j in range(length // lanes):
                        for lane in T.vectorized(lanes):
                            ys[r * length + j * lanes + lane] = T.exp(xs[r * length + j * lanes + lane] - total[0])
                            part[lane] = part[lane] + ys[r * length + j * lanes + lane]
                    total[0] = part[0]
                    for lane in range(1, lanes):
                        total[0] = total[0] + part[lane]
                    total[0] = T.float32(1) / total[0]
                    for j in range(length // lanes):
                        for lane in T.vectorized(lanes):
                            ys[r * length + j * lanes + lane] = ys[r * length + j * lanes + lane] * total[0]

    return softmax_rows


class _Remembered:
    """One op's lowering, remembered across the modules of this process by what decides it (the
    op, its attributes, its operands' types — or, for an operand that is not a variable, the
    operand itself —, which operands are the same variable, its result type, and the `flavor`:
    the target and whatever else chose among planner's lowerings) when it is one `call_tir` of
    the call's own operands: a study legalizes ~1,500 ops per candidate, most of them ones every earlier
    candidate had (~1 ms each through TE). A hit adds the remembered kernel and calls it on
    this call's operands; anything else is lowered afresh. A hash match is confirmed by
    structural equality before it is used."""

    SIZE = 4096  # kernels of the last few dozen candidates: what a study reuses most
    memo: collections.OrderedDict[tuple, tuple[list, tirx.PrimFunc, str, list[int], relax.Call]] = collections.OrderedDict()
    lock = threading.Lock()

    def __init__(self, lower: Lowering, flavor: tuple) -> None:
        self.lower, self.flavor = lower, flavor

    def __call__(self, bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        witness = self._witness(call)
        # which operands are one and the same variable: `x * x` lowers to a kernel of one input
        aliases = tuple(next(j for j, b in enumerate(call.args) if b.same_as(a)) for a in call.args)
        key = (call.op.name, *self.flavor, aliases, *(tvm_ffi.structural_hash(w) if w is not None else 0 for w in witness))
        with self.lock:
            found = self.memo.get(key)
            if found is not None:
                self.memo.move_to_end(key)  # least recently used first out
        if found is not None and all(_same(a, b) for a, b in zip(found[0], witness)):
            _, func, name, picks, template = found
            gv = bb.add_func(func, name)
            args = relax.Tuple([call.args[i] for i in picks])
            return relax.Call(template.op, [gv, args], template.attrs, template.ty_args)
        out = self.lower(bb, call)
        remembered = self._template(bb, call, out)
        if remembered is not None:
            with self.lock:
                self.memo[key] = (witness, *remembered)
                while len(self.memo) > self.SIZE:
                    self.memo.popitem(last=False)
        return out

    @staticmethod
    def _witness(call: relax.Call) -> list:
        operands = [a.ty if isinstance(a, relax.Var) else a for a in call.args]
        return [call.attrs, call.ty, *call.ty_args, *operands]

    @staticmethod
    def _template(bb: relax.BlockBuilder, call: relax.Call, out: relax.Expr):
        if not (
            isinstance(out, relax.Call)
            and out.op.same_as(_CALL_TIR)
            and len(out.args) == 2
            and isinstance(out.args[0], relax.GlobalVar)
            and isinstance(out.args[1], relax.Tuple)
        ):
            return None
        picks = []
        for field in out.args[1].fields:
            index = next((i for i, a in enumerate(call.args) if a.same_as(field)), None)
            if index is None or not isinstance(field, relax.Var):
                return None  # an operand the lowering made: not this call's to replay
            picks.append(index)
        func = bb.get()[out.args[0]]
        # the name the lowering asked for, without the number the builder added to make it unique
        name = out.args[0].name_hint.rstrip("0123456789") or out.args[0].name_hint
        return (func, name, picks, out) if isinstance(func, tirx.PrimFunc) else None


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and tvm_ffi.structural_equal(a, b))


def legalize(target: tvm.target.Target, kernels: Kernels, *, cache: Path | None = None) -> tvm.transform.Pass:
    """TVM's LegalizeOps with planner's lowerings in place of TVM's where they differ (with
    `kernels` OpenBLAS, dense convolutions and both their gradients through `gemm`, whose parsed
    kernels a compile `cache` directory keeps, and matrix products through `matmul`, after its
    `fold` of transposed operands), every lowering remembered across candidates (`_Remembered`)."""
    threads = gemm.pool_threads(target)
    ops: dict[str, Lowering] = {
        "relax.nn.conv2d_transpose": conv2d_transpose_taps,
        "relax.nn.softmax": functools.partial(softmax_rows, threads=threads),
    }
    limits = gemm.limits_for(kernels)
    flavor = (str(target), kernels.value, threads, *astuple(limits), *gemm_kernels.constants(), *matmul.limits())
    before: list[tvm.transform.Pass] = []
    if kernels.sgemm:
        if kernels == Kernels.OPENBLAS:
            # loaded here too, not only where the step is loaded: a module built in-process (tests,
            # TVM's JIT) resolves the sgemm symbol against this process, or calls address zero
            load_openblas()
        tvms = tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")
        if kernels == Kernels.PORTABLE:  # a microcontroller's depthwise convolutions through its C kernel
            tvms = functools.partial(portable.depthwise, fallback=tvms)
        ops["relax.nn.conv2d"] = functools.partial(gemm.conv2d, fallback=tvms, threads=threads, limits=limits, cache=cache)
        ops["relax.nn.conv2d_transpose"] = functools.partial(
            gemm.conv2d_transpose, fallback=conv2d_transpose_taps, threads=threads, limits=limits, cache=cache
        )
        before, ops = [matmul.fold], ops | matmul.lowerings(threads)
    lowered = relax.transform.LegalizeOps({name: _Remembered(lower, flavor) for name, lower in (_registered() | ops).items()})
    return tvm.transform.Sequential([*before, lowered])


@functools.cache
def _registered() -> dict[str, Lowering]:
    """Every Relax op's own lowering (its `FLegalize`), read once: one value for the process
    (planner changes no op's lowering), so an unbounded cache holds just that."""
    found = ((name, tvm.ir.Op.get(name).get_attr("FLegalize")) for name in tvm.ir.Op.list_op_names())
    return {name: lower for name, lower in found if name.startswith("relax.") and lower is not None}
