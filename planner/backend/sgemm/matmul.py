"""Matrix products (`relax.matmul`, and the `relax.einsum`s that are one) through OpenBLAS `sgemm`.

A transformer's step is matrix products: TVM's default lowering of `relax.matmul`, under
planner's default schedule, ran a BERT-style encoder's products at 8-21 GFLOP/s on this host
(2 threads), where OpenBLAS's sgemm runs the same shapes several times faster. So a float32
product of static shapes becomes one kernel that calls sgemm:

- 2-D × 2-D: one product;
- batched × 2-D (a layer's weight): the batch flattened into the rows, one product;
- batched × batched (attention: [B, H, L, D] × [B, H, D, L], the same batch dims or broadcast
  ones): one product per batch entry, each operand's batch entry found by its own strides (0
  along a broadcast dim).

The work is split over the target's pool threads (`gemm.pool_threads`) inside one `T.parallel`
loop: batch entries, or bands of the output's rows (or columns, when it has more of them), each
thread a contiguous share of them, so no two threads write the same output and none waits for
another. OpenBLAS runs single-threaded inside planner's pool, never beside it
(`libraries.load_openblas`). The kernels are built as TIR directly (no TE, no TVMScript to
parse: under a millisecond each, kept per process, nothing in the compile cache) and marked
scheduled and opaque, as `gemm`'s are: no schedule or fusion touches them; what TVM fused after
a product (a bias, the GELU) becomes an elementwise kernel of its own.

Transposed operands cost no copy: Relax's gradient of `matmul(a, b)` is `matmul(dy, permute_dims(b))`
and `matmul(permute_dims(a), dy)`, and the lowering of an op sees only its operands, already
lowered (a `permute_dims` is a `call_tir` of a transpose kernel by then). So `fold`, a pass run
just before legalization, rewrites a product of a `permute_dims` that swaps the last two axes
into the `einsum` that reads the untransposed tensor, whose lowering here passes sgemm's
transpose flag; the transpose is then dead code, and removed. It also rewrites a layer's weight
gradient from a 3-D activation, `collapse_sum_to(matmul(permute_dims(x), dy), W.shape)` (one
product per batch entry, then their sum: 8 products and a reduction that ran at 0.1 GFLOP/s),
into one einsum contracting the batch too, which is one product with K = batch × length.

Anything else — other dtypes, symbolic shapes, vectors, products too small to gain from a
library call (`MIN_FLOPS`) — keeps TVM's own lowering.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from planner.backend.sgemm.blas import GEMM, NO_TRANS, ROW_MAJOR, TRANS
from planner.backend.sgemm.gemm import Lowering
from planner.backend.sgemm.gemm_kernels import CALLS, FLOPS

# A product of fewer flops than this keeps TVM's lowering. Measured on this host (2 threads, each
# product alone, TVM's under planner's schedule): the classifier's [8, 128] x [128, 10] took 1.5 us
# in TVM's kernel and 5 us through sgemm (a parallel region and a library call for 20 kflop);
# 32x32x32 was even (5-7 us); from 64x32x32 on, sgemm was 1.4-4x faster (128x128x128: 162 against
# 57 us; 1024x128x128: 1.70 against 0.42 ms).
MIN_FLOPS = 2 * 32**3
BAND = 8  # rows (or columns) of a thread's band are a multiple of this: OpenBLAS's register blocks
MATMUL_OP = tvm.ir.Op.get("relax.matmul")
EINSUM_OP = tvm.ir.Op.get("relax.einsum")
PERMUTE_OP = tvm.ir.Op.get("relax.permute_dims")
COLLAPSE_OP = tvm.ir.Op.get("relax.collapse_sum_to")


@dataclass(frozen=True)
class Product:
    """C[i] = op(A[i]) · op(B[i]) for every batch entry i of C ([*batch, m, n], contiguous), op
    transposing where `ta` / `tb` say (A stored [k, m], B stored [n, k]). `a_strides` and
    `b_strides` are the elements between one batch entry and the next of each operand along each
    of C's batch dims: 0 where the operand is broadcast along it."""

    batch: tuple[int, ...]
    a_strides: tuple[int, ...]
    b_strides: tuple[int, ...]
    m: int
    n: int
    k: int
    ta: bool
    tb: bool

    @property
    def entries(self) -> int:
        return math.prod(self.batch)

    @property
    def flops(self) -> int:
        return 2 * self.entries * self.m * self.n * self.k

    def flattened(self) -> Product:
        """One product where A's batch entries lie one after another as rows and B is shared by
        all of them (a layer's weight): C's batch is then its rows too."""
        if self.batch and not self.ta and not any(self.b_strides) and self.a_strides == _contiguous(self.batch, self.m * self.k):
            return Product((), (), (), self.m * self.entries, self.n, self.k, False, self.tb)
        return self


