"""Peak training memory estimated from the training graph, before anything is compiled.

A compile (fusion, scheduling, memory planning, code generation, linking) costs seconds; the
graph it starts from (`build_training_module`) costs a fraction of one. A search under a RAM
budget asks first what this module says, and compiles only the candidates it does not put
clearly over the budget (`planner.search.evaluate`); `recompute: auto` decides with the same
numbers.

What the estimate counts:

- the step's inputs — batch, frozen and trainable parameters, optimizer state — exactly, from
  their shapes, as the compiled plan does;
- what the step computes, by liveness over the unscheduled training function: each binding's
  result (in whole pages, as TVM's allocator hands them out) is alive from the binding that makes
  it to the last binding that reads it (or a view of it: a reshape, a tuple item, a transposed
  weight), the step's results to the end; the peak is the largest sum of live bytes at any
  binding. What a compiled step is known to fuse is counted as fused: a weight's gradient and
  its update live for one kernel (an update in place costs nothing), and a gradient summed over
  positions is one product (`planner.backend.sgemm.matmul`).

What it cannot see: fusion beyond the patterns above (an elementwise chain's intermediate results,
which a compiled kernel never stores, are counted one at a time), TVM's pooled allocator (a freed
block is reused only by an allocation of its own page-rounded size, so the process holds more
than the ideal liveness peak) and the kernels' workspaces. How far these move it is measured
against the compiled figure over the PyTorch families (`benchmarks/memory_estimate.py`; worst
0.925x to 1.36x, 2.27x on a 150 KB sensor CNN whose workspaces are half its step) and held by
tests/test_pytorch_families.py as `LOW`, `HIGH` and `SLACK`; a search treats a candidate as over
budget only when `LOW` times its estimate is.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import tvm
from tvm import relax

from planner.backend._base import MemoryEstimate
from planner.backend.graph.memory import PAGE, parameter_bytes, type_bytes
from planner.types import Candidate, MemoryBreakdown, StepSignature, Updates

# ops that lower to views of their input (no copy of their own)
_VIEWS = frozenset({"relax.reshape", "relax.squeeze", "relax.expand_dims", "relax.flatten"})
# How far the compiled plan's total lies from the estimate over the PyTorch families (docs/benchmarks.md;
# tests/test_pytorch_families.py holds it): LOW * estimate <= compiled <= HIGH * estimate + SLACK. The
# slack is the kernels' workspaces and the allocator's per-size pools, which the graph does not show
# and which dominate only a model of a few hundred KiB.
LOW, HIGH, SLACK = 0.85, 1.4, 128 * 1024


def tensor_key(v: relax.Var) -> tuple | None:
    """A tensor's shape and dtype: what tells a weight's gradient and update from an activation."""
    ty = v.ty
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return tuple(int(d) for d in ty.shape.values), str(ty.dtype)
    return None


@dataclass(frozen=True)
class Peak:
    """The largest sum of live bytes a function computes, and how much of it is weight-shaped."""

    bytes: int
    gradients: int


def live_peak(func: relax.Function, weights: set[tuple], *, in_place: bool, copied: AbstractSet[tuple] = frozenset()) -> Peak:
    """Liveness over `func`'s bindings (unscheduled Relax): each result is alive from the binding
    that makes it to the last that reads it or a view of it (a reshape, a tuple item); the
    function's results to the end.

    `weights` are the (shape, dtype) of the trained weights. A compiled step fuses each weight's
    gradient with its update, so the chain of weight-shaped values that ends in a result (a
    gradient, its scaled copy, the new weight or optimizer state) lives for one kernel, not until
    the optimizer's turn at the end of the unscheduled function; `in_place`: a new weight or
    state written over the old one's buffer, which the caller already counts, costs nothing —
    except the results keyed in `copied` (new int8 codes, computed from the fp32 update, not
    over the old codes), which live to the end.
    """
    bindings = [b for block in func.body.blocks for b in block.bindings]
    position = {b.var: i for i, b in enumerate(bindings)}
    params = set(func.params)
    root: dict[relax.Var, relax.Var] = {}  # a view or alias -> the tensor whose bytes it is
    size: dict[relax.Var, int] = {}
    last: dict[relax.Var, int] = {}
    uses: dict[relax.Var, int] = {}
    for b in bindings:
        for v in relax.analysis.free_vars(b.value):
            uses[v] = uses.get(v, 0) + 1
    for i, b in enumerate(bindings):
        value = b.value
        used = [root.get(v, v) for v in relax.analysis.free_vars(value)]
        op = value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""
        if op == "relax.collapse_sum_to" and uses.get(value.args[0]) == 1 and value.args[0] in size:
            # a weight's gradient from a 3-D activation: one sgemm summing over the batch
            # (`planner.backend.sgemm.matmul`), the per-position products never stored
            size[value.args[0]] = 0
        # a transposed weight is read in place by the kernel it is fused into (a Linear's `x @ W.T`)
        transposed = op == "relax.permute_dims" and root.get(value.args[0], value.args[0]) in params
        if isinstance(value, relax.Var | relax.TupleGetItem | relax.Tuple) or op in _VIEWS or transposed:
            sources = [u for u in used if u in size]
            if len(sources) == 1:
                root[b.var] = sources[0]
        else:  # TVM's allocator hands out whole pages: on a small model they are much of the step
            size[b.var] = -(-type_bytes(b.var.ty) // PAGE) * PAGE
        for u in used:
            last[u] = i
    results: set[relax.Var] = set()
    todo = list(relax.analysis.free_vars(func.body.body))
    while todo:  # the results, through the tuples that gather them
        v = todo.pop()
        value = bindings[position[v]].value if v in position else None
        if isinstance(value, relax.Tuple):
            todo += [u for f in value.fields for u in relax.analysis.free_vars(f)]
        else:
            results.add(root.get(v, v))
    for v in results:
        last[v] = len(bindings)
    chain: set[relax.Var] = set()
    todo = [v for v in results if tensor_key(v) in weights]
    while todo:
        v = todo.pop()
        if v in chain or v not in position:
            continue
        chain.add(v)
        todo += [root.get(u, u) for u in relax.analysis.free_vars(bindings[position[v]].value) if tensor_key(u) in weights]
    for v in chain:
        last[v] = (
            -1 if in_place and v in results and tensor_key(v) not in copied else len(bindings) if v in results else position[v]
        )

    ends: dict[int, list[relax.Var]] = {}
    for v, at in last.items():
        if v in size:
            ends.setdefault(at, []).append(v)
    live = peak = peak_weights = 0
    alive: set[relax.Var] = set()
    for i, b in enumerate(bindings):
        if b.var in size and last.get(b.var, i) != -1:
            alive.add(b.var)
            live += size[b.var]
        if live > peak:
            peak, peak_weights = live, sum(size[v] for v in alive if tensor_key(v) in weights)
        for v in ends.get(i, ()):
            if v in alive:
                alive.discard(v)
                live -= size[v]
    return Peak(peak, peak_weights)


def estimate(step: relax.Function, sig: StepSignature, candidate: Candidate) -> MemoryEstimate:
    """The peak memory of `step` (`build_training_module`'s `train_step`) before compiling it."""
    trainable, frozen_b, train_b, state_b, batch_b = parameter_bytes(step, sig)
    weights = {k for p in trainable if (k := tensor_key(p)) is not None}
    coded = {(shape, dtype) for shape, dtype in weights if dtype == "int8"}
    weights |= {(shape, "float32") for shape, _ in coded}  # codes update through fp32
    peak = live_peak(step, weights, in_place=candidate.updates is Updates.IN_PLACE, copied=coded)
    activations = peak.bytes - peak.gradients + batch_b
    total = activations + peak.gradients + train_b + state_b + frozen_b
    memory = MemoryBreakdown(
        total=total,
        activations=activations,
        trainable_params=train_b,
        gradients=peak.gradients,
        optimizer_state=state_b,
        frozen_params=frozen_b,
    )
    return MemoryEstimate(memory, int(total * LOW))
