"""Dense convolutions, forward and both gradients, through OpenBLAS `sgemm`: Relax's convolutions
lowered to `gemm_kernels`' im2col + sgemm kernels, each kernel made once.

TVM's default lowering of a 3×3 convolution reached 7–20 % of numpy's float32 matmul speed on this
host, and its weight gradient (a convolution by the output gradient) less; OpenBLAS's sgemm
reaches numpy's own speed on the same shapes (docs/benchmarks.md, "Kernel libraries for dense
convolutions"). So a float32 NCHW convolution, ungrouped and undilated, becomes one kernel that
writes the input's columns (im2col) into a workspace and multiplies them by the weight
(`gemm_kernels`, its data movement `im2col`'s macros), and a micro-batch's weight gradient adds
its product where the running sum lies (`accumulate_in_place`). Everything else (grouped,
dilated, other dtypes or layouts, symbolic shapes) falls back to the lowering planner uses
without OpenBLAS.

A kernel's TVMScript takes 100-200 ms to parse, so each is parsed once per process and kept
parsed in the compile cache (`built`), under the source of the modules it is parsed from
(`_source_id`). This module holds no TVMScript: it decides which kernel a call gets, and keeps
what parsing made.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import tvm
from tvm import relax

from planner import cachefile
from planner.backend.sgemm import blas, gemm_kernels, im2col
from planner.backend.sgemm.gemm_kernels import (
    CALLS,
    CONV,
    Limits,
    constants,
    forward_kernel,
    input_grad_kernel,
    weight_grad_kernel,
)
from planner.backend.sgemm.im2col import Conv
from planner.backend.tvmscript import parsed
from planner.types import Kernels

MAX_KERNEL = 7  # a forward kernel larger than this is not a layer's: another GEMM shape entirely

Lowering = Callable[[relax.BlockBuilder, relax.Call], relax.Expr]


def _static(call: relax.Call, layouts: tuple[str, str, str]) -> bool:
    """float32, ungrouped, in `layouts`, every shape known."""
    a = call.attrs
    shapes = [call.args[0].ty.shape, call.args[1].ty.shape, call.ty.shape]
    return (
        (a.data_layout, a.kernel_layout, a.out_layout) == layouts
        and int(a.groups) == 1
        and call.args[0].ty.dtype == call.args[1].ty.dtype == "float32"
        and all(isinstance(d, tvm.tirx.IntImm) for s in shapes for d in s)
    )


def _ints(shape) -> list[int]:
    return [int(d) for d in shape]


def limits_for(kernels: Kernels) -> Limits:
    """The workspace the kernels' tiling may take: kilobytes for a microcontroller's portable
    sgemm, a megabyte beside OpenBLAS."""
    return gemm_kernels.MICRO_LIMITS if kernels == Kernels.PORTABLE else gemm_kernels.LIMITS


def pool_threads(target: tvm.target.Target) -> int:
    """Threads a kernel splits its work into: the target's cores (`num-cores`), else this machine's."""
    cores = target.attrs.get("num-cores")
    return max(1, int(cores) if cores else os.cpu_count() or 1)


def calls_openblas(mod: tvm.IRModule) -> bool:
    """Whether any kernel of `mod` calls OpenBLAS."""
    return any(isinstance(f, tvm.tirx.PrimFunc) and f.attrs.get(CALLS) == "openblas" for _, f in mod.functions_items())


# every module the kernels' TVMScript lives in: the kernels, and the macros they call
_KERNEL_SOURCES = (Path(gemm_kernels.__file__), Path(im2col.__file__), Path(blas.__file__))


def _source_id() -> str:
    """What a kernel is parsed from: the source of every module its TVMScript lives in
    (`_KERNEL_SOURCES`) and TVM's version (TVMScript's meaning). TVMScript parses those modules
    as they are on disk, so each of them keys the kernels kept parsed: a module of TVMScript that
    a kernel comes to use must join `_KERNEL_SOURCES`, or editing it would not invalidate them."""
    sources = b"".join(path.read_bytes() for path in _KERNEL_SOURCES)
    return hashlib.sha256(sources + tvm.__version__.encode()).hexdigest()[:16]


_MADE_BY = _source_id()  # the source this process runs


def built(
    kernel: Callable[..., tvm.tirx.PrimFunc], s: Conv, threads: int, limits: Limits, cache: Path | None
) -> tvm.tirx.PrimFunc:
    """`kernel(s, threads, limits)`, made once per process (under the module's `constants()`) and,
    given a `cache` directory, once per compile cache. Parsing a kernel's TVMScript takes
    100-200 ms, a third of a MobileNetV3 compile; a study legalizes the same convolutions for
    candidate after candidate, and workers, reruns and `compile` in other processes meet them
    again. The cache keeps TVM's JSON of the kernel (loaded in milliseconds) under a key of
    everything that made it, which the entry repeats, checked by its hash on every read; an entry
    that cannot be read or written costs only the parse.

    This process keeps the last 1,024 made: a study of one model meets at most a few kernels
    (forward, both gradients, the accumulating weight gradient) per distinct convolution at each
    of its few batch sizes, some hundreds; the cache directory serves one dropped since."""
    return _built(kernel, s, threads, limits, constants(), cache)


@functools.lru_cache(maxsize=1024)
def _built(
    kernel: Callable[..., tvm.tirx.PrimFunc], s: Conv, threads: int, limits: Limits, consts: tuple[int, ...], cache: Path | None
) -> tvm.tirx.PrimFunc:
    """`built`, keyed by the module's `constants()` too (a kernel chosen under others is another)."""
    if cache is not None:
        name = getattr(kernel, "func", kernel).__name__ + repr(sorted(getattr(kernel, "keywords", {}).items()))
        made_of = json.loads(json.dumps([name, astuple(s), threads, astuple(limits), consts, _MADE_BY]))  # as it reads back
        key = hashlib.sha256(json.dumps(made_of).encode()).hexdigest()[:32]
        path = kernels_dir(cache) / f"{key}.json"
        cached = cachefile.read_json(path, key)
        if cached is not None and cached.get("made_of") == made_of and isinstance(cached.get("tir"), str):
            try:
                loaded = tvm.ir.load_json(cached["tir"])
            except Exception:  # noqa: BLE001 - TVM raises ValueError, RuntimeError, ...: the kernel is made again
                loaded = None
            if isinstance(loaded, tvm.tirx.PrimFunc) and _conv_of(loaded) == astuple(s):
                return loaded
    func, source = _parsed(kernel, s, threads, limits, consts)
    # TVMScript parses the source on disk: if it was not the source this process runs (a checkout
    # during a study), the kernel is used here but not kept under this source's key
    if cache is not None and source == _MADE_BY:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            cachefile.write_json(path, {"made_of": made_of, "tir": tvm.ir.save_json(func)}, key)
        except OSError:
            pass
    return func


@functools.lru_cache(maxsize=1024)
def _parsed(
    kernel: Callable[..., tvm.tirx.PrimFunc], s: Conv, threads: int, limits: Limits, _constants: tuple[int, ...]
) -> tuple[tvm.tirx.PrimFunc, str]:
    """The parse `built` makes, once per process whatever the cache directory (a compile into a
    cache of its own, a test's or a `compile --cache-dir`, was parsing again the kernels this
    process had parsed for another), with the id of the source on disk it was parsed from."""
    func = parsed(kernel, s, threads, limits)
    return func, _source_id()


def _conv_of(func: tvm.tirx.PrimFunc) -> tuple[int, ...] | None:
    """The `Conv` fields an OpenBLAS kernel says it computes (`gemm_kernels._attrs`); None for any other function."""
    attrs = func.attrs or {}
    conv = attrs.get(CONV)
    return tuple(int(d) for d in conv) if conv is not None and attrs.get(CALLS) == "openblas" else None


def kernels_dir(cache: Path) -> Path:
    """Where the compile cache `cache` keeps parsed kernels (`built`)."""
    return cache / "kernels-tir"


def forward_conv(call: relax.Call) -> Conv | None:
    """The `Conv` of a layer's forward `relax.nn.conv2d` the forward kernel computes; None for any other."""
    a = call.attrs
    if not (
        _static(call, ("NCHW", "OIHW", "NCHW"))
        and all(int(d) == 1 for d in a.dilation)
        and max(_ints(call.args[1].ty.shape)[2:]) <= MAX_KERNEL
    ):
        return None
    n, c, h, w = _ints(call.args[0].ty.shape)
    o, _, kh, kw = _ints(call.args[1].ty.shape)
    _, _, oh, ow = _ints(call.ty.shape)
    sh, sw = _ints(a.strides)
    return Conv(n, c, h, w, o, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1]))


