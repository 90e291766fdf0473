"""An embedding's SGD update applied to the rows the batch looked up, not to the whole table.

Relax differentiates `take` (an ONNX Gather of token ids) into `take_backward`, which TVM lowers
to a zero-filled table-sized gradient and a serial scatter-add into it; SGD then reads that
gradient and writes every row of the table anew. For a vocabulary of 30,522 by 768 that is three
passes over 94 MB to change the few hundred rows a batch of 2 x 128 tokens holds, and a 94 MB
gradient in the step's memory. PyTorch's `nn.Embedding(sparse=True)` with SGD touches only the hit
rows; `embedding_sgd` does the same inside the fused step.

What it replaces: `new = W - lr * take_backward(rows, W, ids, axis=0)` with the gradient read
by nothing else (plain SGD, one micro-batch, the table not tied to another use: a tied GPT-2 head
adds a dense gradient and keeps TVM's path). The kernel (`_kernel`) sums the rows of each id in
the order the batch holds them — the sum TVM's scatter-add forms — and subtracts each sum once: a padding id repeated hundreds of times is one rounding,
not hundreds. Momentum and Adam move every row's state each step (PyTorch's dense optimizers do
too) and stay dense.

Its scratch (the first position of each id, vocabulary-long int32, and one summed row per
position) is returned by the kernel, so the step's memory plan holds and counts it. In a step
that updates in place (`planner.backend.lower.inplace`) the kernel writes into the table itself
(`in_place`) and the table is never copied.
"""

from __future__ import annotations

import functools

import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from planner.backend.graph.tir import in_place_kernel
from planner.backend.tvmscript import parsed
from planner.runtime.convention import STEP_FUNC

SCATTER = "planner.scatter_update"  # kernel attribute: (vocab, hidden, count, id bits, threads); `in_place` applies
_TAKE_BACKWARD = tvm.ir.Op.get("relax.grad.take_backward")
_MULTIPLY = tvm.ir.Op.get("relax.multiply")
_SUBTRACT = tvm.ir.Op.get("relax.subtract")


def embedding_sgd(mod: tvm.IRModule, *, threads: int) -> tvm.IRModule:
    """`mod` with each SGD update of a looked-up table in the step done on its hit rows only
    (see the module's docstring); every other binding as it was."""
    if STEP_FUNC not in [gv.name_hint for gv in mod.get_global_vars()]:
        return mod
    step = mod[STEP_FUNC]
    blocks = step.body.blocks
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        return mod
    bindings = list(blocks[0].bindings)
    bound = {b.var: b.value for b in bindings}
    uses: dict[relax.Var, int] = {}
    for value in [*bound.values(), step.body.body]:
        for v in relax.analysis.free_vars(value):
            uses[v] = uses.get(v, 0) + 1
    params = set(step.params)
    builder = relax.BlockBuilder(mod)
    rewritten: dict[relax.Var, list[relax.Binding]] = {}
    for b in bindings:
        found = _match(b, bound, uses, params)
        if found is None:
            continue
        table, rows, ids, lr = found
        vocab, hidden = (int(d) for d in table.ty.shape)
        count = int(rows.ty.shape[0])
        func = _kernel(vocab, hidden, count, str(ids.ty.dtype), threads, copy=True)
        gv = builder.add_func(func, f"embedding_sgd_{vocab}x{hidden}_{count}")
        out_ty = [table.ty, relax.TensorType([vocab], "int32"), relax.TensorType([count, hidden], "float32")]
        call = relax.DataflowVar(f"{b.var.name}_rows", relax.TupleType(out_ty))
        rewritten[b.var] = [
            relax.VarBinding(call, relax.call_tir(gv, relax.Tuple([table, rows, ids, lr]), out_ty)),
            relax.VarBinding(b.var, relax.TupleGetItem(call, 0)),
        ]
    if not rewritten:
        return mod
    order = [new for b in bindings for new in rewritten.get(b.var, [b])]
    mod = builder.get()
    body = relax.SeqExpr([relax.DataflowBlock(order)], step.body.body)
    mod[STEP_FUNC] = relax.Function(step.params, body, step.ret_ty, step.is_pure, step.attrs)
    others = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function)]
    return relax.transform.DeadCodeElimination(others)(mod)


