"""Small TIR kernels of planner's own, and turning a kernel's output into one of its inputs."""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import te, tirx
from tvm.script import tirx as T

from planner.backend.tvmscript import parsed


def in_place_kernel(func: tirx.PrimFunc, pairs: dict[int, int], n_inputs: int) -> tirx.PrimFunc:
    """`func` with output parameter `n_inputs + k` replaced by input `pairs[k]` for each in-place k."""
    swap = {func.params[n_inputs + k]: func.params[i] for k, i in pairs.items()}

    def remap(var: tvm.ir.Var) -> tvm.ir.Var:
        for old, new in swap.items():
            if var.same_as(old):
                return new
        return var

    body = tvm_ffi.structural_map(func.body, (tvm.ir.Var, remap))
    params = [p for i, p in enumerate(func.params) if i - n_inputs not in pairs]
    return tirx.PrimFunc(params, body, func.ret_type, func.attrs)


def scale_kernel(shape: list[int], dtype: str, factor: float, name: str) -> tirx.PrimFunc:
    """`total *= factor`, in place over `total`, opaque: the summed gradients made a mean without
    a second buffer of each (fused into the optimizer's kernels it would be one per kernel
    reading it)."""
    total = te.placeholder(shape, dtype, "total")
    out = te.compute(shape, lambda *i: total[i] * tvm.tirx.const(factor, dtype), name="scaled")
    func = te.create_prim_func([total, out]).with_attrs({"op_pattern": 8, "global_symbol": name})
    return in_place_kernel(func, {0: 0}, 1)


def accumulate_kernel(shape: list[int], dtype: str, name: str) -> tirx.PrimFunc:
    """`total += grad`, in place over `total`, as an opaque kernel (`op_pattern` 8).

    Opaque because a chain of plain adds is one elementwise group to TVM's fusion, which would sum
    every micro-batch's gradient in one kernel at the end of the step and keep them all alive
    until then; in place because the running sum needs no second buffer."""
    total, grad = te.placeholder(shape, dtype, "total"), te.placeholder(shape, dtype, "grad")
    out = te.compute(shape, lambda *i: total[i] + grad[i], name="sum")
    func = te.create_prim_func([total, grad, out]).with_attrs({"op_pattern": 8, "global_symbol": name})
    return in_place_kernel(func, {0: 0}, 2)


CROSS_ENTROPY_LANES = 8  # a row's partial maxima and sums, one per lane (fp32 lanes of a 256-bit vector)


@functools.lru_cache(maxsize=64)
def cross_entropy_kernel(rows: int, vocab: int) -> tirx.PrimFunc:
    """`_cross_entropy_kernel`, parsed once per shape (`planner.backend.tvmscript`)."""
    return parsed(_cross_entropy_kernel, rows, vocab)


def _cross_entropy_kernel(rows: int, vocab: int) -> tirx.PrimFunc:
    """Each row of logits `x` [rows, vocab], its target class `y` and its share `s` of the loss
    (0 for an ignored token) in; the row's loss `s · (logsumexp(x) - x[y])` out, and `x`
    overwritten in place by the loss's gradient `s · (softmax(x) - onehot(y))`.

    One kernel for what TVM lowered as five (maximum, exponentials and their sum, the gather,
    the one-hot difference), each a pass over `[rows, vocab]` at 2-24 GFLOP/s under planner's
    schedule, the exponential computed twice: here three passes along each row as vectors (the
    maximum; the exponentials, written, and their sum; the scaling), `exp` vectorised by
    `fast_math`, the rows split over the pool's threads."""
    lanes = CROSS_ENTROPY_LANES
    full = vocab // lanes * lanes
    size = rows * vocab

    @T.prim_func(private=True, s_tir=True)  # (its annotations are TVMScript's, not types: ignored below)
    def cross_entropy_rows(
        x: T.Buffer((rows, vocab), "float32"),  # type: ignore[valid-type]
        y: T.Buffer((rows,), "int64"),  # type: ignore[valid-type]
        s: T.Buffer((rows,), "float32"),  # type: ignore[valid-type]
        loss: T.Buffer((rows,), "float32"),  # type: ignore[valid-type]
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8})
        with T.sblock("root"):  # as TVM's reshape analysis expects of a kernel
            xs = T.decl_buffer((size,), "float32", data=x.data)
            for r in T.parallel(rows):
                part = T.decl_buffer((lanes,), "float32", scope="local")
                held = T.decl_buffer((3,), "float32", scope="local")  # the maximum, x[y] - maximum, the sum
                at = r * vocab
                for lane in T.vectorized(lanes):
                    part[lane] = T.min_value("float32")
                for j in range(full // lanes):
                    for lane in T.vectorized(lanes):
                        part[lane] = T.max(part[lane], xs[at + j * lanes + lane])
                held[0] = part[0]
                for lane in range(1, lanes):
                    held[0] = T.max(held[0], part[lane])
                for k in range(full, vocab):
                    held[0] = T.max(held[0], xs[at + k])
                held[1] = xs[at + T.Cast("int32", y[r])] - held[0]
                for lane in T.vectorized(lanes):
                    part[lane] = T.float32(0)
                for j in range(full // lanes):
                    for lane in T.vectorized(lanes):
                        xs[at + j * lanes + lane] = T.exp(xs[at + j * lanes + lane] - held[0])
                        part[lane] = part[lane] + xs[at + j * lanes + lane]
                held[2] = part[0]
                for lane in range(1, lanes):
                    held[2] = held[2] + part[lane]
                for k in range(full, vocab):
                    xs[at + k] = T.exp(xs[at + k] - held[0])
                    held[2] = held[2] + xs[at + k]
                loss[r] = (T.log(held[2]) - held[1]) * s[r]
                held[2] = s[r] / held[2]
                for j in range(full // lanes):
                    for lane in T.vectorized(lanes):
                        xs[at + j * lanes + lane] = xs[at + j * lanes + lane] * held[2]
                for k in range(full, vocab):
                    xs[at + k] = xs[at + k] * held[2]
                xs[at + T.Cast("int32", y[r])] = xs[at + T.Cast("int32", y[r])] - s[r]

    return cross_entropy_rows.with_attr("global_symbol", f"cross_entropy_rows_{rows}x{vocab}")
