"""Candidate -> Relax training module.

The module holds two functions, both with the batch fixed to the candidate's batch size:

- `train_step(x, *frozen, *trainable, *optim_states, labels) -> (loss, *new_trainable, *new_states)`:
  forward, the task's mean loss (`planner.tasks`), backward and the optimizer update as ONE function, so the whole step
  is timed, planned for memory and shipped to a board as a unit. The last optimizer state is the
  learning rate, returned unchanged: one compiled step serves every lr of a candidate;
- `backbone(x, *frozen, *trainable) -> outputs`: inference, for evaluation.

Frozen parameters are passed as *inputs* of the backbone (`relax.training` only differentiates
`param_num` trailing parameters), so they get no gradient and no optimizer state, and every
gradient they would have needed is dead code. BatchNorm is decomposed in inference form before
differentiation: frozen and trainable BN layers both use running statistics (scale and bias train).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import tvm
from tvm import relax
from tvm.relax.training import SetupTrainer

from planner.backend.graph import adapters, head, recompute
from planner.backend.graph import gradients as grads
from planner.backend.graph.bands import banded
from planner.backend.graph.importer import BUILDING, imported
from planner.backend.graph.rewrites import fake_quantized_values
from planner.backend.graph.tir import accumulate_kernel, scale_kernel
from planner.backend.graph.trainer import TaskLoss, fill, low_precision, make_optimizer, runtime_lr, update_lr
from planner.backend.graph.weights import as_stored, coded_params, dequantized_at_use, requantized, stored_weights
from planner.errors import CandidateFailed, PlannerBug, last_line
from planner.inputs.model import Model
from planner.runtime.convention import PREDICT_FUNC, STEP_FUNC
from planner.runtime.weights import origin
from planner.types import Candidate, Recompute, StepSignature


def build_training_module(model: Model, candidate: Candidate, *, bands: bool = False) -> tuple[tvm.IRModule, StepSignature]:
    """The candidate's training module (unlegalized) and the signature of its step; with `bands`,
    its frozen first layers computed in row bands where that lowers its peak (`backend.bands`:
    for a microcontroller's SRAM). One build at a time in a process (`importer.BUILDING`)."""
    with BUILDING:  # an int8 candidate's model fake-quantizes its activations
        mod, sig = _build(model.for_precision(candidate.precision), candidate, bands)
    return fake_quantized_values(mod), sig


@grads.installed()  # for the whole build: which ops have a gradient also decides the frozen prefix
def _build(model: Model, candidate: Candidate, bands: bool) -> tuple[tvm.IRModule, StepSignature]:
    how = stored_weights(model, candidate)
    frozen, trainable = how.frozen, how.trainable
    if not trainable:
        raise CandidateFailed("candidate freezes every layer: nothing to train")

    B = candidate.batch_size
    if model.fixed_batch not in (None, B):
        raise CandidateFailed(f"model has a fixed batch size {model.fixed_batch}; cannot use batch {B}")
    source = imported(model, B)
    func = source.func
    n_inputs = len(model.inputs)
    names = list(model.initializers)
    if how.layouts or how.quantized:
        func, names = as_stored(func, n_inputs, names, how)
        func = adapters.factored(func)
    xs, pvars = func.params[:n_inputs], func.params[n_inputs:]
    by_name = dict(zip(names, pvars))
    params = [*xs] + [by_name[n] for n in frozen] + [by_name[n] for n in trainable]
    func = relax.Function(params, func.body, func.ret_ty, func.is_pure, func.attrs)
    func = func.with_attr("global_symbol", PREDICT_FUNC)
    backbone = inference_form(source.with_kernels({PREDICT_FUNC: func}, {"param_num": len(trainable), "state_num": 0}))
    backbone, loss_scale = low_precision(backbone, candidate.precision, PREDICT_FUNC)

    optimizer = make_optimizer(candidate)
    target = model.target
    labels = relax.TensorType((B, *target.static), target.dtype)
    full = backbone[PREDICT_FUNC]
    if bands:  # before the split: the bands are frozen layers, so they go into the frozen prefix
        full = banded(full, n_inputs, len(trainable)).with_attr("global_symbol", PREDICT_FUNC)
    prefix, differentiated = _frozen_prefix(full, n_inputs, len(trainable))

    def differentiate(func: relax.Function) -> tvm.IRModule:
        func, loss = _with_loss(func, model, loss_scale, len(trainable))
        try:
            trainer = SetupTrainer(loss, optimizer, [*_types(func.ret_ty), labels], legalize=False)(
                source.with_kernels({PREDICT_FUNC: func}, backbone.attrs)
            )
        except Exception as exc:  # every op of the model is one the operator table says trains or runs frozen
            raise PlannerBug("the gradient of a model the operator table accepts could not be built", last_line(exc)) from None
        if loss.head is not None:
            trainer["backbone_loss_adjoint"] = head.unmarked(trainer["backbone_loss_adjoint"])
        return loss.with_kernels(trainer)

    kept: tuple[str, ...] = ()
    n_leading = n_inputs if prefix is None else len(prefix.ret_ty.fields)  # the differentiated part's non-weight inputs
    if candidate.recompute != Recompute.NONE:
        differentiated, kept = _recomputing(model, candidate, differentiated, n_leading, [*frozen, *trainable], differentiate)
    differentiated = _weights_rebuilt_in_backward(differentiated, n_leading)
    trainer = differentiate(differentiated)

    lr_dtype = str(optimizer.dtype)
    step, state_types, kernels = _fused_step(
        trainer, prefix, full.params[:n_inputs], len(trainable), lr_dtype, candidate.grad_accum, (trainable, how.coded)
    )
    out = source.with_kernels({PREDICT_FUNC: _coded_predict(full, trainable, how.coded), STEP_FUNC: step})
    for gv, kernel in kernels.items():
        out[gv] = kernel
    sig = StepSignature(
        inputs=model.inputs,
        batch_size=B * candidate.grad_accum,
        micro_batch=B,
        frozen=tuple(frozen),
        trainable=how.signed_trainable,
        layouts=how.layouts,
        quantized=how.quantized | how.coded,
        loss_scale=loss_scale,
        optim_states=(
            *((tuple(int(d) for d in t.shape), str(t.dtype), fill(init)) for t, init in zip(state_types, optimizer.state)),
            ((), lr_dtype, update_lr(candidate, loss_scale)),
        ),
        n_classes=model.n_classes,
        kept=kept,
        task=model.task.name,
        output=model.output.static,
        batched_output=model.output.batched,
        target=target,
        activations=dict(model.calibration or {}) if model.int8 else {},
    )
    return out, sig


def _coded_predict(full: relax.Function, trainable: list[str], coded: dict[str, int]) -> relax.Function:
    """The predict function taking the coded trained weights as the step does: codes and scales."""
    if not coded:
        return full
    n = len(full.params) - len(trainable)
    _, taken, rebuild = coded_params(list(full.params[n:]), coded, trainable)
    return dequantized_at_use(full, [*full.params[:n], *taken], rebuild)


def _with_loss(func: relax.Function, model: Model, scale: float, n_trainable: int) -> tuple[relax.Function, TaskLoss]:
    """`func` and the loss it trains with: the task's, or — for a token cross-entropy whose
    logits are over `head.CHUNK_BYTES` and come from a projection — `func` giving the
    projection's input and weight instead, and the loss computing them in chunks
    (`planner.backend.graph.head`)."""
    chunk = head.rows(func) if model.task.token_cross_entropy else None
    found = head.find(func, n_trainable) if chunk is not None else None
    if chunk is None or found is None:
        return func, TaskLoss(model.task, scale)
    params = [relax.Var(v.name, v.ty) for v in func.params]
    mapping = dict(zip(func.params, params))
    split = _function(PREDICT_FUNC, params, list(func.body.blocks[0].bindings), relax.Tuple(found.outputs), mapping, several=True)
    split = relax.analysis.remove_all_unused(split)  # the logits
    return split.with_attr("global_symbol", PREDICT_FUNC), TaskLoss(model.task, scale, found, chunk)


def _types(ty: relax.Type) -> list[relax.Type]:
    return list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]


