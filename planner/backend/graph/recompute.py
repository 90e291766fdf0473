"""Recomputation: which activations the backward pass keeps, and which it computes again.

A step normally keeps every activation its backward pass reads from the forward pass until the
backward pass reads it; for a full update that is most of the step's memory. Relax's gradient pass
can recompute instead (Chen et al., "Training deep nets with sublinear memory cost", 2016): a
tensor marked `R.grad.start_checkpoint` is kept, and every tensor computed from marked tensors
(not from the function's own inputs directly) is dropped after its forward use and computed again,
from the nearest kept tensors, when the backward pass first needs it. This module places the marks:

- a list of layers keeps the input activation of each listed layer (the tensor it reads);
- `auto` chooses the kept activations that minimise the step's peak by a dynamic programme over
  the step's own tensor sizes (`choose`), among the places where the network is one tensor wide
  (the inputs of residual blocks, not their insides, where the skip tensor would be recomputed
  as well as kept).

The step's own inputs (the input batch, or what the frozen prefix hands over) are marked too, so
nothing computed after them is kept unless a listed layer reads it. Training is the same
computation in the same order, only done twice: the results are bit-for-bit those without
recomputation (tests/test_recompute.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tvm import relax

from planner.backend.graph.estimate import live_peak, tensor_key
from planner.backend.graph.memory import tensor_bytes
from planner.errors import CandidateFailed

FLOW = 2  # gradients alive beside a segment's saved activations, in its widest activation's bytes
WORTH = 0.75  # recompute only for an estimated backward peak at most this share of keeping everything, by
# the liveness `worth` reads: ResNet-8 at 32x32, batch 16 (0.71: its compiled peak falls by more than 20 %)
# and a ViT block (0.68) recompute; the tiny test CNN (0.82) and the bundled example (0.91), where the
# backward pass reads nearly every activation anyway, do not


@dataclass(frozen=True)
class _Tensor:
    var: relax.Var
    position: int  # index of its binding in the function's one dataflow block
    nbytes: int


def _bytes(var: relax.Var) -> int:
    ty = var.ty
    if isinstance(ty, relax.TensorType) and ty.shape is not None and isinstance(ty.shape, relax.ShapeExpr):
        return tensor_bytes(ty.shape.values, ty.dtype)
    return 0


def _bindings(func: relax.Function) -> list[relax.VarBinding]:
    blocks = func.body.blocks
    if len(blocks) != 1 or not all(isinstance(b, relax.VarBinding) for b in blocks[0].bindings):
        raise CandidateFailed("recomputation needs the differentiated function as one dataflow block")
    return list(blocks[0].bindings)


def _activations(func: relax.Function, n_inputs: int) -> list[_Tensor]:
    """The function's bindings computed from its inputs (not from weights alone), in order."""
    bindings = _bindings(func)
    derived = set(func.params[:n_inputs])
    out = []
    for i, b in enumerate(bindings):
        if any(v in derived for v in relax.analysis.free_vars(b.value)):
            derived.add(b.var)
            out.append(_Tensor(b.var, i, _bytes(b.var)))
    return out


def layer_inputs(func: relax.Function, n_inputs: int, owners: Mapping[relax.Var, str]) -> dict[str, relax.Var]:
    """layer name -> the activation it reads, for every layer whose parameters the function
    takes (`owners`: weight parameter -> its layer).

    A layer's input is the activation operand of the first op that combines one of the layer's
    parameters (or a value rebuilt from them alone: a dequantized or concatenated weight) with
    an activation. The function's inputs count as activations.
    """
    bindings = _bindings(func)
    activation = set(func.params[:n_inputs])
    of_layer: dict[relax.Var, str] = dict(owners)  # vars computed from one layer's parameters alone
    found: dict[str, relax.Var] = {}
    for b in bindings:
        used = list(relax.analysis.free_vars(b.value))
        acts = [v for v in used if v in activation]
        layers = {of_layer[v] for v in used if v in of_layer}
        if acts:
            activation.add(b.var)
            for layer in layers:
                found.setdefault(layer, acts[0])
        elif len(layers) == 1 and all(v in of_layer for v in used):
            of_layer[b.var] = layers.pop()
    return found


