"""Peak training memory, by liveness over the step as the VM will run it.

`relax.analysis.estimate_memory_usage` adds up every allocation. This module replays the planned
step (after static memory planning and `KillAfterLastUse`) binding by binding: a storage is alive
from its allocation until it has been killed *and* every tensor carved out of it (or viewing one
of those) has been killed; tensors the step returns stay alive to the end.

The replay also runs TVM's pooled allocator (the VM's default): a freed storage goes back to a
pool of blocks of its page-rounded size and is reused only by an allocation of that size, and the
pool never returns memory. What the process holds is therefore the pool's high-water mark, which
sits between the ideal liveness peak and the plain sum; that is the number reported, because it
is what the board must have (tests/test_memory.py checks it against the allocator's real use).

Kernels also allocate scratch of their own — an unscheduled fused kernel keeps each intermediate
stage in a buffer, a transposed convolution dilates and pads its input — from TVM's workspace
pool, a second allocator that also never returns memory. Its sizes are constants in the compiled
code; `kernel_workspaces` reads them from the LLVM IR, and the replay runs the workspace pool's
own policy over the step's kernel calls (`scratch` in the breakdown).
"""

from __future__ import annotations

import re

import numpy as np
import tvm
from tvm import relax

from planner.types import MemoryBreakdown, StepSignature

PAGE = 4096  # TVM's pooled allocator (and its workspace pool) rounds every allocation up to whole pages
_WORKSPACE_CALL = re.compile(r"call ptr %[\w.]+\(i32 \d+, i32 %[\w.]+, i64 (\d+), i32 \d+, i32 \d+\)")
# a kernel's body: `<name>_compute_`, or the exported `__tvm_ffi_<name>` itself when it has no
# separate compute function (planner's library kernels allocate their workspace there)
_DEFINE = re.compile(r"^define [^@]*@\"?(?:__tvm_ffi_)?([\w.$]+?)(?:_compute_)?\"?\(", re.M)


def kernel_workspaces(llvm_ir: str) -> dict[str, list[int]]:
    """kernel name -> bytes of each workspace it allocates, in order, from the module's LLVM IR.

    TVM calls `TVMBackendAllocWorkspace` through a function pointer with constant sizes (static
    shapes); a kernel's body lives in `<name>_compute_`.
    """
    out: dict[str, list[int]] = {}
    starts = list(_DEFINE.finditer(llvm_ir))
    for m, nxt in zip(starts, starts[1:] + [None]):
        body = llvm_ir[m.end() : nxt.start() if nxt else len(llvm_ir)]
        sizes = [int(n) for n in _WORKSPACE_CALL.findall(body)]
        if sizes:
            out.setdefault(m.group(1), []).extend(sizes)
    return out


def _round(nbytes: int) -> int:
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def workspace_held(calls: list[str], workspaces: dict[str, list[int]]) -> int:
    """Bytes TVM's workspace pool holds after running `calls` (kernel names, in order).

    The pool's policy (src/runtime/workspace_pool.cc): take the smallest free block that fits,
    else grow the largest free block (freeing it and allocating anew), else allocate; a kernel
    frees its workspaces in reverse order and the blocks stay in the pool.
    """
    free: list[int] = []  # sizes of free blocks, ascending
    held = 0
    for name in calls:
        taken = []
        for need in map(_round, workspaces.get(name, ())):
            fit = next((i for i, size in enumerate(free) if size >= need), None)
            if fit is not None:
                taken.append(free.pop(fit))
            elif free:
                held += need - free.pop()
                taken.append(need)
            else:
                held += need
                taken.append(need)
        for size in reversed(taken):
            free.append(size)
            free.sort()
    return held


def tensor_bytes(shape, dtype: str) -> int:
    return int(np.prod([int(d) for d in shape], dtype=np.int64)) * np.dtype(str(dtype)).itemsize


def type_bytes(ty) -> int:
    """Bytes of a value of Relax type `ty` (a tensor, or a tuple of them); 0 when its shape is not static."""
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return tensor_bytes(ty.shape.values, ty.dtype)
    if isinstance(ty, relax.TupleType):
        return sum(type_bytes(f) for f in ty.fields)
    return 0


def _call_name(call: relax.Call) -> str:
    op = call.op
    return op.name if isinstance(op, tvm.ir.Op) else getattr(op, "name_hint", "")


def _gradient_vars(planned: relax.Function, trainable: list[relax.Var]) -> set[relax.Var]:
    """Step-allocated buffers that hold a gradient.

    After fusion, an update kernel reads the old parameter and, unless the gradient computation
    was fused into it, a buffer as large as that parameter: the gradient (for a weight stored as
    int8 codes, an fp32 one four times its bytes).
    """

    def gradient_bytes(p: relax.Var) -> int:
        coded = isinstance(p.ty, relax.TensorType) and p.ty.dtype == "int8"
        return type_bytes(p.ty) * (4 if coded else 1)

    sizes = {p: gradient_bytes(p) for p in trainable}
    grads: set[relax.Var] = set()
    for block in planned.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not (isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar)):
                continue
            ins = [a for a in value.args[:-1] if isinstance(a, relax.Var)]
            for param in (a for a in ins if a in sizes):
                grads.update(a for a in ins if a not in sizes and type_bytes(a.ty) == sizes[param])
    return grads