def input_grad_conv(call: relax.Call) -> Conv | None:
    """The `Conv` of a `relax.nn.conv2d_transpose` as TVM's input gradient writes it (NCHW dy, the
    IOHW view of the layer's OIHW weight); None for any other."""
    a = call.attrs
    if not (_static(call, ("NCHW", "IOHW", "NCHW")) and all(int(d) == 1 for d in a.dilation)):
        return None
    n, o, oh, ow = _ints(call.args[0].ty.shape)
    _, c, kh, kw = _ints(call.args[1].ty.shape)
    _, _, h, w = _ints(call.ty.shape)
    sh, sw = _ints(a.strides)
    return Conv(n, c, h, w, o, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1]))


def conv2d(
    bb: relax.BlockBuilder, call: relax.Call, *, fallback: Lowering, threads: int, limits: Limits, cache: Path | None
) -> relax.Expr:
    """`relax.nn.conv2d`: a layer's forward convolution, or TVM's weight gradient (x in a CNHW
    view convolved by dy in an IOHW view, dilated by the layer's stride), through OpenBLAS."""
    a = call.attrs
    if _static(call, ("CNHW", "IOHW", "CNHW")) and all(int(d) == 1 for d in a.strides):
        n, c, h, w = _ints(call.args[0].ty.shape)
        _, o, oh, ow = _ints(call.args[1].ty.shape)
        _, _, kh, kw = _ints(call.ty.shape)
        sh, sw = _ints(a.dilation)
        s = Conv(n, c, h, w, o, kh, kw, oh, ow, sh, sw, int(a.padding[0]), int(a.padding[1]))
        gv = bb.add_func(built(weight_grad_kernel, s, threads, limits, cache), "conv2d_weight_grad_gemm")
        return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)
    forward = forward_conv(call)
    if forward is not None:
        gv = bb.add_func(built(forward_kernel, forward, threads, limits, cache), "conv2d_gemm")
        return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)
    return fallback(bb, call)


