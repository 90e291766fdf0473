"""The step's storages, shared by lifetime: planner's own assignment of tensors to storages.

TVM's static memory plan (`StaticPlanBlockMemory`) walks the step in program order and gives
each tensor a storage token, reusing a freed token of a roughly matching size (up to 16× larger).
A large token that takes a small tensor is then busy while a large tensor needs storage, and a
new one is allocated; over a long step, storages pile up. A recomputing MobileNetV2-w0.35@96 full
update at batch 8 planned 21.2 MiB for at most 11.5 MiB of tensors alive at once, and a step
unrolling 16 micro-batches held 11 storages of one activation's size where one micro-batch needs
two.

This pass reassigns, after that plan, every tensor it placed to a storage of planner's choosing:
greedy by size for shared objects (Pisarchyk & Lee, 2020; TensorFlow Lite's GPU delegate plans
this way): the largest tensor first, each into the smallest storage no tensor alive at the same
time is in, or into a new storage of its own size. Every tensor still starts at offset 0 of its
storage: the kernels assume it (they are compiled without the checks of a DLTensor's
`byte_offset`). The storages are allocated when the step starts and freed when it ends, so what
the step holds is their sum, whichever order the runtime's pooled allocator sees them in.
Tensors the step returns, and anything TVM did not plan, keep their own allocations.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax

_FOREVER = 1 << 62


@dataclass
class _Tensor:
    var: relax.Var
    nbytes: int
    start: int
    end: int


def _op(value: relax.Expr) -> str:
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""


def _nbytes(var: relax.Var) -> int:
    ty = var.ty
    n = 1
    for d in ty.shape.values:
        n *= int(d)
    dtype = tvm.runtime.DataType(str(ty.dtype))
    return max(1, n * ((dtype.bits * dtype.lanes + 7) // 8))  # a bool takes a byte


def _assign(tensors: list[_Tensor]) -> list[list[_Tensor]]:
    """Greedy by size: each tensor, largest first, into the smallest storage no tensor alive at the
    same time is in; a new storage when none is. A storage is its tensors, the first the largest."""
    storages: list[list[_Tensor]] = []
    for t in sorted(tensors, key=lambda t: (-t.nbytes, t.start)):
        free = [held for held in storages if all(u.end < t.start or t.end < u.start for u in held)]
        if free:
            min(free, key=lambda held: held[0].nbytes).append(t)
        else:
            storages.append([t])
    return storages


def _lifetimes(func: relax.Function, planned: set[relax.Var]) -> dict[relax.Var, _Tensor]:
    """Each tensor TVM placed in a storage, alive from its allocation to the last use of it, of a
    view of it or of a tuple that carries it; what the step returns lives to the end."""
    bindings = list(func.body.blocks[0].bindings)
    roots: dict[relax.Var, set[relax.Var]] = {}  # a var -> the planned tensors it may be
    tensors: dict[relax.Var, _Tensor] = {}
    for i, b in enumerate(bindings):
        value = b.value
        if _op(value) == "relax.memory.alloc_tensor" and value.args[0] in planned:
            tensors[b.var] = _Tensor(b.var, _nbytes(b.var), i, i)
            roots[b.var] = {b.var}
            continue
        used = (
            set().union(*(roots.get(v, set()) for v in relax.analysis.free_vars(value)))
            if isinstance(value, relax.Expr)
            else set()
        )
        for t in used:
            tensors[t].end = i
        # what the new var may be: a view, an alias, a tuple of tensors or an item of one
        if _op(value) == "relax.reshape" or isinstance(value, (relax.Var, relax.Tuple, relax.TupleGetItem)):
            if used:
                roots[b.var] = used
    for v in relax.analysis.free_vars(func.body.body):
        for t in roots.get(v, ()):
            tensors[t].end = _FOREVER
    return tensors


def share_storage(func: relax.Function) -> relax.Function:
    """`func` (the lowered step, after `KillAfterLastUse`) with its planned tensors reassigned
    to storages by lifetime (see the module docstring). Unchanged when it has more than one block
    or nothing planned."""
    if len(func.body.blocks) != 1:
        return func
    bindings = list(func.body.blocks[0].bindings)
    old = {b.var: b.value for b in bindings if _op(b.value) == "relax.memory.alloc_storage"}
    if not old:
        return func
    tensors = _lifetimes(func, set(old))
    storages = _assign(list(tensors.values()))
    _, _, scope, _ = next(iter(old.values())).args
    allocs, kills, home = [], [], {}
    for k, held in enumerate(storages):
        var = relax.Var(f"shared{k}", relax.ObjectType())
        size = relax.ShapeExpr([held[0].nbytes])
        allocs.append(relax.VarBinding(var, relax.op.memory.alloc_storage(size, 0, scope.value, "uint8")))
        kills.append(relax.VarBinding(relax.Var(f"freed{k}", relax.TupleType([])), relax.op.memory.kill_storage(var)))
        home.update({t.var: var for t in held})
    out = list(allocs)
    for b in bindings:
        op = _op(b.value)
        if b.var in old or (op == "relax.memory.kill_storage" and b.value.args[0] in old):
            continue
        if b.var in home:
            _, offset, shape, dtype, device = b.value.args
            b = relax.VarBinding(b.var, relax.op.memory.alloc_tensor(home[b.var], offset, shape, dtype, device))
        out.append(b)
    # freed after the step's last binding, before it returns
    block = relax.BindingBlock(out + kills)
    return relax.Function(func.params, relax.SeqExpr([block], func.body.body), func.ret_ty, func.is_pure, func.attrs)
