"""The kernels of a lowered step as C, by TVM's C code generator, with what it leaves to fix.

TVM writes every kernel (PrimFunc) of a module as one C file that calls them through TVM's packed
C calling convention; it needs each function given its `global_symbol`, no runtime argument
checks (the driver passes what the step was compiled for) and no vector types (not C). What it
prints is fixed here: its float constants, seven digits where float32 needs nine, made exact
(`_exact_literals`), and its infinities and NaNs, words no C compiler knows (`_portable_specials`);
and read here: the scratch each kernel takes (`workspace_bytes`), which the
driver (`planner.backend.mcu.cstep`) sizes its pool by.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from planner.backend.sgemm.blas import GEMM
from planner.errors import CandidateFailed

C_TARGET = {"kind": "c"}
# TVM's C code generator: no runtime checks of argument shapes (the driver passes what the step was
# compiled for), no vector types (not C)
C_PASS_CONFIG = {"tirx.disable_assert": True, "tirx.disable_vectorize": True}
_WORKSPACE = re.compile(r"TVMBackendAllocWorkspace\(\d+, \w+, \(uint64_t\)(\d+)ULL")
_FUNCTION = re.compile(r"^TVM_DLL int32_t (__tvm_ffi_\w+)\(", re.MULTILINE)
_DEFINITION = re.compile(r"^TVM_DLL int32_t __tvm_ffi_(\w+)\(.*\) \{$", re.MULTILINE)  # a kernel's body begins


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


_FLOAT_LITERAL = re.compile(r"(?<![\w.])\d\.\d{6}e[+-]\d{2,3}f?")


def _printed(value: float, dtype: str) -> str:
    """How TVM's C code generator writes a float constant: seven significant digits."""
    return f"{value:e}" + ("f" if dtype == "float32" else "")


def _exact_literals(source: str, funcs: dict[str, tirx.PrimFunc]) -> str:
    """`source` with every float literal TVM's C code generator printed as the exact constant of
    the TIR it printed, in C99's hexadecimal form (`0x1.715476p+0f`), kernel by kernel.

    Why: the code generator writes a float with seven significant digits (`1.442695e+00f`) and
    float32 needs nine, so a constant such as `fast_exp`'s log2(e) drifted by an ulp and the C step
    by 5e-7 from the VM's, which LLVM compiles with the exact constant. Each kernel's literals are
    matched with its own TIR's constants (MobileNetV3's hard-swish has 1/6 rounded two ways, in
    different kernels); two of one kernel that print alike could not be told apart: the step is
    refused rather than built with either."""
    defined = list(_DEFINITION.finditer(source))
    out = [source[: defined[0].start()] if defined else source]
    for here, after in zip(defined, [*defined[1:], None]):
        func = funcs.get(here.group(1))
        exact: dict[str, set[str]] = {}

        def note(imm: tirx.FloatImm, exact: dict[str, set[str]] = exact) -> None:
            dtype, value = str(imm.ty), abs(float(imm.value))
            if (
                dtype == "float32"
            ):  # a float32 constant holding a double (a clip's bound) is its nearest float32, as LLVM takes it
                value = float(np.float32(value))
            if math.isfinite(value):
                exact.setdefault(_printed(value, dtype), set()).add(value.hex() + ("f" if dtype == "float32" else ""))

        if func is not None:
            tvm_ffi.structural_walk(func.body, [(tirx.FloatImm, note)])

        def replace(m: re.Match, exact: dict[str, set[str]] = exact, kernel: str = here.group(1)) -> str:
            values = exact.get(m.group(0))
            if values is None:
                return m.group(0)
            if len(values) > 1:
                raise CandidateFailed(f"the C back end cannot tell apart {kernel}'s constants {', '.join(sorted(values))}")
            return next(iter(values))

        out.append(_FLOAT_LITERAL.sub(replace, source[here.start() : after.start() if after else len(source)]))
    return "".join(out)


