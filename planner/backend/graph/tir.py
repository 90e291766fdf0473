"""Small TIR kernels of planner's own, and turning a kernel's output into one of its inputs."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import te, tirx


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
