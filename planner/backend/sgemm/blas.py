"""How a kernel's TVMScript calls an sgemm: OpenBLAS's `cblas_sgemm` (or, on a microcontroller,
planner's portable sgemm under its name), and the portable sgemm's product by an int8 weight.

One place for the calls' names, flags and arguments, shared by the convolution kernels
(`gemm_kernels`) and the matrix products (`matmul`). TVMScript parses the kernels that call these,
so `gemm._KERNEL_SOURCES` hashes this module too.
"""

from __future__ import annotations

from tvm.script import tirx as T

GEMM = "scipy_cblas_sgemm"  # OpenBLAS's cblas_sgemm in scipy-openblas32's symbol namespace
# the portable sgemm's product by an int8 A whose stored rows each have a scale (runtime/sgemm.c): a
# frozen weight stored int8 read where it lies, never dequantized into a copy (microcontrollers only)
GEMM_S8 = "planner_sgemm_s8"
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
PANEL = 4  # rows of an int8 A the portable sgemm converts to fp32 at once, for all of B's columns


def sgemm(trans, mnk, a, b, beta, c, int8=None):
    """C = A·B + beta·C through cblas_sgemm (row major, alpha 1): `trans` is A's and B's flag,
    `mnk` the product's sizes, and `a`, `b`, `c` each an operand's address and leading dimension.
    With `int8` = (scale, panel), A is int8 and the product is the portable sgemm's `GEMM_S8`:
    each of A's values times its stored row's scale (one fp32 each at `scale`), `PANEL` rows of
    op(A) at a time converted into `panel` (room for `PANEL`·k floats)."""
    (ta, tb), (m, n, k), (pa, lda), (pb, ldb), (pc, ldc) = trans, mnk, a, b, c
    if int8 is not None:
        scale, panel = int8
        return T.call_extern(
            "int32", GEMM_S8, ROW_MAJOR, ta, tb, m, n, k, T.float32(1), pa, lda, scale, panel, pb, ldb, beta, pc, ldc
        )
    return T.call_extern("int32", GEMM, ROW_MAJOR, ta, tb, m, n, k, T.float32(1), pa, lda, pb, ldb, beta, pc, ldc)


def int8_operands(quantized: bool, inner: int, per: int):
    """`(sc, ws, th) -> sgemm's int8 argument` for a kernel whose weight is int8 (`quantized`):
    its scales buffer's address, and the last `PANEL * inner` floats of thread `th`'s `per` floats
    of workspace (a product over `inner` values) as an access pointer with its extent — only C
    writes there, and TVM sizes a workspace by the region its TIR is seen to touch (an
    `address_of` is one element). Else None, the scales buffer standing in unread."""
    if not quantized:
        return lambda sc, ws, th: None
    at = per - PANEL * inner
    return lambda sc, ws, th: (sc.data, ws.access_ptr("rw", offset=th * per + at, extent=PANEL * inner))