def inference_form(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with its ops in the form the gradient pass differentiates: BatchNorm (and any op with
    a training form) decomposed as inference computes it, read through without a tuple.

    Why the reading through: BatchNorm decomposes into `(y, mean, var)[0]`, a tuple between its
    output and the next op, which fusion does not look through, so every ReLU6 after a BatchNorm
    was a kernel of its own in the prediction function — kernels of no use to the step, compiled
    for every candidate (a third of a classifier-only MobileNetV2 candidate's). Read through, the
    prediction function's kernels are the step's forward kernels."""
    mod = relax.transform.DecomposeOpsForInference()(mod)
    return relax.transform.CanonicalizeBindings()(mod)


def _recomputing(
    model: Model,
    candidate: Candidate,
    func: relax.Function,
    n_inputs: int,
    stored: list[str],
    differentiate: Callable[[relax.Function], tvm.IRModule],
) -> tuple[relax.Function, tuple[str, ...]]:
    """`func(*inputs, *weights)` (`stored`: the weights' names) with its inputs and the kept
    activations marked for the gradient pass: the inputs of the layers `candidate.recompute`
    lists, or those `recompute.choose` picks for `auto` (`differentiate`: the gradient pass).
    Also returns the layers whose inputs are kept, in model order."""
    layer_of = {p: layer.name for layer in model.layers for p in layer.param_shapes}
    weights = func.params[n_inputs:]
    owners = {v: layer_of[origin(n)] for v, n in zip(weights, stored) if origin(n) in layer_of}
    inputs = recompute.layer_inputs(func, n_inputs, owners)
    if candidate.recompute == Recompute.AUTO:
        cuts = recompute.cut_points(func, n_inputs) & set(inputs.values())
        keeping = differentiate(_copy(func, numbered=_FORWARD))["backbone_loss_adjoint"]
        chosen = set(recompute.choose(func, n_inputs, cuts, _saved(func, keeping)))
        marked = _copy(func, kept=frozenset([*func.params[:n_inputs], *chosen]))
        if not recompute.worth(keeping, differentiate(marked)["backbone_loss_adjoint"]):
            return func, ()  # nothing to gain: the step keeps every activation
    else:
        # a listed layer before the first trained one reads an activation the backward pass never needs
        chosen = {inputs[model.layer(name).name] for name in candidate.recompute if model.layer(name).name in inputs}
    layers = tuple(name for name, var in inputs.items() if var in chosen and var not in func.params[:n_inputs])
    return _copy(func, kept=frozenset([*func.params[:n_inputs], *chosen])), layers


def _weights_rebuilt_in_backward(func: relax.Function, n_inputs: int) -> relax.Function:
    """`func(*inputs, *weights)` with every value computed from weights alone (a dequantized
    int8 weight, a ratio-split weight concatenated, W + B·A of a LoRA adapter, a BatchNorm's
    scale) computed again where the backward pass needs it instead of kept from the forward pass.

    Why: the backward pass reads each weight again for the gradient of its layer's input; a
    rebuilt weight kept for that lives at fp32 from its forward use to its backward one, so int8
    storage held more than fp32 storage did (MobileNetV2-w0.35 at 64², first and last layers
    trained, batch 4: 7.89 MiB against 7.20 MiB). The weights these values come from are marked
    `start_checkpoint` and the values read by activations `end_checkpoint`, so the gradient pass
    keeps every activation as before and recomputes only the rebuilds (see
    `planner.backend.graph.recompute`).
    """
    inputs = set(func.params[:n_inputs])
    activation: set[relax.Var] = set(inputs)
    weight_only: set[relax.Var] = set()
    started: set[relax.Var] = set()
    ended: set[relax.Var] = set()
    for b in func.body.blocks[0].bindings:
        used = set(relax.analysis.free_vars(b.value))
        if used & activation:
            activation.add(b.var)
            ended |= used & weight_only
        else:
            weight_only.add(b.var)
            started |= used - weight_only
    if not ended:
        return func
    return _copy(func, kept=frozenset(started), ended=frozenset(ended))


def _copy(func: relax.Function, **options) -> relax.Function:
    """`func` re-emitted by `_function` with `options`."""
    params = [relax.Var(v.name, v.ty) for v in func.params]
    bindings = list(func.body.blocks[0].bindings)
    copy = _function(PREDICT_FUNC, params, bindings, func.body.body, dict(zip(func.params, params)), **options)
    return copy.with_attr("global_symbol", PREDICT_FUNC)


_FORWARD = "forward_"  # the names `_saved` gives the forward pass's bindings


def _saved(func: relax.Function, adjoint: relax.Function) -> set[relax.Var]:
    """The bindings of `func` whose values its backward pass reads, from `adjoint`, the gradient
    pass's output for a copy of `func` whose bindings are numbered (`_copy(func, numbered=_FORWARD)`:
    the gradient pass keeps forward names, not variables)."""
    forward = {f"{_FORWARD}{i}": b.var for i, b in enumerate(func.body.blocks[0].bindings)}
    read = {
        v.name for b in adjoint.body.blocks[0].bindings if b.var.name not in forward for v in relax.analysis.free_vars(b.value)
    }
    return {forward[n] for n in read if n in forward}


@relax.expr_functor.mutator
class _Renamed(relax.PyExprMutator):
    """An expression with variables replaced (moving bindings into a new function)."""

    def __init__(self, mapping: dict[relax.Var, relax.Expr]):
        super().__init__()
        self.mapping = mapping

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.mapping.get(var, var)

    def visit_dataflow_var_(self, var: relax.Var) -> relax.Expr:
        return self.mapping.get(var, var)


def _function(
    name: str,
    params: list[relax.Var],
    bindings: list,
    output: relax.Expr,
    mapping: dict,
    kept: frozenset = frozenset(),
    ended: frozenset = frozenset(),
    numbered: str | None = None,
    several: bool = False,
) -> relax.Function:
    """A dataflow function of `params` that re-emits `bindings` and returns `output`, the old
    variables of the params (and of each binding) replaced through `mapping`. Old variables in
    `kept` (params or bindings) are marked `start_checkpoint`, those in `ended` (bindings)
    `end_checkpoint`, and read through the mark (see `planner.backend.graph.recompute`); with
    `numbered`, the i-th binding is named `{numbered}{i}`; with `several`, `output` is a tuple whose
    fields are each an output."""

    def mark(old: relax.Var, new: relax.Expr) -> relax.Expr:
        if old in ended:
            return bb.emit(relax.op.grad.end_checkpoint(new), f"{old.name}_rebuilt")
        return bb.emit(relax.op.grad.start_checkpoint(new), f"{old.name}_kept") if old in kept else new

    bb = relax.BlockBuilder()
    with bb.function(name, params):
        with bb.dataflow():
            for old in [v for v in mapping if v in kept]:  # params
                mapping[old] = mark(old, mapping[old])
            for i, binding in enumerate(bindings):
                var_name = binding.var.name if numbered is None else f"{numbered}{i}"
                mapping[binding.var] = mark(binding.var, bb.emit(_Renamed(mapping).visit_expr(binding.value), var_name))
            if several:  # a backbone's outputs, as AppendLoss reads them: a tuple of outputs, not an output tuple
                out = relax.Tuple([bb.emit_output(_Renamed(mapping).visit_expr(f)) for f in output.fields])
            else:
                out = bb.emit_output(_Renamed(mapping).visit_expr(output))
        bb.emit_func_output(out)
    return bb.get()[name]


def _undifferentiable(binding: relax.VarBinding) -> bool:
    """Whether a binding calls an op Relax has no gradient for."""
    value = binding.value
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.get_attr("FPrimalGradient") is None


def _frozen_prefix(func: relax.Function, n_inputs: int, n_trainable: int) -> tuple[relax.Function | None, relax.Function]:
    """`func(*inputs, *frozen, *trainable)` (`n_inputs` model inputs) split where the trainable
    parameters first come in: the prefix `(*inputs, *frozen) -> (t1, …, tk)` computes the tensors before the first op that depends on
    a trainable parameter, in program order; the rest becomes `(t1, …, tk, *frozen, *trainable)`.

    Why: Relax's gradient pass asks every op between the input and the loss for its gradient, even
    where no parameter lies upstream. That was most of a compile's time for a sparse update
    (MobileNetV2 training its last layers: 0.48 of 2.3 s, every op of the frozen backbone asked),
    and a model with an op planner cannot differentiate (a Floor, an argmax) could not train the
    layers after it. Program order keeps the step's order, so its memory plan, as it was. An op
    without a gradient after the first trained layer that no trained layer feeds goes into the
    prefix too: every tensor independent of the trainable parameters then is computed there.
    Returns (None, func) when no op comes before the first trained layer.
    """
    blocks = func.body.blocks
    if len(blocks) != 1 or not all(isinstance(b, relax.VarBinding) for b in blocks[0].bindings):
        return None, func
    bindings = list(blocks[0].bindings)
    xs, weights = list(func.params[:n_inputs]), list(func.params[n_inputs:])
    trainable = set(weights[len(weights) - n_trainable :])
    depends: set[relax.Var] = set(trainable)
    for b in bindings:
        if any(v in depends for v in relax.analysis.free_vars(b.value)):
            depends.add(b.var)
    first = next((i for i, b in enumerate(bindings) if b.var in depends), len(bindings))
    before, after = bindings[:first], bindings[first:]
    if any(_undifferentiable(b) and b.var not in depends for b in after):
        before = [b for b in bindings if b.var not in depends]
        after = [b for b in bindings if b.var in depends]
    if not before:
        return None, func
    used = {v for b in after for v in relax.analysis.free_vars(b.value)} | set(relax.analysis.free_vars(func.body.body))
    boundary = [v for v in [*xs, *(b.var for b in before)] if v in used]
    frozen = weights[: len(weights) - n_trainable]
    fresh = [relax.Var(v.name, v.ty) for v in (*xs, *frozen)]
    prefix = _function("frozen_prefix", fresh, before, relax.Tuple(boundary), dict(zip([*xs, *frozen], fresh)))
    inputs = [relax.Var(v.name, v.ty) for v in boundary]
    params = [relax.Var(v.name, v.ty) for v in weights]
    mapping = dict(zip([*boundary, *weights], [*inputs, *params]))
    rest = _function(PREDICT_FUNC, [*inputs, *params], after, func.body.body, mapping)
    return prefix, rest.with_attr("global_symbol", PREDICT_FUNC)


def _fused_step(
    trainer: tvm.IRModule,
    prefix: relax.Function | None,
    model_inputs: Sequence[relax.Var],
    n_trainable: int,
    lr_dtype: str,
    accum: int = 1,
    coded: tuple[list[str], dict[str, int]] = ([], {}),
) -> tuple[relax.Function, list[relax.TensorType], dict[tvm.ir.GlobalVar, tvm.tirx.PrimFunc]]:
    """`backbone_loss_adjoint` followed by `optimizer`, inlined into one flat function; the
    learning rate is the last optimizer state, returned as it came (`runtime_lr`).

    Inlining lets fusion merge each weight-gradient kernel with its update, so many gradients
    are never materialised at all. With `accum` > 1 the step takes `accum` micro-batches at once
    and unrolls their forward/backward passes one after another, summing gradients: memory
    planning reuses one micro-batch's activations for the next, so the step holds the
    activations of one micro-batch plus the gradient accumulators. `model_inputs`: the
    model's inputs at one micro-batch, which the step takes at `accum` micro-batches. `coded`:
    the trained weights' stored names and those stored as int8 codes (`weights.coded_weights`),
    which the step takes and gives back as codes and scales.
    """
    adjoint = trainer["backbone_loss_adjoint"]
    optim = runtime_lr(trainer["optimizer"], lr_dtype)
    adjoint_gv = trainer.get_global_var("backbone_loss_adjoint")
    n_inputs = len(model_inputs) if prefix is None else len(prefix.ret_ty.fields)  # the adjoint's leading non-weight inputs
    micro = [relax.Var(v.name, v.ty) for v in adjoint.params]
    y_ty = micro[-1].ty
    B = int(y_ty.shape[0])

    def whole(v: relax.Var) -> relax.Var:  # an input at every micro-batch of the step
        return relax.Var(v.name, relax.TensorType([B * accum, *[int(d) for d in v.ty.shape][1:]], v.ty.dtype))

    xs = [whole(v) for v in model_inputs]
    y = whole(micro[-1])
    weights = micro[n_inputs:-1]
    state_types = list(optim.params[2].ty.fields)
    states = [relax.Var(f"optim_state{i}", t) for i, t in enumerate(state_types)]
    lr = relax.Var("lr", optim.params[3].ty)
    first_trainable = len(weights) - n_trainable
    scales, taken, rebuild = coded_params(weights[first_trainable:], coded[1], coded[0])

    bb = relax.BlockBuilder(trainer)
    prefix_gv = bb.add_func(prefix, "frozen_prefix") if prefix is not None else None
    optim_gv = bb.add_func(optim, "update")
    # a coded weight's fp32 var is free here: each of its uses is rebuilt from its codes below
    with bb.function(STEP_FUNC, [*xs, *weights[:first_trainable], *taken, *states, lr, y]):
        with bb.dataflow():
            loss, grads = None, None
            for i in range(accum):

                def part(v: relax.Var, i: int = i) -> relax.Expr:  # micro-batch i of a whole-step input
                    return v if accum == 1 else bb.emit(relax.op.strided_slice(v, axes=[0], begin=[i * B], end=[(i + 1) * B]))

                xi, yi = [part(v) for v in xs], part(y)
                if prefix is None:
                    inputs = xi
                else:  # what the frozen prefix computes, the differentiated rest's inputs
                    cut = bb.emit(relax.Call(prefix_gv, [*xi, *weights[: len(prefix.params) - len(xs)]]))
                    inputs = [bb.emit(relax.TupleGetItem(cut, j)) for j in range(n_inputs)]
                res = bb.emit(relax.Call(adjoint_gv, [*inputs, *weights, yi]))
                li = bb.emit(relax.TupleGetItem(res, 0))
                gi = [bb.emit(relax.TupleGetItem(bb.emit(relax.TupleGetItem(res, 1)), j)) for j in range(n_trainable)]
                loss = li if loss is None else _in_place(bb, accumulate_kernel, "accumulate", loss, li)
                grads = gi if grads is None else [_in_place(bb, accumulate_kernel, "accumulate", a, b) for a, b in zip(grads, gi)]
            assert grads is not None, "a step runs one micro-batch at least (accum >= 1)"
            if accum > 1:  # the mean over the effective batch, as one big batch would give
                loss = _in_place(bb, partial(scale_kernel, factor=1.0 / accum), "mean", loss)
                grads = [_in_place(bb, partial(scale_kernel, factor=1.0 / accum), "mean", g) for g in grads]
            old = relax.Tuple(weights[first_trainable:])
            upd = bb.emit(relax.Call(optim_gv, [old, relax.Tuple(grads), relax.Tuple(states), lr]))
            result = bb.emit_output(_results(bb, loss, upd, weights[first_trainable:], scales, states, lr))
        bb.emit_func_output(result)
    built = bb.get()
    inlined = {"backbone_loss_adjoint": adjoint, "update": optim} | ({"frozen_prefix": prefix} if prefix is not None else {})
    step = built[STEP_FUNC].inline_functions(inlined)
    if rebuild:
        step = dequantized_at_use(step, list(step.params), rebuild)
    kernels = {gv: f for gv, f in built.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    return step.with_attr("global_symbol", STEP_FUNC), state_types, kernels


def _results(
    bb: relax.BlockBuilder,
    loss: relax.Var,
    update: relax.Var,
    trained: Sequence[relax.Var],
    scales: dict[relax.Var, relax.Var],
    states: Sequence[relax.Var],
    lr: relax.Var,
) -> relax.Tuple:
    """The step's results: (loss, *new trained weights — a coded one as codes and scales, rounded
    at the step count SGD's first state holds —, *new states, lr)."""
    new_params = bb.emit(relax.TupleGetItem(update, 0))
    new_states = bb.emit(relax.TupleGetItem(update, 1))
    outs = [loss]
    coded = [var for var in trained if var in scales]
    for i, var in enumerate(trained):
        new = bb.emit(relax.TupleGetItem(new_params, i))
        outs += requantized(bb, new, scales[var], states[0], coded.index(var)) if var in scales else (new,)
    outs += [bb.emit(relax.TupleGetItem(new_states, i)) for i in range(len(states))] + [lr]
    return relax.Tuple(outs)


def _in_place(
    bb: relax.BlockBuilder, kernel: Callable[..., tvm.tirx.PrimFunc], what: str, total: relax.Var, *more: relax.Var
) -> relax.Var:
    """`kernel` (`tir.accumulate_kernel`, `tir.scale_kernel`) run over `total` in place, one
    kernel per shape: micro-batch gradients summed, and made a mean, in the buffer they are in."""
    shape, dtype = [int(d) for d in total.ty.shape], str(total.ty.dtype)
    name = f"{what}_{dtype}_{'x'.join(map(str, shape)) or 'scalar'}"
    gv = next((g for g in bb.get().get_global_vars() if g.name_hint == name), None)
    if gv is None:
        gv = bb.add_func(kernel(shape, dtype, name=name), name)
    return bb.emit(relax.call_tir_inplace(gv, relax.Tuple([total, *more]), 0, out_ty=total.ty))