# how TVM's C code generator prints float32 and float64 infinities and NaNs (`-inff`, `nan`): no C
# compiler knows them; <math.h>'s macros, which the kernels include, are C99's
_SPECIALS = re.compile(r"(?<![\w.])(inff|nanf|inf|nan)(?![\w(\[])")
_SPELLED = {"inff": "INFINITY", "nanf": "NAN", "inf": "((double)INFINITY)", "nan": "((double)NAN)"}


def _portable_specials(source: str) -> str:
    """`source` with the infinities and NaNs TVM prints as words (masks of attention: `-inff`)
    written as C99's `INFINITY` and `NAN`."""
    return _SPECIALS.sub(lambda m: _SPELLED[m.group(1)], source)


# math intrinsics TVM's C code generator has no lowering for (it stops at "Unresolved call"), and
# the C99 <math.h> function each is: `fabsf` for float32, `fabs` for float64
_LIBM = {"tirx.fabs": "fabs", "tirx.exp2": "exp2", "tirx.fmod": "fmod"}


def _libm_calls(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with each intrinsic of `_LIBM` written as a call of its C99 function.

    Why: TVM lowers these for LLVM only; a model with an `Abs` (an L1 or smooth-L1 loss, a
    detector's box loss) failed on every microcontroller target at its first candidate."""

    def libm(call: tvm.ir.Call) -> tirx.PrimExpr:
        name = _LIBM.get(getattr(call.op, "name", ""))
        if name is None:
            return call
        suffix = "f" if str(call.args[0].ty) == "float32" else ""
        return tirx.call_pure_extern(str(call.ty), name + suffix, *call.args)

    return func.with_body(tvm_ffi.structural_map(func.body, (tvm.ir.Call, libm)))


# the clamps' C (`_clamps`): one instruction each where the FPU has VMINNM/VMAXNM, else comparisons
MINMAXNM = "PLANNER_MINMAXNM"  # the compiler flag's macro saying it has (`-D` it for FPv5: Cortex-M7, M55)
CLAMPS = f"""
/* Clamps (ReLU, ReLU6, clip) by a number: VMINNM/VMAXNM where {MINMAXNM} says the FPU has them, else
   a comparison, as TVM writes min and max. The same value either way (a signalling NaN, which no
   arithmetic makes, aside, and flush-to-zero off, as at reset): the bound is never NaN, a NaN
   clamped is the bound, and max(-0, +0) is +0 (Arm's FPMaxNum, and C libraries' fmaxf). */
#if defined({MINMAXNM})
#define PLANNER_MINF(x, c) __builtin_fminf((x), (c))
#define PLANNER_MAXF(x, c) __builtin_fmaxf((x), (c))
#define PLANNER_RELUF(x) __builtin_fmaxf((x), 0.0f)
#else
#define PLANNER_MINF(x, c) ((x) < (c) ? (x) : (c))
#define PLANNER_MAXF(x, c) ((x) > (c) ? (x) : (c))
#define PLANNER_RELUF(x) ((x) > 0.0f ? (x) : 0.0f)
#endif
"""


def _clamps(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with each float32 min or max of a value and a number (not NaN) written as the
    `CLAMPS` macro that computes it.

    Why: TVM writes `min(x, 6)` as `x < 6 ? x : 6`, which gcc compiles for a Cortex-M7 into a
    comparison, a flag transfer and a branch: ReLU6 cost 6-8 of the ~15 instructions of a
    MobileNetV2 BatchNorm-ReLU6 element; VMINNM and VMAXNM take one each. `fminf(x, c)` is
    `x < c ? x : c` for every x when c is a number other than 0 (a NaN x gives c both ways), and
    `fmaxf(x, +0)` is `x > 0 ? x : +0` where max(-0, +0) is +0, as VMAXNM makes it (a min with 0,
    or a max with -0, could keep the other zero: left as TVM writes them)."""

    def clamp(node: tirx.PrimExpr) -> tirx.PrimExpr:
        x, c = node.a, node.b
        if str(node.ty) != "float32" or not isinstance(c, tirx.FloatImm) or math.isnan(c.value):
            return node
        if isinstance(node, tirx.Max) and c.value == 0 and math.copysign(1.0, c.value) > 0:
            return tirx.call_pure_extern("float32", "PLANNER_RELUF", x)
        if c.value == 0:
            return node
        return tirx.call_pure_extern("float32", "PLANNER_MINF" if isinstance(node, tirx.Min) else "PLANNER_MAXF", x, c)

    return func.with_body(tvm_ffi.structural_map(func.body, [(tirx.Min, clamp), (tirx.Max, clamp)]))


def kernels_source(lowered: tvm.IRModule) -> str:
    """Every kernel (PrimFunc) of `lowered` as one C file, by TVM's C code generator, its math
    intrinsics C99's (`_libm_calls`), its clamps `CLAMPS`' (`_clamps`), its float constants exact
    (`_exact_literals`) and its infinities C99's (`_portable_specials`)."""
    funcs = {
        gv.name_hint: _clamps(_libm_calls(f)).with_attr("global_symbol", gv.name_hint)
        for gv, f in lowered.functions_items()
        if isinstance(f, tirx.PrimFunc)
    }
    with tvm.transform.PassContext(config=C_PASS_CONFIG):
        lib = tvm.tirx.build(tvm.IRModule(funcs), target=tvm.target.Target(C_TARGET))
    return _one_gemm_prototype(_portable_specials(_exact_literals(_with_clamps(lib.inspect_source()), funcs)))


_CLAMP_DECLARATION = re.compile(r'^#ifdef __cplusplus\nextern "C"\n#endif\nTVM_DLL float PLANNER_\w+\(.*\);\n', re.MULTILINE)
_INCLUDES = re.compile(r"^#include .*\n", re.MULTILINE)


def _with_clamps(source: str) -> str:
    """`source` with `CLAMPS` defined after its includes, and without the function declarations
    TVM writes for the macros as for any external call."""
    source = _CLAMP_DECLARATION.sub("", source)
    at = max((m.end() for m in _INCLUDES.finditer(source)), default=0)
    return source[:at] + CLAMPS + source[at:]


_GEMM_DECLARATION = re.compile(rf"^TVM_DLL int32_t {GEMM}\(.*\);$", re.MULTILINE)
_GEMM_PROTOTYPE = (
    f"TVM_DLL int32_t {GEMM}(int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, float, void*, int32_t, void*, "
    "int32_t, float, void*, int32_t);"
)


def _one_gemm_prototype(source: str) -> str:
    """TVM declares an external function as each kernel calls it: a convolution passes sgemm typed
    pointers (`float*`), a matmul (`planner.backend.sgemm.matmul`) `access_ptr` handles (`void*`), and in
    one C file the two declarations conflict (gcc refused a MobileNetV2 step at batch 4). One
    prototype, cblas_sgemm's own types with untyped operands, serves every call."""
    return _GEMM_DECLARATION.sub(_GEMM_PROTOTYPE, source)


def workspace_bytes(kernels: str, align: int) -> dict[str, int]:
    """kernel -> the scratch it takes at most while it runs (its blocks are taken and given back
    in stack order, each rounded up to `align`), read from their C; kernels that take none are left out."""
    out = {}
    bodies = _FUNCTION.split(kernels)[1:]
    for symbol, body in zip(bodies[::2], bodies[1::2]):
        need = sum(_aligned(int(n), align) for n in _WORKSPACE.findall(body))
        if need:
            out[symbol] = need
    return out


def include_dirs() -> list[Path]:
    """Where the headers the kernels include are: TVM FFI's (`tvm/ffi/c_api.h`, `dlpack/dlpack.h`)
    and TVM's runtime (`tvm/runtime/c_backend_api.h`), both in their wheels."""
    return [Path(tvm_ffi.__file__).parent / "include", Path(tvm.__file__).parent / "include"]