def _match(b: relax.Binding, bound: dict, uses: dict, params: set):
    """(table, rows, ids, lr) when `b` is `table - lr * take_backward(rows, table, ids, axis=0)` on
    a float32 step parameter, the gradient and its scaled form read nowhere else; else None."""
    new = b.value
    if not (isinstance(new, relax.Call) and new.op.same_as(_SUBTRACT)):
        return None
    table, scaled = new.args
    if not (table in params and scaled in bound and uses.get(scaled) == 1):
        return None
    mul = bound[scaled]
    if not (isinstance(mul, relax.Call) and mul.op.same_as(_MULTIPLY)):
        return None
    grad = next(
        (a for a in mul.args if a in bound and isinstance(bound[a], relax.Call) and bound[a].op.same_as(_TAKE_BACKWARD)), None
    )
    if grad is None or uses.get(grad) != 1:
        return None
    lr = mul.args[1] if mul.args[0].same_as(grad) else mul.args[0]
    back = bound[grad]
    rows, source, ids = back.args
    ty = table.ty
    if not (
        source.same_as(table)
        and int(back.attrs.axis) == 0
        and ty.dtype == rows.ty.dtype == "float32"
        and len(ty.shape) == 2
        and len(rows.ty.shape) == 2
        and len(ids.ty.shape) == 1
        and str(ids.ty.dtype) in ("int32", "int64")
        and isinstance(lr, relax.Var)
        and lr.ty.dtype == "float32"
        and len(lr.ty.shape) == 0
        and all(isinstance(d, tirx.IntImm) for d in [*ty.shape, *rows.ty.shape])
    ):
        return None
    return table, rows, ids, lr


def in_place(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The in-place form of an `embedding_sgd` kernel: the table is its first input and its
    output, the rows not looked up are not copied."""
    vocab, hidden, count, bits, threads = (int(v) for v in func.attrs[SCATTER])
    return _kernel(vocab, hidden, count, f"int{bits}", threads, copy=False)


@functools.lru_cache(maxsize=64)
def _kernel(vocab: int, hidden: int, count: int, ids: str, threads: int, *, copy: bool) -> tirx.PrimFunc:
    """`_kernel_script`, parsed once per shape (`planner.backend.tvmscript`)."""
    return parsed(_kernel_script, vocab, hidden, count, ids, threads, copy)


def _kernel_script(vocab: int, hidden: int, count: int, ids: str, threads: int, copy: bool) -> tirx.PrimFunc:
    """new[v] = table[v] - lr * (sum of rows[k] over k with ids[k] = v), v among the ids.

    `first[v]`: the first position holding id v. Each position's row is added into its id's
    first position's sum (`acc`), in the batch's order, the threads splitting the row's columns
    (no two write one element); then each first position subtracts its sum from its row of the
    table, the threads splitting the positions (no two hold one id). With `copy` the new table
    is a buffer of its own, every row copied first (split by rows); without, the table's own
    buffer (`in_place_kernel`)."""
    rows_share, cols_share, pos_share = (-(-n // threads) for n in (vocab, hidden, count))
    attrs = {
        "tirx.noalias": True,
        "tirx.is_scheduled": True,
        "op_pattern": 8,
        SCATTER: [vocab, hidden, count, int(ids[3:]), threads],
    }

    @T.prim_func(private=True, s_tir=True)  # (its annotations are TVMScript's, not types: ignored below)
    def embedding_sgd(
        table: T.Buffer((vocab, hidden), "float32"),  # type: ignore[valid-type]
        rows: T.Buffer((count, hidden), "float32"),  # type: ignore[valid-type]
        index: T.Buffer((count,), ids),  # type: ignore[valid-type]
        lr: T.Buffer((), "float32"),  # type: ignore[valid-type]
        new: T.Buffer((vocab, hidden), "float32"),  # type: ignore[valid-type]
        first: T.Buffer((vocab,), "int32"),  # type: ignore[valid-type]
        acc: T.Buffer((count, hidden), "float32"),  # type: ignore[valid-type]
    ):
        T.func_attr(attrs)
        with T.sblock("root"):
            if copy:  # (a Python bool: decided as the script is parsed)
                for th in T.parallel(threads):
                    for v in range(th * rows_share, T.min((th + 1) * rows_share, vocab)):
                        for j in range(hidden):
                            new[v, j] = table[v, j]
            for v in range(vocab):
                first[v] = -1
            for k in range(count):
                if first[index[k]] < 0:
                    first[index[k]] = k
            for th in T.parallel(threads):
                for k in range(count):
                    for j in range(th * cols_share, T.min((th + 1) * cols_share, hidden)):
                        if first[index[k]] == k:
                            acc[k, j] = rows[k, j]
                        else:
                            acc[first[index[k]], j] = acc[first[index[k]], j] + rows[k, j]
            for th in T.parallel(threads):
                for k in range(th * pos_share, T.min((th + 1) * pos_share, count)):
                    if first[index[k]] == k:
                        for j in range(hidden):
                            new[index[k], j] = table[index[k], j] - lr[()] * acc[k, j]

    func = embedding_sgd if copy else in_place_kernel(embedding_sgd, {0: 0}, 4)
    return func.with_attrs(attrs)