def parameter_bytes(planned: relax.Function, sig: StepSignature) -> tuple[list[relax.Var], int, int, int, int]:
    """The trainable vars and the bytes of each kind of step input (trainable, frozen, optimizer
    state, batch), in the step's parameter order: the same before compiling (`estimate`) and after."""
    params = list(planned.params)
    # Inputs to the step: the model's inputs..., frozen..., trainable..., states..., labels
    n_in, n_frozen, n_train, n_state = len(sig.inputs), len(sig.frozen), len(sig.trainable), len(sig.optim_states)
    frozen_b = sum(type_bytes(p.ty) for p in params[n_in : n_in + n_frozen])
    train_vars = params[n_in + n_frozen : n_in + n_frozen + n_train]
    train_b = sum(type_bytes(p.ty) for p in train_vars)
    state_b = sum(type_bytes(p.ty) for p in params[n_in + n_frozen + n_train : n_in + n_frozen + n_train + n_state])
    batch_b = sum(type_bytes(p.ty) for p in params[:n_in]) + type_bytes(params[-1].ty)
    return train_vars, frozen_b, train_b, state_b, batch_b


def step_peak(planned: relax.Function, sig: StepSignature, workspaces: dict[str, list[int]] | None = None) -> MemoryBreakdown:
    """Replay `planned` (the lowered `train_step`) and report its peak with a breakdown.

    `workspaces` (from `kernel_workspaces`) adds the kernels' own scratch.
    """
    train_vars, frozen_b, train_b, state_b, batch_b = parameter_bytes(planned, sig)
    grad_vars = _gradient_vars(planned, train_vars)

    pool_free: dict[int, int] = {}  # page-rounded size -> free blocks
    held = 0  # bytes the pooled allocator has taken from the system
    storage_size: dict[relax.Var, int] = {}
    holders: dict[relax.Var, set[relax.Var]] = {}  # storage -> vars keeping it alive
    owner: dict[relax.Var, relax.Var] = {}  # tensor or view -> its storage
    live = peak = peak_grad = 0
    calls: list[str] = []  # kernels in call order, for the workspace pool

    def allocate(storage: relax.Var, size: int) -> None:
        nonlocal live, held
        storage_size[storage], holders[storage] = size, {storage}
        live += size
        block = -(-size // PAGE) * PAGE
        if pool_free.get(block):
            pool_free[block] -= 1
        else:
            held += block

    def hold(var: relax.Var, source: relax.Var) -> None:
        owner[var] = source
        holders[source].add(var)

    def release(var: relax.Var) -> None:
        nonlocal live
        storage = var if var in storage_size else owner.pop(var, None)
        if storage is None or storage not in holders:
            return
        holders[storage].discard(var)
        if not holders[storage]:
            size = storage_size.pop(storage)
            live -= size
            block = -(-size // PAGE) * PAGE
            pool_free[block] = pool_free.get(block, 0) + 1
            del holders[storage]

    for block in planned.body.blocks:
        for binding in block.bindings:
            var, value = binding.var, binding.value
            if isinstance(value, relax.Var) and value in owner:  # alias
                hold(var, owner[value])
                continue
            if not isinstance(value, relax.Call):
                continue
            if isinstance(value.op, relax.GlobalVar):
                calls.append(value.op.name_hint)
            name = _call_name(value)
            if name == "relax.memory.alloc_storage":
                allocate(var, int(value.args[0].values[0]))
            elif name == "relax.memory.alloc_tensor":
                hold(var, value.args[0])
            elif name in ("relax.memory.kill_storage", "relax.memory.kill_tensor"):
                release(value.args[0])
            elif name == "relax.reshape" and value.args[0] in owner:  # a view: no copy
                hold(var, owner[value.args[0]])
            elif name == "relax.builtin.alloc_tensor":  # unplanned allocation: its own storage
                allocate(var, type_bytes(var.ty))
            if live > peak:
                peak = live
                peak_grad = sum(size for s, size in storage_size.items() if any(h in grad_vars for h in holders[s]))
    activations = max(held, peak) - peak_grad + batch_b
    scratch = workspace_held(calls, workspaces or {})
    return MemoryBreakdown(
        total=activations + peak_grad + train_b + state_b + frozen_b + scratch,
        activations=activations,
        trainable_params=train_b,
        gradients=peak_grad,
        optimizer_state=state_b,
        frozen_params=frozen_b,
        scratch=scratch,
    )
