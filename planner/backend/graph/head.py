"""A language model's last projection and its token cross-entropy, computed in chunks of tokens.

Why: a decoder's logits are `[batch, length, vocabulary]`, 50k-150k wide. GPT-2-small at length
256, batch 4 holds 206 MB of logits, and autodiff keeps as much again for the log-softmax its
backward reads and the logits' gradient: most of a LoRA step's memory, for one matmul. Here the
head's input `h` and weight `W` go to the loss instead of the logits (`find`, `split`), and the
loss (`cross_entropy`) walks the tokens in chunks: each chunk's logits, their log-sum-exp, the
chunk's share of the loss, the logits' gradient `(softmax - onehot) * share` and from it the
chunk's `dh = dlogits Wᵀ` (and `dW += hᵀ dlogits` if the head trains), then the chunk's
`[rows, vocabulary]` tensors are dead and the next chunk reuses their storage. At most one
chunk's logits exist at a time, in the forward pass or the backward.

Relax's gradient pass would keep every chunk's logits for its backward, so the gradient is
given, not derived: the loss returned is `L + Σ (h - no_grad(h)) · no_grad(dh) (+ the same
for W)`, whose value is exactly `L` (`h - h` is zero) and whose gradient with respect to `h` is
exactly `dh`; the chunks are under `no_grad`, which the gradient pass does not enter
(`planner.backend.graph.gradients`: `no_grad`'s own gradient is none). The marks are removed
after differentiation (`unmarked`), so `no_grad(x)` is `x` again and the matrix products fold
their transposes (`planner.backend.sgemm.matmul.fold`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.op.grad import no_grad

from planner.backend.graph.tir import cross_entropy_kernel
from planner.tasks import IGNORE_INDEX

# The logits one chunk holds at most (float32). Over this, the head is chunked. At GPT-2's
# vocabulary it is 80 tokens a chunk: matrix products of [80, 768] x [768, 50257], large enough
# for sgemm to run at speed, and each reads W once per chunk.
CHUNK_BYTES = 16 << 20
_ROW_MULTIPLE = 8  # the row blocks of sgemm's bands (`planner.backend.sgemm.matmul.BAND`)

_MATMUL = tvm.ir.Op.get("relax.matmul")
_ADD = tvm.ir.Op.get("relax.add")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_NO_GRAD = tvm.ir.Op.get("relax.grad.no_grad")


@dataclass(frozen=True)
class Head:
    """A function's output as `hidden @ weight (+ bias)`: the three values (variables of the
    function), whether `weight` is stored transposed (`[vocabulary, hidden]`, an embedding table
    the head is tied to), and whether weight and bias depend on a trained parameter."""

    hidden: relax.Var
    weight: relax.Var
    bias: relax.Var | None
    transposed: bool
    weight_trained: bool
    bias_trained: bool

    @property
    def outputs(self) -> tuple[relax.Var, ...]:
        return (self.hidden, self.weight) if self.bias is None else (self.hidden, self.weight, self.bias)


def rows(func: relax.Function) -> int | None:
    """The tokens a chunk of `func`'s output holds, or None when its whole logits are within
    `CHUNK_BYTES` (no chunking: one chunk is the plain loss). Chunks are as even as the row
    multiple lets them be."""
    shape = [int(d) for d in func.ret_ty.shape]
    n, vocab = math.prod(shape[:-1]), shape[-1]
    chunks = math.ceil(n * vocab * 4 / CHUNK_BYTES)
    if chunks < 2:
        return None
    each = math.ceil(math.ceil(n / chunks) / _ROW_MULTIPLE) * _ROW_MULTIPLE
    return each if each < n else None


def find(func: relax.Function, n_trainable: int) -> Head | None:
    """`func`'s output as a projection, `matmul(h, W)` or `matmul(h, W) + b` with `W` 2-D (or
    `matmul(h, permute_dims(E))`, a tied head), or None when it is anything else."""
    blocks = func.body.blocks
    if len(blocks) != 1 or not all(isinstance(b, relax.VarBinding) for b in blocks[0].bindings):
        return None
    value_of = {b.var: b.value for b in blocks[0].bindings}

    def through(e: relax.Expr) -> relax.Expr:  # a variable's value, aliases followed
        while isinstance(e, relax.Var) and e in value_of:
            e = value_of[e]
        return e

    def var(e: relax.Expr) -> relax.Expr:  # the last variable an alias chain names
        while isinstance(e, relax.Var) and isinstance(value_of.get(e), relax.Var):
            e = value_of[e]
        return e

    out = through(func.body.body)
    bias = None
    if isinstance(out, relax.Call) and out.op.same_as(_ADD):
        a, b = (through(x) for x in out.args)
        product, bias = (
            (out.args[0], out.args[1]) if isinstance(a, relax.Call) and a.op.same_as(_MATMUL) else (out.args[1], out.args[0])
        )
        out = through(product)
        bias = var(bias)
    if not (isinstance(out, relax.Call) and out.op.same_as(_MATMUL)):
        return None
    hidden, weight = (var(x) for x in out.args)
    if not (isinstance(hidden, relax.Var) and isinstance(weight, relax.Var)) or len(weight.ty.shape) != 2:
        return None
    if bias is not None and not (isinstance(bias, relax.Var) and [int(d) for d in bias.ty.shape] == [int(weight.ty.shape[1])]):
        return None
    transposed = False
    stored = value_of.get(weight)
    if isinstance(stored, relax.Call) and stored.op.same_as(_PERMUTE) and isinstance(var(stored.args[0]), relax.Var):
        weight, transposed = var(stored.args[0]), True
    if str(hidden.ty.dtype) != "float32" or str(weight.ty.dtype) != "float32":
        return None  # a low-precision head keeps the plain loss
    trained = set(func.params[len(func.params) - n_trainable :])
    for b in blocks[0].bindings:
        if any(v in trained for v in relax.analysis.free_vars(b.value)):
            trained.add(b.var)
    return Head(hidden, weight, bias, transposed, weight in trained, bias is not None and bias in trained)


def cross_entropy(
    bb: relax.BlockBuilder,
    head: Head,
    values: list[relax.Var],
    labels: relax.Var,
    chunk: int,
    scale: relax.Expr,
    kernels: dict[relax.GlobalVar, tvm.tirx.PrimFunc],
) -> relax.Var:
    """The mean cross-entropy of `hidden @ W (+ b)` over the tokens whose label is not
    `IGNORE_INDEX`, `chunk` tokens at a time, with its gradient given (see the module); `values`
    are the loss function's own variables for `head.outputs`; `scale` multiplies the loss and
    so the gradient (fp16 loss scaling). The kernel each chunk's shape calls
    (`tir.cross_entropy_kernel`) is put in `kernels`, for the caller to add to its module."""
    op = relax.op
    hidden, weight = values[0], values[1]
    bias = values[2] if head.bias is not None else None
    width = int(hidden.ty.shape[-1])
    vocab = int(weight.ty.shape[0 if head.transposed else 1])
    n = math.prod([int(d) for d in hidden.ty.shape][:-1])
    h = bb.emit(op.reshape(hidden, (n, width)))
    h_ = bb.emit(no_grad(h))
    w_ = bb.emit(no_grad(weight))
    b_ = bb.emit(no_grad(bias)) if bias is not None else None
    product = bb.emit(op.permute_dims(w_)) if head.transposed else w_  # [hidden, vocabulary]
    back = w_ if head.transposed else bb.emit(op.permute_dims(w_))  # [vocabulary, hidden]

    y = bb.emit(op.reshape(labels, (n,)))
    counted = bb.emit(op.not_equal(y, relax.const(IGNORE_INDEX, "int64")))
    y = bb.emit(op.where(counted, y, bb.emit(op.zeros_like(y))))  # an index every row has
    weights = bb.emit(op.astype(counted, "float32"))
    count = bb.emit(op.maximum(bb.emit(op.sum(weights)), relax.const(1.0)))
    share = bb.emit(op.multiply(op.divide(weights, count), scale))  # each token's share of the loss

    loss = dw = db = None
    parts = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)

        def sliced(x: relax.Expr, start: int = start, end: int = end) -> relax.Var:
            return bb.emit(op.strided_slice(x, axes=[0], begin=[start], end=[end]))

        hc, yc, sc = sliced(h_), sliced(y), sliced(share)
        logits = bb.emit(op.matmul(hc, product))
        if b_ is not None:
            logits = bb.emit(op.add(logits, b_))
        kernel = cross_entropy_kernel(end - start, vocab)
        gv = next((g for g, f in kernels.items() if f.same_as(kernel)), None) or bb.add_func(
            kernel, kernel.attrs["global_symbol"]
        )
        kernels[gv] = kernel
        both = bb.emit(
            relax.call_tir_inplace(
                gv, relax.Tuple([logits, yc, sc]), [0, -1], [logits.ty, relax.TensorType((end - start,), "float32")]
            )
        )
        dlogits = bb.emit(relax.TupleGetItem(both, 0))  # the logits' buffer, overwritten (`tir.cross_entropy_kernel`)
        part = bb.emit(op.sum(relax.TupleGetItem(both, 1)))
        loss = part if loss is None else bb.emit(op.add(loss, part))
        parts.append(bb.emit(op.matmul(dlogits, back)))
        if head.weight_trained:  # stored [hidden, vocabulary], or [vocabulary, hidden] for a tied table
            g = bb.emit(op.matmul(op.permute_dims(dlogits), hc) if head.transposed else op.matmul(op.permute_dims(hc), dlogits))
            dw = g if dw is None else bb.emit(op.add(dw, g))
        if head.bias_trained:
            g = bb.emit(op.sum(dlogits, axis=0))
            db = g if db is None else bb.emit(op.add(db, g))
    assert loss is not None, "a batch has a token at least"
    dh = bb.emit(op.concat(parts, axis=0)) if len(parts) > 1 else parts[0]

    def given(x: relax.Var, x_: relax.Var, dx: relax.Var) -> relax.Var:
        """A zero whose gradient with respect to `x` is `dx`."""
        return bb.emit(op.sum(op.multiply(op.subtract(x, x_), no_grad(dx))))

    total = bb.emit(op.add(no_grad(loss), given(h, h_, dh)))
    if dw is not None:
        total = bb.emit(op.add(total, given(weight, w_, dw)))
    if db is not None and bias is not None and b_ is not None:
        total = bb.emit(op.add(total, given(bias, b_, db)))
    return total


@relax.expr_functor.mutator
class _Unmarked(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        return call.args[0] if isinstance(call.op, tvm.ir.Op) and call.op.same_as(_NO_GRAD) else call


def unmarked(func: relax.Function) -> relax.Function:
    """`func` with every `no_grad(x)` read as `x`: after differentiation the mark is an identity
    that would hide a transpose from the matrix products that fold it."""
    return relax.transform.CanonicalizeBindings()(tvm.IRModule({"f": _Unmarked().visit_expr(func)}))["f"]
