"""Updates that overwrite their weights: each optimizer update runs as soon as its gradient exists,
inside the backward pass, and writes the new weight (and optimizer state) over the old one.

Why: a functional training step returns new weights in fresh buffers, so every trainable weight
(and every optimizer state) exists twice by the end of the step, and an update whose gradient is
not fused into it keeps that gradient alive until it runs. The 256 KB training engine and
PockEngine apply each update right after its gradient and free both at once. Here fusion already
merges most weight gradients into their updates; this pass, on the fused step, moves every update
to the earliest point where its inputs exist *and* nothing else still reads the weight it replaces,
then turns it into a `call_tir_inplace` whose kernel stores into the old weight's buffer.

Only an update kernel that reads the old value at exactly the element it writes (elementwise, which
every SGD / momentum / Adam update is) and reads it nowhere after is rewritten; anything else keeps
its copy. The caller's weight tensors are overwritten by the step, which is what a training loop
wants: the returned weights are the same tensors, updated.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

from planner.backend.graph.tir import in_place_kernel
from planner.backend.lower import sparse
from planner.runtime.convention import STEP_FUNC
from planner.types import StepSignature


def _is_call_tir(value: relax.Expr) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.call_tir"


def _elementwise_over(func: tirx.PrimFunc, source: int, output: int) -> bool:
    """Whether the kernel reads parameter `source` only at the element it then writes to `output`
    (0-based over all parameters), and never after — so `output` may live in `source`'s buffer.

    Judged on the unscheduled kernel, each stage a block of its own: every stage elementwise
    over one domain (each element of a stage's output computed from the same element of the
    source and of stages computed from it; other values read anyhow), `output` the only
    parameter written. Then element i of the output depends on every read of the source's element i, so
    however the kernel is scheduled each element is read before it is overwritten. (Adam's new
    moment is `b * m + (1 - b) * g` in three stages.)"""
    src, out = func.params[source], func.params[output]
    # read-only walk: an s_tir.Schedule here would rewrite the module's kernels in place
    blocks: list[s_tir.stmt.SBlock] = []
    tvm_ffi.structural_walk(func.body, [(s_tir.stmt.SBlock, blocks.append)], order="pre")
    if not blocks or blocks[0].name_hint != "root" or len(blocks) == 1:
        return False
    blocks = blocks[1:]

    def at_element(region, block: s_tir.stmt.SBlock) -> bool:
        return len(region.region) == len(block.iter_vars) and all(
            r.extent.value == 1 and r.min.same_as(iv.var) for r, iv in zip(region.region, block.iter_vars)
        )

    def extents(block: s_tir.stmt.SBlock) -> list[int]:
        return [int(iv.dom.extent) for iv in block.iter_vars]

    written = [w.source for b in blocks for w in b.writes]
    params = [p for p in func.params if any(w.same_as(p) for w in written)]
    if len(params) != 1 or not params[0].same_as(out):
        return False
    tainted = [src]  # the source and every stage computed from it
    for b in blocks:
        reads = [r for r in b.reads if any(r.source.same_as(t) for t in tainted)]
        if not reads:  # computed from other inputs alone (Adam's bias corrections): any shape
            continue
        stage = (
            b.init is None
            and len(b.writes) == 1
            and at_element(b.writes[0], b)
            and all(iv.iter_type == tirx.IterVar.DataPar for iv in b.iter_vars)
            and extents(b) == [int(d) for d in src.shape]
            and all(at_element(r, b) for r in reads)
        )
        if not stage:
            return False
        tainted.append(b.writes[0].source)
    return True


def _updates(mod: tvm.IRModule, sig: StepSignature):
    """Yield, for each value the step returns updated, `(old param, call binding, output k, getter)`
    when a kernel call computes it from the old value (getter: the TupleGetItem binding, if any)."""
    step = mod[STEP_FUNC]
    if len(step.body.blocks) != 1 or not isinstance(step.body.blocks[0], relax.DataflowBlock):
        return
    bindings = step.body.blocks[0].bindings
    bound = {b.var: b for b in bindings}
    first = len(sig.inputs) + len(sig.frozen)  # the step takes `*inputs, *frozen, *trainable, *states, labels`
    updated = list(step.params[first : first + len(sig.trainable) + len(sig.optim_states)])
    result = bound[step.body.body].value if step.body.body in bound else step.body.body
    if not isinstance(result, relax.Tuple) or len(result.fields) != 1 + len(updated):
        return
    for old, new in zip(updated, result.fields[1:]):
        k, getter = 0, None
        if new in bound and isinstance(bound[new].value, relax.TupleGetItem):
            getter = bound[new]
            k, new = getter.value.index, getter.value.tuple_value
        if new in bound and _is_call_tir(bound[new].value) and old in list(bound[new].value.args[1].fields):
            yield old, bound[new], k, getter


def in_place_candidates(fused: tvm.IRModule, sig: StepSignature) -> set[tuple[str, int, int]]:
    """`(kernel, input, output)` of the step's update kernels that may write `output` into
    `input`'s buffer, judged on the fused, not yet scheduled module (each stage still a block of
    its own); call it before scheduling, which may rewrite the kernels in place."""
    found = set()
    for old, binding, k, _ in _updates(fused, sig):
        call = binding.value
        args = list(call.args[1].fields)
        kernel = call.args[0].name_hint
        scatter = fused[kernel].attrs.get(sparse.SCATTER) and (args.index(old), k) == (0, 0)
        if scatter or _elementwise_over(fused[kernel], args.index(old), len(args) + k):
            found.add((kernel, args.index(old), len(args) + k))
    return found


def update_in_place(mod: tvm.IRModule, sig: StepSignature, candidates: set[tuple[str, int, int]]) -> tuple[tvm.IRModule, int]:
    """The scheduled step `mod` with its updates moved up and done in place; also how many were.

    The step's parameters are `*inputs, *frozen, *trainable, *states, labels` and it returns
    `(loss, *new trainable, *new states)`; a returned value whose kernel is among `candidates`
    (from `in_place_candidates` on the same step before scheduling) overwrites its old value. The
    kernels keep their schedules (and tuning records); only their output buffer changes.
    """
    plans: dict[int, dict[int, int]] = {}  # call binding index -> {output k: argument index}
    getters: dict[int, list[int]] = {}  # call binding index -> TupleGetItem bindings of its outputs
    step = mod[STEP_FUNC]
    found = list(_updates(mod, sig))
    if not found:
        return mod, 0
    bindings = list(step.body.blocks[0].bindings)
    index = {b.var: i for i, b in enumerate(bindings)}
    for old, binding, k, getter in found:
        args = list(binding.value.args[1].fields)
        if (binding.value.args[0].name_hint, args.index(old), len(args) + k) not in candidates:
            continue
        at = index[binding.var]
        plans.setdefault(at, {})[k] = args.index(old)
        if getter is not None:
            getters.setdefault(at, []).append(index[getter.var])

    if not plans:
        return mod, 0
    # an update whose new value feeds another kernel (momentum's velocity feeds the weight's
    # update) stays where it is; the others move
    last = index.get(step.body.body)  # the result tuple's binding, kept last
    moves = {
        at
        for at in plans
        if not {i for i, b in enumerate(bindings) if bindings[at].var in relax.analysis.free_vars(b.value)}
        - set(getters.get(at, []))
        - {last}
    }
    builder = relax.BlockBuilder(mod)  # gives the new kernels' GlobalVars their types
    moving = moves | {g for at in moves for g in getters.get(at, [])} | {last}
    order = [b for i, b in enumerate(bindings) if i not in moving]
    reads = _reads(mod, bindings)
    for at in sorted(plans):
        call = bindings[at].value
        args = list(call.args[1].fields)
        overwritten = {args[i] for i in plans[at].values()}
        needs = set(relax.analysis.free_vars(call)) & set(index)
        # earliest point where its inputs exist and no other binding will still read the old values
        after = max([i for i, b in enumerate(order) if b.var in needs or overwritten & reads(b)], default=-1)
        ks = plans[at]
        outs = call.ty.fields if isinstance(call.ty, relax.TupleType) else [call.ty]
        indices = [ks.get(k, -1) for k in range(len(outs))]
        func = mod[call.args[0]]
        kernel = sparse.in_place(func) if func.attrs.get(sparse.SCATTER) else in_place_kernel(func, ks, len(args))
        gv = builder.add_func(kernel, f"{call.args[0].name_hint}_inplace")
        new_call = relax.op.call_tir_inplace(gv, call.args[1], indices, list(outs) if len(outs) > 1 else outs[0])
        if at not in moves:
            order[order.index(bindings[at])] = relax.VarBinding(bindings[at].var, new_call)
            continue
        moved = [relax.VarBinding(bindings[at].var, new_call)] + [bindings[g] for g in sorted(getters.get(at, []))]
        order[after + 1 : after + 1] = moved
    if last is not None:
        order.append(bindings[last])
    if not _safe(order, step.params, reads):
        return mod, 0
    block = relax.DataflowBlock(order)
    mod = builder.get()
    mod[STEP_FUNC] = relax.Function(step.params, relax.SeqExpr([block], step.body.body), step.ret_ty, step.is_pure, step.attrs)
    return relax.transform.DeadCodeElimination([STEP_FUNC, *_others(mod)])(mod), sum(map(len, plans.values()))


def _reads(mod: tvm.IRModule, bindings: list[relax.Binding]) -> Callable[[relax.Binding], set[relax.Var]]:
    """A binding's reads, a view counted as a read of the tensor it views.

    Why: lowering turns a kernel that only reshapes (a BatchNorm scale expanded to (C, 1, 1),
    a squeeze) into a view of its input's buffer (`RewriteDataflowReshape`). A kernel reading
    the view after the viewed weight was overwritten would read the new weight; with
    recomputation, a backward pass reads such views of weights it has already updated.
    """
    viewed: dict[relax.Var, relax.Var] = {}
    for b in bindings:
        value = b.value
        if _is_call_tir(value) and len(value.args[1].fields) == 1:
            (source,) = value.args[1].fields
            if isinstance(source, relax.Var) and relax.analysis.has_reshape_pattern(mod[value.args[0]]):
                viewed[b.var] = viewed.get(source, source)

    def reads(b: relax.Binding) -> set[relax.Var]:
        found = set(relax.analysis.free_vars(b.value))
        return found | {viewed[v] for v in found if v in viewed}

    return reads


def _safe(order: list[relax.Binding], params, reads: Callable[[relax.Binding], set[relax.Var]]) -> bool:
    """Every value defined before it is read, and no old value read (itself or through a view)
    after it was overwritten."""
    defined = set(params)
    overwritten: set[relax.Var] = set()
    for b in order:
        if reads(b) & overwritten or not set(relax.analysis.free_vars(b.value)) <= defined:
            return False
        defined.add(b.var)
        value = b.value
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.call_tir_inplace":
            args = list(value.args[1].fields)
            overwritten |= {args[i] for i in value.attrs.inplace_indices if i >= 0}
    return True


def _others(mod: tvm.IRModule) -> list[str]:
    """The module's Relax functions besides the step (the predict function stays an entry)."""
    return [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, relax.Function) and gv.name_hint != STEP_FUNC]