def cut_points(func: relax.Function, n_inputs: int) -> set[relax.Var]:
    """Activations that are alone where they are: every activation computed up to and including
    one of them that is still needed after it is that one itself. Keeping such a tensor splits
    the network in two with nothing else to keep or recompute across the cut."""
    acts = _activations(func, n_inputs)
    position = {t.var: t.position for t in acts}
    bindings = _bindings(func)
    last_use: dict[relax.Var, int] = {}
    for i, b in enumerate(bindings):
        for v in relax.analysis.free_vars(b.value):
            if v in position:
                last_use[v] = i
    end = len(bindings)
    for v in relax.analysis.free_vars(func.body.body):
        if v in position:
            last_use[v] = end
    points = set()
    open_after: set[relax.Var] = set()  # activations defined so far and used later
    for t in acts:
        open_after = {v for v in open_after if last_use.get(v, -1) > t.position}
        if last_use.get(t.var, -1) > t.position:
            open_after.add(t.var)
        if open_after == {t.var}:
            points.add(t.var)
    return points


def choose(func: relax.Function, n_inputs: int, candidates: Iterable[relax.Var], saved: set[relax.Var]) -> list[relax.Var]:
    """The kept activations, among `candidates`, that minimise the estimated peak of the step.

    The estimate (Chen et al.'s): with kept activations k1 < k2 < … splitting the activations
    into segments, the backward pass of segment j holds the kept tensors up to its own and the
    segment's recomputed activations that the backward pass reads (`saved`, found by the
    gradient pass itself), so the peak is max_j (Σ_{i≤j} |k_i| + |saved in segment j|).
    A dynamic programme over the candidates in order keeps, for each last kept tensor, the
    Pareto set of (bytes kept so far, worst segment so far), and returns the choice with the
    smallest peak (on a tie, the fewest bytes kept). Not keeping anything is one choice: one
    segment, the whole network recomputed once. Whether the choice is worth its time is `worth`'s
    call, on the step's own liveness.
    """
    acts = _activations(func, n_inputs)
    inputs = sum(_bytes(v) for v in func.params[:n_inputs])
    wanted = set(candidates)
    order = [t for t in acts if t.var in wanted]
    prefix = [0]  # prefix[i]: bytes of the saved activations before acts[i]
    for t in acts:
        prefix.append(prefix[-1] + (t.nbytes if t.var in saved else 0))
    index = {t.var: i for i, t in enumerate(acts)}

    def segment(start: int | None, stop: int | None) -> int:
        """Bytes strictly between two kept activations (None: the inputs, the end)."""
        lo = 0 if start is None else index[start] + 1
        hi = len(acts) if stop is None else index[stop]
        widest = max((t.nbytes for t in acts[lo : hi + 1]), default=0)
        return prefix[hi] - prefix[lo] + FLOW * widest

    # frontier[j]: Pareto-optimal (kept, worst, choice) with order[j] the last kept tensor
    start: list[tuple[int, int, tuple[relax.Var, ...]]] = [(inputs, 0, ())]
    frontier: list[list[tuple[int, int, tuple[relax.Var, ...]]]] = []
    for j, t in enumerate(order):
        options = [(kept + t.nbytes, max(worst, kept + segment(None, t.var)), (t.var,)) for kept, worst, _ in start]
        for i in range(j):
            for kept, worst, chosen in frontier[i]:
                options.append((kept + t.nbytes, max(worst, kept + segment(order[i].var, t.var)), (*chosen, t.var)))
        frontier.append(_pareto(options))
    finals = [(max(worst, kept + segment(None, None)), kept, chosen) for kept, worst, chosen in start]
    for i, options in enumerate(frontier):
        finals += [(max(worst, kept + segment(order[i].var, None)), kept, chosen) for kept, worst, chosen in options]
    return list(min(finals, key=lambda f: (f[0], f[1]))[2])


def worth(keeping: relax.Function, recomputing: relax.Function) -> bool:
    """Whether recomputation brings the backward pass's peak to `WORTH` of keeping every
    activation, by the liveness estimate a search screens budgets with (`planner.backend.graph.estimate`)
    over the two gradient functions: else it costs time for nothing (a small CNN whose every
    activation the backward pass reads anyway)."""
    weights = {k for v in keeping.params if (k := tensor_key(v)) is not None}
    return live_peak(recomputing, weights, in_place=True).bytes <= WORTH * live_peak(keeping, weights, in_place=True).bytes


def _pareto(options: list[tuple[int, int, tuple]]) -> list[tuple[int, int, tuple]]:
    options.sort(key=lambda o: (o[0], o[1]))
    kept_best: list[tuple[int, int, tuple]] = []
    for o in options:
        if not kept_best or o[1] < kept_best[-1][1]:
            kept_best.append(o)
    return kept_best
