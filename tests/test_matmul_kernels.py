"""Matrix products through OpenBLAS (`planner.backend.sgemm.matmul`) compute what TVM's own unscheduled
lowering computes: 2-D, batched × 2-D (flattened into one product), batched × batched with the
same or broadcast batch dims, every transpose folded into sgemm's flags, batched weight
gradients as one product, the einsums that are one product; odd and even sizes, 1-sized dims,
1, 2 and 3 threads. A kernel broken on purpose (a wrong leading dimension, every thread on the
same band) fails the same comparison."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax

from planner.backend.graph import gradients
from planner.backend.lower import kernels
from planner.backend.lower.kernels import legalize
from planner.backend.lower.schedule import default_schedule
from planner.backend.sgemm import matmul
from planner.runtime.libraries import load_openblas
from planner.types import Kernels


def _target(cores: int | None) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", **({"num-cores": cores} if cores else {})})


def _swap(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2])


def _swap_axes(rank: int) -> list[int]:
    return [*range(rank - 2), rank - 1, rank - 2]


def _products(a: tuple[int, ...], b: tuple[int, ...], ta: bool, tb: bool) -> tvm.IRModule:
    """main(x, y) = matmul(x or its transpose, y or its transpose): x stored transposed when `ta`
    (as Relax's gradients write it: `permute_dims` of the last two axes), y when `tb`."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(_swap(a) if ta else a, "float32"))
    y = relax.Var("y", relax.TensorType(_swap(b) if tb else b, "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            lhs = bb.emit(relax.op.permute_dims(x, _swap_axes(len(a)))) if ta else x
            rhs = bb.emit(relax.op.permute_dims(y, _swap_axes(len(b)))) if tb else y
            out = bb.emit_output(bb.emit(relax.op.matmul(lhs, rhs)))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod: tvm.IRModule) -> set[str]:
    return {gv.name_hint.rstrip("0123456789_") for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def _results(mod: tvm.IRModule, target: tvm.target.Target, func: str = "main", seed: int = 0) -> tuple[list, list, tvm.IRModule]:
    """`func` of `mod` on random inputs, lowered by TVM (unscheduled) and by planner with
    OpenBLAS (scheduled): both results, flattened, and planner's lowered module."""
    assert load_openblas() is not None
    rng = np.random.default_rng(seed)
    args = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in mod[func].params]
    mine = legalize(target, Kernels.OPENBLAS)(mod)
    with target:
        scheduled = default_schedule()(mine)
    results = []
    # planner's first: a buffer the pooled allocator handed back from TVM's run would already
    # hold the right answer wherever a kernel failed to write
    for m in (scheduled, relax.transform.LegalizeOps()(mod)):
        vm = relax.VirtualMachine(relax.build(m, target), tvm.cpu())
        out = vm[func](*map(tvm.runtime.tensor, args))
        results.append([t.numpy() for t in _leaves(out)])
    return results[1], results[0], mine


def _leaves(value) -> list:
    if isinstance(value, tvm.runtime.Tensor):
        return [value]
    return [leaf for v in value for leaf in _leaves(v)]


def _assert_close(theirs: list, mine: list) -> None:
    for want, got in zip(theirs, mine):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


SHAPES = [
    ((5, 7), (7, 3)),  # odd
    ((8, 16), (16, 4)),  # even
    ((1, 9), (9, 1)),  # one row, one column
    ((6, 1), (1, 5)),  # K = 1
    ((37, 65), (65, 130)),  # bands of BAND rows, a short last one
    ((3, 5, 7), (7, 4)),  # batched x 2-D: one product, the batch flattened into the rows
    ((2, 3, 5, 7), (7, 6)),
    ((4, 6), (2, 6, 5)),  # 2-D x batched: the weight on the left
    ((2, 3, 9, 4), (2, 3, 4, 9)),  # attention's [B, H, L, D] x [B, H, D, L]
    ((3, 1, 5), (3, 5, 2)),  # batched, M = 1
    ((2, 1, 5, 4), (1, 3, 4, 6)),  # broadcast batch dims, both ways
    ((3, 5, 4), (1, 4, 6)),  # a broadcast size-1 batch
]


@pytest.mark.parametrize("a, b", SHAPES, ids=["x".join(map(str, a)) + "@" + "x".join(map(str, b)) for a, b in SHAPES])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)], ids=["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("cores", [1, 2, 3], ids=["cores-1", "cores-2", "cores-3"])
def test_openblas_products_equal_tvms_lowering(monkeypatch, a, b, ta, tb, cores):
    """Every product through sgemm (the size threshold off), transposes folded into its flags
    wherever every operand has the product's batch dims or none (an einsum does not broadcast)."""
    monkeypatch.setattr(matmul, "MIN_FLOPS", 0)
    mod = _products(a, b, ta, tb)
    theirs, mine, lowered = _results(mod, _target(cores))
    _assert_close(theirs, mine)
    kernels = _kernels(lowered)
    assert "matmul" not in kernels and "matmul_gemm" in kernels, kernels  # TVM's own lowering took none
    # an einsum names each batch dim once: both operands have the same batch dims, or the
    # batch of A (untransposed) flattens into the rows of a 2-D B
    folds = a[:-2] == b[:-2] or (len(b) == 2 and not ta)
    assert any(k.startswith("transpose") for k in kernels) == ((ta or tb) and not folds), kernels


def _weight_gradient(batch: tuple[int, ...], length: int, k: int, n: int) -> tvm.IRModule:
    """loss = sum((x @ w) * r) for x [*batch, length, k], and its gradients by x and w."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((*batch, length, k), "float32"))
    w = relax.Var("w", relax.TensorType((k, n), "float32"))
    r = relax.Var("r", relax.TensorType((*batch, length, n), "float32"))
    with bb.function("main", [x, w, r]):
        with bb.dataflow():
            loss = bb.emit_output(bb.emit(relax.op.sum(relax.op.multiply(relax.op.matmul(x, w), r))))
        bb.emit_func_output(loss)
    with gradients.installed():
        return relax.transform.Gradient("main", require_grads=[x, w])(bb.get())


@pytest.mark.parametrize("batch, length, k, n", [((8,), 16, 12, 20), ((3,), 7, 5, 9), ((2, 3), 5, 4, 6), ((1,), 1, 3, 2)])
@pytest.mark.parametrize("cores", [2, 3], ids=["cores-2", "cores-3"])
def test_a_batched_weight_gradient_is_one_product(monkeypatch, batch, length, k, n, cores):
    """dW = Σ_b x_bᵀ · dy_b, which Relax writes as a product per batch entry and a collapse_sum,
    is one sgemm contracting batch and length: forward, input gradient and weight gradient are
    three kernels, and no sum is left."""
    monkeypatch.setattr(matmul, "MIN_FLOPS", 0)
    mod = _weight_gradient(batch, length, k, n)
    folded = matmul.fold(mod)["main_adjoint"]
    assert "R.einsum" in str(folded) and "collapse_sum_to" not in str(folded) and "permute_dims" not in str(folded)
    theirs, mine, lowered = _results(mod, _target(cores), "main_adjoint")
    _assert_close(theirs, mine)
    called = [c for c in str(lowered["main_adjoint"]).split("R.call_tir(")[1:] if c.startswith("matmul_gemm")]
    assert len(called) == 3, called
    assert not any(k.startswith(("collapse_sum", "transpose", "einsum")) for k in _kernels(lowered))


def _attention(b: int, h: int, length: int, d: int) -> tvm.IRModule:
    """loss = sum(((q @ kᵀ) @ v) * r) over [b, h, length, d] heads, and its gradients by q, k and v."""
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(name, relax.TensorType((b, h, length, d), "float32")) for name in "qkv")
    r = relax.Var("r", relax.TensorType((b, h, length, d), "float32"))
    with bb.function("main", [q, k, v, r]):
        with bb.dataflow():
            scores = relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2]))
            out = relax.op.matmul(scores, v)
            loss = bb.emit_output(bb.emit(relax.op.sum(relax.op.multiply(out, r))))
        bb.emit_func_output(loss)
    with gradients.installed():
        return relax.transform.Gradient("main", require_grads=[q, k, v])(bb.get())


@pytest.mark.parametrize("b, h, length, d", [(2, 3, 9, 4), (1, 2, 16, 8), (3, 1, 5, 7)])
def test_attention_and_its_gradients_equal_tvms_lowering(monkeypatch, b, h, length, d):
    """Both products of attention and their four gradient products, each with a transposed
    operand, are sgemm calls reading the untransposed tensors."""
    monkeypatch.setattr(matmul, "MIN_FLOPS", 0)
    theirs, mine, lowered = _results(_attention(b, h, length, d), _target(3), "main_adjoint")
    _assert_close(theirs, mine)
    kernels = _kernels(lowered)
    assert "matmul_gemm" in kernels and not any(
        k.startswith(("transpose", "matmul", "einsum")) and k != "matmul_gemm" for k in kernels
    )


EINSUMS = [
    ("ij,jk->ik", (5, 7), (7, 3)),
    ("ji,jk->ik", (7, 5), (7, 3)),  # A transposed
    ("ij,kj->ik", (5, 7), (3, 7)),  # B transposed
    ("ji,kj->ik", (7, 5), (3, 7)),
    ("bij,bjk->bik", (2, 5, 7), (2, 7, 3)),
    ("bji,bkj->bik", (2, 7, 5), (2, 3, 7)),
    ("abli,ablj->ij", (2, 3, 5, 4), (2, 3, 5, 6)),  # contracted over batch and length: K = 30
    ("bij,jk->bik", (3, 5, 7), (7, 4)),  # flattened into one product
    ("ij,jk->ki", (5, 7), (7, 3)),  # C transposed: not one product
    ("bij,bjk->ik", (2, 5, 7), (2, 7, 3)),  # contracted letters apart in A: not one product
    ("ij,jk->i", (5, 7), (7, 3)),  # k summed within B alone: not one product
    ("bij,jk->ik", (2, 5, 7), (7, 3)),  # b summed within A alone
]


@pytest.mark.parametrize("subscripts, a, b", EINSUMS, ids=[s for s, _, _ in EINSUMS])
def test_einsums_equal_tvms_lowering(monkeypatch, subscripts, a, b):
    """An einsum that is one product per batch entry goes through sgemm; any other keeps
    TVM's einsum."""
    monkeypatch.setattr(matmul, "MIN_FLOPS", 0)
    bb = relax.BlockBuilder()
    x, y = relax.Var("x", relax.TensorType(a, "float32")), relax.Var("y", relax.TensorType(b, "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.einsum((x, y), subscripts)))
        bb.emit_func_output(out)
    theirs, mine, lowered = _results(bb.get(), _target(2))
    _assert_close(theirs, mine)
    gemm = matmul.of_einsum(subscripts, list(a), list(b)) is not None
    assert ("matmul_gemm" in _kernels(lowered)) == gemm
    assert ("einsum" in _kernels(lowered)) != gemm


def test_small_products_keep_tvms_lowering():
    """Below `MIN_FLOPS` the library call costs more than it saves: TVM's kernel stays, and
    so does the transpose fold's original form."""
    small = _products((8, 12), (12, 10), False, True)
    lowered = legalize(_target(2), Kernels.OPENBLAS)(small)
    assert "matmul_gemm" not in _kernels(lowered) and "matmul" in _kernels(lowered)
    assert "einsum" not in str(matmul.fold(small))
    large = _products((64, 32), (32, 48), False, True)
    assert "matmul_gemm" in _kernels(legalize(_target(2), Kernels.OPENBLAS)(large))


@pytest.mark.parametrize(
    "m, n, entries, threads", [(37, 130, 1, 3), (1024, 128, 1, 2), (9, 9, 6, 4), (128, 512, 32, 2), (3, 2, 1, 8)]
)
def test_the_split_covers_every_output_once(m, n, entries, threads):
    """`_split`'s bands of each batch entry cover its rows (or columns) exactly, none empty."""
    p = matmul.Product((entries,), (m * 5,), (5 * n,), m, n, 5, False, False)
    parts, rows, chunk = matmul._split(p, threads)
    side = m if rows else n
    assert rows == (m >= n)
    assert chunk % matmul.BAND == 0 or chunk == side
    assert (parts - 1) * chunk < side <= parts * chunk


def _broken(kind: str):
    """`matmul.kernel` with one mistake: A's leading dimension one short, or every thread
    computing the first thread's share."""

    def build(*args):
        func = matmul.kernel(*args)

        def call(c):
            if not (isinstance(c.op, tvm.ir.Op) and c.op.name == "tirx.call_extern"):
                return c
            values = list(c.args)
            if kind == "lda":
                values[9] = values[9] - 1  # (GEMM's name, order, ta, tb, m, n, k, alpha, A, lda, ...)
            return tvm.ir.Call(c.op, values, ret_ty=c.ty)

        body = tvm_ffi.structural_map(func.body, (tvm.ir.Call, call))
        if kind == "threads":  # thread th's units are thread 0's
            first = tvm.tirx.const(0, "int32")
            units = tvm_ffi.structural_map(body.body, (tvm.ir.Var, lambda v: first if v.same_as(body.loop_var) else v))
            body = tvm.tirx.For(body.loop_var, body.min, body.extent, body.kind, units)
        return func.with_body(body)

    return build


@pytest.mark.parametrize("kind", ["lda", "threads"])
def test_a_broken_kernel_fails_the_comparison(monkeypatch, kind):
    """The comparison above catches a kernel that reads A with the wrong stride, or leaves
    every share but the first thread's unwritten."""
    monkeypatch.setattr(kernels._Remembered, "memo", type(kernels._Remembered.memo)())  # lowered afresh
    monkeypatch.setattr(matmul, "MIN_FLOPS", 0)
    monkeypatch.setattr(matmul, "_kernel", _broken(kind))
    # inputs of their own: the last test's output, left where this one's is allocated, must not
    # be this one's answer
    seed = ["lda", "threads"].index(kind) + 1
    theirs, mine, lowered = _results(_products((37, 20), (20, 24), False, False), _target(2), seed=seed)
    assert "matmul_gemm" in _kernels(lowered)
    with pytest.raises(AssertionError):
        _assert_close(theirs, mine)