def _contiguous(batch: tuple[int, ...], inner: int) -> tuple[int, ...]:
    """Row-major strides of `batch` dims over entries of `inner` elements."""
    return tuple(math.prod(batch[d + 1 :]) * inner for d in range(len(batch)))


def _static(ty) -> list[int] | None:
    """The float32 tensor type's shape, when every dimension is known."""
    if not isinstance(ty, relax.TensorType) or ty.dtype != "float32" or ty.shape is None:
        return None
    shape = ty.shape
    if not all(isinstance(d, tirx.IntImm) for d in shape):
        return None
    return [int(d) for d in shape]


def of_matmul(a: list[int], b: list[int]) -> Product | None:
    """`matmul` of operands shaped `a` and `b` (numpy's rules: batch dims broadcast, right
    aligned); None for a vector operand."""
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        return None
    m, k, n = a[-2], a[-1], b[-1]
    rank = max(len(a), len(b)) - 2
    batch_a, batch_b = [1] * (rank - len(a) + 2) + a[:-2], [1] * (rank - len(b) + 2) + b[:-2]
    batch = tuple(max(x, y) for x, y in zip(batch_a, batch_b))
    if any(x not in (1, c) or y not in (1, c) for x, y, c in zip(batch_a, batch_b, batch)):
        return None
    a_strides = tuple(s if x == c and c > 1 else 0 for s, x, c in zip(_contiguous(tuple(batch_a), m * k), batch_a, batch))
    b_strides = tuple(s if y == c and c > 1 else 0 for s, y, c in zip(_contiguous(tuple(batch_b), k * n), batch_b, batch))
    return Product(batch, a_strides, b_strides, m, n, k, False, False)


def of_einsum(subscripts: str, a: list[int], b: list[int]) -> Product | None:
    """The einsum of two operands as one sgemm per batch entry, when it is one: C's subscripts
    are batch + m + n, A's batch + (m + k or k + m), B's batch + (k + n or n + k), the batch a
    common prefix of all three and each group's letters in the same order wherever it occurs;
    every letter in two of the three terms. Contracted letters (k) may be several adjacent
    dims: they are then one long dimension (a weight gradient summed over batch and length)."""
    if subscripts.count("->") != 1 or subscripts.count(",") != 1 or "." in subscripts:
        return None
    inputs, c = subscripts.split("->")
    sa, sb = inputs.split(",")
    if len(sa) != len(a) or len(sb) != len(b) or any(len(set(s)) != len(s) for s in (sa, sb, c)):
        return None
    size = dict(zip(sa, a)) | dict(zip(sb, b))
    if any(size[x] != y for x, y in zip(sa, a)) or not set(c) <= set(sa) | set(sb):
        return None
    batch = "".join(x for x in c if x in sa and x in sb)
    ms = "".join(x for x in c if x in sa and x not in sb)
    ns = "".join(x for x in c if x in sb and x not in sa)
    ks = "".join(x for x in sa if x in sb and x not in c)
    if set(sa) | set(sb) != set(batch + ms + ns + ks) or c != batch + ms + ns:
        return None  # a letter summed within one operand alone, or C not batch + m + n
    if sa in (batch + ms + ks, batch + ks + ms) and sb in (batch + ks + ns, batch + ns + ks):
        ta, tb = sa != batch + ms + ks, sb != batch + ks + ns
        dims = tuple(size[x] for x in batch)
        m, n, k = (math.prod(size[x] for x in s) for s in (ms, ns, ks))
        return Product(dims, _contiguous(dims, m * k), _contiguous(dims, k * n), m, n, k, ta, tb)
    return None