def conv2d_transpose(
    bb: relax.BlockBuilder, call: relax.Call, *, fallback: Lowering, threads: int, limits: Limits, cache: Path | None
) -> relax.Expr:
    """`relax.nn.conv2d_transpose` as TVM's input gradient writes it (NCHW dy, the IOHW view of
    the layer's OIHW weight) through OpenBLAS."""
    s = input_grad_conv(call)
    if s is None:
        return fallback(bb, call)
    gv = bb.add_func(built(input_grad_kernel, s, threads, limits, cache), "conv2d_input_grad_gemm")
    return relax.call_tir(gv, relax.Tuple([call.args[0], call.args[1]]), out_ty=call.ty)


_weight_grad_accumulating = functools.partial(weight_grad_kernel, accumulate=True)


def accumulate_in_place(mod: tvm.IRModule, func: str, threads: int, limits: Limits, *, cache: Path | None) -> tvm.IRModule:
    """`mod` with each micro-batch's weight gradient through OpenBLAS added by its own kernel to
    the running sum, where the sum lies, instead of written to a buffer of its own that an
    accumulation kernel then adds (`graph._in_place`): the step holds one dW, not two."""
    step = mod[func]
    if len(step.body.blocks) != 1:
        return mod
    bindings = list(step.body.blocks[0].bindings)
    uses: dict[relax.Var, int] = {}
    for b in bindings:
        for v in relax.analysis.free_vars(b.value):
            uses[v] = uses.get(v, 0) + 1
    for v in relax.analysis.free_vars(step.body.body):
        uses[v] = uses.get(v, 0) + 1
    bound = {b.var: b.value for b in bindings}
    builder = relax.BlockBuilder(mod)
    fused: dict[relax.Var, relax.Expr] = {}  # accumulation binding -> the gradient kernel that does it
    for b in bindings:
        call = b.value
        if not (isinstance(call, relax.Call) and call.op.same_as(tvm.ir.Op.get("relax.call_tir_inplace"))):
            continue
        if not call.args[0].name_hint.startswith("accumulate_"):
            continue
        total, grad = call.args[1].fields
        source = bound.get(grad)
        if uses.get(grad) != 1 or not (isinstance(source, relax.Call) and source.op.same_as(tvm.ir.Op.get("relax.call_tir"))):
            continue
        kernel = mod[source.args[0]]
        if not source.args[0].name_hint.startswith("conv2d_weight_grad_gemm") or kernel.attrs.get(CONV) is None:
            continue
        s = Conv(*(int(d) for d in kernel.attrs[CONV]))
        gv = builder.add_func(built(_weight_grad_accumulating, s, threads, limits, cache), "conv2d_weight_grad_gemm_accumulate")
        x, dy = source.args[1].fields
        fused[b.var] = relax.op.call_tir_inplace(gv, relax.Tuple([x, dy, total]), 2, call.ty)
    if not fused:
        return mod
    dropped = {b.value.args[1].fields[1] for b in bindings if b.var in fused}
    order = [relax.VarBinding(b.var, fused[b.var]) if b.var in fused else b for b in bindings if b.var not in dropped]
    out = builder.get()
    out[func] = relax.Function(
        step.params, relax.SeqExpr([relax.DataflowBlock(order)], step.body.body), step.ret_ty, step.is_pure, step.attrs
    )
    return relax.transform.DeadCodeElimination([func])(out)