def worth(p: Product | None) -> bool:
    """Whether sgemm should compute the product: large enough, and every offset within int32
    (the kernel's index arithmetic and sgemm's sizes)."""
    if p is None or min(p.m, p.n, p.k, p.entries) < 1:
        return False
    a = sum((e - 1) * s for e, s in zip(p.batch, p.a_strides)) + p.m * p.k
    b = sum((e - 1) * s for e, s in zip(p.batch, p.b_strides)) + p.k * p.n
    return p.flops >= MIN_FLOPS and max(a, b, p.entries * p.m * p.n) < 2**31


def _split(p: Product, threads: int) -> tuple[int, bool, int]:
    """How `kernel` deals out the work: (parts per batch entry, split along rows (else columns),
    rows or columns per part). Parts make the units (entries × parts) a multiple of the threads
    (8 entries, 3 threads: 3 parts each, 24 units of 8), each part a band of a multiple of `BAND`
    rows or columns of the larger side."""
    parts = threads // math.gcd(p.entries, threads)
    rows = p.m >= p.n
    side = p.m if rows else p.n
    chunk = min(side, -(-side // (parts * BAND)) * BAND)
    return -(-side // chunk), rows, chunk


def kernel(
    p: Product, a_shape: tuple[int, ...], b_shape: tuple[int, ...], c_shape: tuple[int, ...], threads: int
) -> tirx.PrimFunc:
    """C = A · B by `p`: thread th takes units th·share .. (th + 1)·share of entries × parts
    (`_split`), a unit's product one sgemm of its band of C straight from A and B."""
    parts, rows, chunk = _split(p, threads)
    units = p.entries * parts
    used = min(threads, units)
    share = -(-units // used)
    a, b, c = (tirx.decl_buffer(s, "float32", name) for s, name in ((a_shape, "a"), (b_shape, "b"), (c_shape, "c")))
    th, u = tirx.Var("th", "int32"), tirx.Var("u", "int32")
    entry, part = tirx.floordiv(u, parts), tirx.floormod(u, parts)
    a_at, b_at = tirx.const(0, "int32"), tirx.const(0, "int32")
    inner = 1
    for extent, sa, sb in reversed(list(zip(p.batch, p.a_strides, p.b_strides))):  # entry's index along each batch dim
        index = tirx.floormod(tirx.floordiv(entry, inner), extent)
        a_at, b_at, inner = a_at + index * sa, b_at + index * sb, inner * extent
    first = part * chunk
    c_at = entry * (p.m * p.n)
    if rows:
        m, n = tirx.min(chunk, p.m - first), tirx.const(p.n, "int32")
        a_at, c_at = a_at + first * (1 if p.ta else p.k), c_at + first * p.n
    else:
        m, n = tirx.const(p.m, "int32"), tirx.min(chunk, p.n - first)
        b_at, c_at = b_at + first * (p.k if p.tb else 1), c_at + first
    product = tirx.call_extern(
        "int32",
        GEMM,
        ROW_MAJOR,
        TRANS if p.ta else NO_TRANS,
        TRANS if p.tb else NO_TRANS,
        m,
        n,
        p.k,
        tirx.const(1.0, "float32"),
        a.access_ptr("r", offset=a_at),
        p.m if p.ta else p.k,
        b.access_ptr("r", offset=b_at),
        p.k if p.tb else p.n,
        tirx.const(0.0, "float32"),
        c.access_ptr("w", offset=c_at),
        p.n,
    )
    units_of = tirx.For(
        u, th * share, tirx.max(tirx.min(share, units - th * share), 0), tirx.ForKind.SERIAL, tirx.Evaluate(product)
    )
    body = tirx.For(th, 0, used, tirx.ForKind.PARALLEL, units_of)
    attrs = {"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": 8, FLOPS: p.flops, CALLS: "openblas"}
    return tirx.PrimFunc([a, b, c], body).with_attrs(attrs)


@functools.lru_cache(maxsize=1024)
def _kernel(
    p: Product, a_shape: tuple[int, ...], b_shape: tuple[int, ...], c_shape: tuple[int, ...], threads: int
) -> tirx.PrimFunc:
    """`kernel`, built once per process: `fold`'s einsums (a tuple of operands) are lowered
    afresh for every candidate, which `kernels._Remembered` cannot replay."""
    return kernel(p, a_shape, b_shape, c_shape, threads)


def _emit(bb: relax.BlockBuilder, call: relax.Call, p: Product, a: relax.Expr, b: relax.Expr, threads: int) -> relax.Expr:
    shapes = [tuple(int(d) for d in x.ty.shape) for x in (a, b, call)]
    gv = bb.add_func(_kernel(p.flattened(), *shapes, threads), "matmul_gemm")
    return relax.call_tir(gv, relax.Tuple([a, b]), out_ty=call.ty)


def matmul(bb: relax.BlockBuilder, call: relax.Call, *, fallback: Lowering, threads: int) -> relax.Expr:
    """`relax.matmul` through OpenBLAS, when float32, static and `worth` it."""
    a, b = (_static(x.ty) for x in call.args)
    out = _static(call.ty)
    p = of_matmul(a, b) if a is not None and b is not None and out is not None else None
    if not worth(p):
        return fallback(bb, call)
    assert p is not None
    return _emit(bb, call, p, call.args[0], call.args[1], threads)


def einsum(bb: relax.BlockBuilder, call: relax.Call, *, fallback: Lowering, threads: int) -> relax.Expr:
    """`relax.einsum` of two operands through OpenBLAS, when it is one product per batch entry
    (`of_einsum`: what `fold` writes), float32, static and `worth` it."""
    operands = call.args[0]
    while isinstance(operands, relax.Var):
        bound = bb.lookup_binding(operands)
        if bound is None:
            break
        operands = bound
    if not isinstance(operands, relax.Tuple) or len(operands.fields) != 2 or _static(call.ty) is None:
        return fallback(bb, call)
    a, b = (_static(x.ty) for x in operands.fields)
    p = of_einsum(str(call.attrs.subscripts), a, b) if a is not None and b is not None else None
    if not worth(p):
        return fallback(bb, call)
    assert p is not None
    return _emit(bb, call, p, operands.fields[0], operands.fields[1], threads)


def lowerings(threads: int) -> dict[str, Lowering]:
    """The lowerings `kernels.legalize` uses with OpenBLAS: products through sgemm, TVM's own
    lowering for the rest."""
    return {
        "relax.matmul": functools.partial(matmul, fallback=MATMUL_OP.get_attr("FLegalize"), threads=threads),
        "relax.einsum": functools.partial(einsum, fallback=EINSUM_OP.get_attr("FLegalize"), threads=threads),
    }


def limits() -> tuple[int, ...]:
    """What chooses among the kernels here: a kernel chosen under other limits is another kernel."""
    return (MIN_FLOPS, BAND)


_LETTERS = "abcdefgh"  # batch dims; m, n, k are i, j, k (and l, a 3-D activation's length)


def _swapped(value: relax.Expr) -> relax.Expr | None:
    """The tensor `value` transposes when it is `permute_dims` swapping the last two axes."""
    if not (isinstance(value, relax.Call) and value.op.same_as(PERMUTE_OP)):
        return None
    rank = len(value.ty.shape) if isinstance(value.ty, relax.TensorType) and value.ty.shape is not None else 0
    axes = value.attrs.axes
    if rank < 2 or axes is None or [int(x) for x in axes] != [*range(rank - 2), rank - 1, rank - 2]:
        return None
    return value.args[0]


def _folded(call: relax.Call, bound: dict[relax.Var, relax.Expr]) -> relax.Expr | None:
    """`matmul(permute_dims(x), b)` (either operand, or both) as the einsum of x, when every
    operand has C's batch dims or none (an einsum does not broadcast) and sgemm takes it."""
    terms, operands = [], []
    rank = len(call.ty.shape) - 2
    batch = _LETTERS[:rank]
    for arg, plain, swapped in ((call.args[0], "ik", "ki"), (call.args[1], "kj", "jk")):
        inner = _swapped(bound.get(arg)) if isinstance(arg, relax.Var) else None
        x = arg if inner is None else inner
        shape = _static(x.ty)
        if shape is None or len(shape) - 2 not in (0, rank):
            return None
        own = len(shape) - 2
        terms.append(batch[:own] + (plain if inner is None else swapped))
        operands.append(x)
    if operands[0] is call.args[0] and operands[1] is call.args[1]:
        return None  # nothing transposed: the matmul's own lowering takes it
    return _einsum_if_worth(operands, f"{terms[0]},{terms[1]}->{batch}ij")


def _collapsed(call: relax.Call, bound: dict[relax.Var, relax.Expr], uses: dict[relax.Var, int]) -> relax.Expr | None:
    """`collapse_sum_to(matmul(permute_dims(x), dy), [k, n])` with x [*batch, l, k] and dy
    [*batch, l, n] (a weight's gradient from a batched activation, the product used only
    there) as one einsum contracting batch and l: sgemm's K is then batch × l."""
    y = call.args[0]
    product = bound.get(y) if isinstance(y, relax.Var) and uses.get(y) == 1 else None
    if not (isinstance(product, relax.Call) and product.op.same_as(MATMUL_OP)):
        return None
    a, dy = product.args
    x = _swapped(bound.get(a)) if isinstance(a, relax.Var) else None
    out, shape = _static(call.ty), _static(product.ty)
    if x is None or out is None or shape is None or len(out) != 2 or len(shape) < 3 or out != shape[-2:]:
        return None
    rank = len(shape) - 2
    if len(x.ty.shape) != rank + 2 or len(dy.ty.shape) != rank + 2:
        return None  # a broadcast operand: not one long contraction
    batch = _LETTERS[:rank]
    return _einsum_if_worth([x, dy], f"{batch}li,{batch}lj->ij")


def _einsum_if_worth(operands: list[relax.Expr], subscripts: str) -> relax.Expr | None:
    """The einsum, when `einsum` below will lower it through sgemm: else TVM's einsum would
    take a product TVM's matmul computes faster, so the matmul stays."""
    shapes = [_static(x.ty) for x in operands]
    if any(s is None for s in shapes):
        return None
    a, b = shapes
    assert a is not None and b is not None
    return relax.op.einsum(relax.Tuple(operands), subscripts) if worth(of_einsum(subscripts, a, b)) else None


def _fold_function(func: relax.Function) -> relax.Function:
    """`func` with its bindings rewritten by `_folded` and `_collapsed`, each keeping its
    variable (an einsum has the product's type), and the transposes and products left unused
    removed. The bindings are read as they were: a collapse finds its product even when
    `_folded` rewrote that product too."""
    bindings = [b for block in func.body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)]
    bound = {b.var: b.value for b in bindings}
    uses: dict[relax.Var, int] = {}
    for v in [x for b in bindings for x in relax.analysis.free_vars(b.value)] + list(relax.analysis.free_vars(func.body.body)):
        uses[v] = uses.get(v, 0) + 1
    rewritten: dict[relax.Var, relax.Expr] = {}
    for binding in bindings:
        value = binding.value
        if not isinstance(value, relax.Call):
            continue
        new = None
        if value.op.same_as(MATMUL_OP) and isinstance(value.ty, relax.TensorType) and value.ty.shape is not None:
            new = _folded(value, bound)
        elif value.op.same_as(COLLAPSE_OP):
            new = _collapsed(value, bound, uses)
        if new is not None:
            rewritten[binding.var] = new
    if not rewritten:
        return func
    builder = relax.BlockBuilder()
    blocks = []
    for block in func.body.blocks:
        new_bindings = [
            relax.VarBinding(b.var, builder.normalize(rewritten[b.var])) if b.var in rewritten else b for b in block.bindings
        ]
        blocks.append(
            relax.DataflowBlock(new_bindings) if isinstance(block, relax.DataflowBlock) else relax.BindingBlock(new_bindings)
        )
    body = relax.SeqExpr(blocks, func.body.body)
    return relax.analysis.remove_all_unused(relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs))


@tvm.transform.module_pass(opt_level=0, name="planner.FoldTransposesIntoGemm")
def fold(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Every Relax function's products of transposes, and batched weight gradients, as the
    einsums sgemm computes without a copy (see the module's docstring)."""
    out = mod.clone()
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            out.update_func(gv, _fold_function(func))
    return out
