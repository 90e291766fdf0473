"""How a step stores weights: int8 frozen and trained weights, and the weights a mode reshapes.

A step does not always take an ONNX initializer as it is. A frozen Conv/Gemm/MatMul weight of a
candidate with `frozen_weights: int8` arrives as int8 values plus one fp32 scale per output
channel, dequantized inside the graph, so it occupies a quarter of the board's RAM; so does a
trained one of an int8 candidate with SGD (`coded_weights`), which the step updates as codes. A
weight whose layer's mode reshapes it (`ratio:r`: a trainable head and a frozen tail; `lora:r`:
the frozen weight and two trainable factors) arrives as the parts its mode (`planner.modes`) names. This
module is the one place that maps initializers to the step's inputs and back; back, the parts are
made whole (adapters merged into their weights), so a fine-tuned model has the original graph and
initializers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import tvm
from tvm import relax, te, tirx

from planner import modes
from planner.errors import CandidateFailed
from planner.inputs.model import Model
from planner.modes import Layout
from planner.modes.ratio import head
from planner.runtime.weights import QMAX, int8, scale, scale_shape
from planner.types import Candidate, FrozenWeights, Optimizer, Precision


def layouts(model: Model, candidate: Candidate) -> dict[str, Layout]:
    """weight -> how the step takes it, for every trained layer whose mode reshapes its weight."""
    out = {}
    for name, mode in candidate.trainable:
        if not mode.spec.suffixes:  # a mode that takes the weight as it is stores nothing else
            continue
        layer = model.layer(name)
        problem = mode.spec.refuses(layer, mode.value)
        if problem:
            raise CandidateFailed(problem)
        layout = mode.spec.layout(layer, mode.value)
        if layout is not None and layer.weight is not None:
            out[layer.weight] = layout
    return out


def quantized_weights(model: Model, candidate: Candidate, frozen: list[str]) -> dict[str, int]:
    """weight -> output-channel axis, for every frozen Conv/Gemm/MatMul weight stored as int8."""
    if candidate.frozen_weights is FrozenWeights.FP32:
        return {}
    frozen_set = set(frozen)
    return {layer.weight: layer.out_axis for layer in model.layers if layer.weight in frozen_set and layer.out_axis is not None}


@dataclass(frozen=True)
class Stored:
    """The step's weight inputs, by stored name: the frozen ones, then the trainable ones (the
    order the step takes them), and how weights are reshaped (`layouts`) and quantized."""

    frozen: list[str]
    trainable: list[str]
    layouts: dict[str, Layout]
    quantized: dict[str, int]
    coded: dict[str, int]  # trained weights the step stores as int8 codes (`coded_weights`): name -> axis

    @property
    def signed_trainable(self) -> tuple[str, ...]:
        """The trainable inputs as the step's signature names them: a coded weight as its codes
        and its scales, which the step updates too (`requantized`)."""
        return tuple(s for n in self.trainable for s in ((int8(n), scale(n)) if n in self.coded else (n,)))


def coded_weights(model: Model, candidate: Candidate, trainable: list[str]) -> dict[str, int]:
    """weight -> output-channel axis, for each trained Conv/Gemm/MatMul weight (or a ratio
    update's trained head) an int8 candidate with plain SGD stores as int8 codes and per-channel
    scales.

    As TinyEngine does: the weight costs the board a byte of SRAM, not four. The step computes
    in fp32 from the dequantized codes and writes back the codes of the updated weight (the
    fp32 update the codes stand for: what quantization-aware scaling makes an int8 gradient
    equal to), its scales grown where it outgrew them, its codes rounded stochastically
    (`requantized`). With momentum or Adam the state is fp32 anyway (4 or 8 bytes a weight), so
    their weights keep an fp32 master: Adam's steps are about its rate, a fraction of a code of
    most weights, and coded weights fine-tuned with it (rounded to nearest) fell 24 points short
    of fp32 on the MobileNetV2 digits transfer (benchmarks/int8_accuracy.py)."""
    if candidate.precision is not Precision.INT8 or candidate.optimizer is not Optimizer.SGD:
        return {}
    axes = {}
    for layer in model.layers:
        if layer.weight is not None and layer.out_axis is not None:
            axes[layer.weight] = axes[head(layer.weight)] = layer.out_axis
    return {n: axes[n] for n in trainable if n in axes}


def stored_weights(model: Model, candidate: Candidate) -> Stored:
    """How `candidate`'s step takes `model`'s initializers. A weight its mode reshapes arrives as
    its parts — trainable ones among the trainable inputs in model order, frozen ones after
    every other frozen input —, and beside them as itself (frozen) when the mode keeps it."""
    shaped = layouts(model, candidate)
    kept = {w for w, layout in shaped.items() if modes.MODES[layout.mode].keeps_weight}
    trained = {p for name, mode in candidate.trainable for p in model.layer(name).params_for(mode)} - kept
    names = list(model.initializers)

    def parts(name: str, trainable: bool) -> list[str]:
        layout = shaped[name]
        shape = model.initializers[name].shape
        return [p.name for p in modes.MODES[layout.mode].parts(layout, name, shape) if p.trainable == trainable]

    trainable = [s for n in names if n in trained or n in shaped for s in (parts(n, True) if n in shaped else (n,))]
    quantized = quantized_weights(model, candidate, [n for n in names if n not in trained])
    frozen = [s for n in names if n not in trained for s in ((int8(n), scale(n)) if n in quantized else (n,))]
    frozen += [p for n in names if n in shaped for p in parts(n, False)]
    return Stored(frozen, trainable, shaped, quantized, coded_weights(model, candidate, trainable))


@relax.expr_functor.mutator
class _RebuildAtUse(relax.PyExprMutator):
    """Each use of a weight becomes a rebuild from its stored parts, emitted right before the use,
    so a dequantized or concatenated weight lives only as long as the op that needs it."""

    def __init__(self, rebuild: dict[relax.Var, Callable[..., relax.Expr]]):
        super().__init__()
        self.rebuild = rebuild

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        make = self.rebuild.get(var)
        return self.builder_.emit(make()) if make else var


def as_stored(func: relax.Function, n_inputs: int, names: list[str], how: Stored) -> tuple[relax.Function, list[str]]:
    """`func(*inputs, *initializers)` (`n_inputs` inputs) taking each weight the way `how` stores
    it, and the stored names of its weight parameters in order (TVM's own names for the weights
    it imported are not always the initializers', `onnx::MatMul_430`).

    A quantized weight is taken as int8 values and fp32 scales, dequantized where it is used; a
    weight its mode reshapes as the mode's parts (and itself, when the mode keeps it), rebuilt
    by the mode where it is used — so a gradient reaches only the parts the step trains.
    """
    new_params: list[relax.Var] = list(func.params[:n_inputs])
    names_out: list[str] = []
    rebuild: dict[relax.Var, Callable[..., relax.Expr]] = {}
    for name, var in zip(names, func.params[n_inputs:]):
        shape = [int(d) for d in var.ty.shape]
        dtype = var.ty.dtype
        layout = how.layouts.get(name)
        mode = modes.MODES[layout.mode] if layout is not None else None
        base: Callable[[], relax.Expr] | None = None
        if mode is None or mode.keeps_weight:
            if name in how.quantized:
                q = relax.Var(_identifier(int8(name)), relax.TensorType(shape, "int8"))
                s = relax.Var(_identifier(scale(name)), relax.TensorType(scale_shape(shape, how.quantized[name]), dtype))
                new_params += [q, s]
                names_out += [int8(name), scale(name)]
                base = partial(_dequantized, q, s, dtype)
                rebuild[var] = base
            else:
                new_params.append(var)
                names_out.append(name)
                base = partial(_itself, var)
        if mode is not None and layout is not None:
            stored_parts = mode.parts(layout, name, shape)
            parts = {
                p.name.rpartition("@")[2]: relax.Var(_identifier(p.name), relax.TensorType(list(p.shape), dtype))
                for p in stored_parts
            }
            new_params += parts.values()
            names_out += [p.name for p in stored_parts]
            rebuild[var] = partial(mode.rebuild, layout, relax.op, base, parts, shape)
    body = _RebuildAtUse(rebuild).visit_expr(func.body)
    return relax.Function(new_params, body, func.ret_ty, func.is_pure, func.attrs), names_out


def _identifier(stored: str) -> str:
    """A stored part's name as its variable's in the graph (`c.w@head` -> `c.w__head`): kernels take
    their parameters' names from it, and C (`planner.backend.mcu.cstep`) has no `@` in a name. The
    step's signature keeps the stored names; the graph knows its variables by position."""
    return stored.replace("@", "__")


def _itself(var: relax.Var) -> relax.Expr:
    return var


def _dequantized(q: relax.Var, s: relax.Var, dtype: str) -> relax.Expr:
    return relax.op.astype(q, dtype) * s


def dequantized(weight: relax.Expr, bound: dict[relax.Var, relax.Expr]) -> tuple[relax.Var, relax.Var] | None:
    """(q, scale) if `weight` is bound (in `bound`) to a 4-D int8 weight dequantized as
    `as_stored` writes it, `astype(q, "float32") * scale` with one scale per output channel
    (o, 1, 1, 1); else None. A kernel that reads q where it lies and scales each value as it
    reads it computes what the dequantized copy would have held, without the copy
    (`planner.backend.lower.portable.int8_weights`)."""
    value = bound.get(weight) if isinstance(weight, relax.Var) else None
    if not (isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.multiply"))):
        return None
    cast, s = (bound.get(value.args[0]) if isinstance(value.args[0], relax.Var) else None), value.args[1]
    if not (isinstance(cast, relax.Call) and cast.op.same_as(tvm.ir.Op.get("relax.astype"))):
        return None
    q = cast.args[0]
    if not (isinstance(q, relax.Var) and isinstance(s, relax.Var) and q.ty.dtype == "int8" and s.ty.dtype == "float32"):
        return None
    shape, scales = q.ty.shape, s.ty.shape
    if shape is None or scales is None or len(shape) != 4 or len(scales) != 4:
        return None
    if not all(isinstance(d, tvm.tirx.IntImm) for d in (*shape, *scales)):
        return None
    return (q, s) if [int(d) for d in scales] == [int(shape[0]), 1, 1, 1] else None


def read_in_place(bindings: list[relax.VarBinding]) -> set[relax.Var]:
    """The bindings (the cast and the scaling) of each dequantized int8 weight (`dequantized`)
    that only convolutions read as their weight, dense ones or a depthwise one's forward: a
    microcontroller's portable kernels (`planner.backend.lower.portable`) read those in flash, so
    the copy never takes SRAM. What plans the step's memory before it is lowered
    (`planner.backend.graph.bands`) counts them as nothing."""
    bound = {b.var: b.value for b in bindings}
    readers: dict[relax.Var, list[relax.Expr]] = {}
    for b in bindings:
        for v in relax.analysis.free_vars(b.value):
            readers.setdefault(v, []).append(b.value)
    out: set[relax.Var] = set()
    for b in bindings:
        found = dequantized(b.var, bound)
        if found is not None and all(_reads_in_place(r, b.var) for r in readers.get(b.var, [])):
            out |= {b.var, b.value.args[0]}
    return out


def _reads_in_place(call: relax.Expr, weight: relax.Var) -> bool:
    """Whether `call` reads `weight` as its weight alone in a convolution the portable kernels read
    int8 weights in place for: an ungrouped one (forward or transposed), a depthwise forward."""
    if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)) or not call.args[1].same_as(weight):
        return False
    if call.args[0].same_as(weight) or call.op.name not in ("relax.nn.conv2d", "relax.nn.conv2d_transpose"):
        return False
    groups = int(call.attrs.groups)
    depthwise = call.op.name == "relax.nn.conv2d" and int(weight.ty.shape[1]) == 1 and groups == int(weight.ty.shape[0])
    return groups == 1 or depthwise


def coded_params(
    params: list[relax.Var], coded: dict[str, int], names: list[str]
) -> tuple[dict[relax.Var, relax.Var], list[relax.Var], dict[relax.Var, Callable[[], relax.Expr]]]:
    """For the trained weights `params` (stored names `names`): each coded one's scales, the params
    a function takes for them (codes and scales in place of each coded one), and what rebuilds
    each coded weight from its codes where it is used (`dequantized_at_use`)."""
    scales: dict[relax.Var, relax.Var] = {}
    taken: list[relax.Var] = []
    rebuild: dict[relax.Var, Callable[[], relax.Expr]] = {}
    for var, name in zip(params, names):
        if name not in coded:
            taken.append(var)
            continue
        shape = [int(d) for d in var.ty.shape]
        q = relax.Var(_identifier(int8(name)), relax.TensorType(shape, "int8"))
        s = relax.Var(_identifier(scale(name)), relax.TensorType(scale_shape(shape, coded[name]), var.ty.dtype))
        scales[var] = s
        taken += [q, s]
        rebuild[var] = partial(_dequantized, q, s, var.ty.dtype)
    return scales, taken, rebuild


def dequantized_at_use(
    func: relax.Function, params: list[relax.Var], rebuild: dict[relax.Var, Callable[[], relax.Expr]]
) -> relax.Function:
    """`func` taking `params`, each use of a weight in `rebuild` dequantized from its codes right
    before it (so the fp32 copy lives only as long as the op reading it, and an update reads the
    codes themselves: in place)."""
    body = _RebuildAtUse(rebuild).visit_expr(func.body)
    return relax.analysis.remove_all_unused(relax.Function(params, body, func.ret_ty, func.is_pure, func.attrs))


def requantized(
    bb: relax.BlockBuilder, new: relax.Expr, s: relax.Var, steps: relax.Var, salt: int
) -> tuple[relax.Var, relax.Var]:
    """An updated coded weight's codes and scales, emitted by `bb`: a channel keeps its scale while
    its largest |w| fits in 127 codes, else takes the scale that fits it (scales only grow: a
    fine-tune moves a new task's classifier several times past its first peak, which a fixed scale
    would clamp); the codes rounded stochastically (`stochastic_codes`) at the optimizer's step
    count `steps` (an int64 scalar), `salt` telling this weight's draws from another's.

    Rounded to nearest, an update of under half a code rounds away, and batch-1 SGD's updates of
    a classifier often are that small; rounded stochastically, a fraction of a code moves the
    weight by that fraction on average (tests/test_int8.py). On the MobileNetV2 digits transfer
    int8 went from 2.3 ± 2.5 points below fp32 (10 seeds) to 0.2 ± 0.7 above (200 seeds, paired;
    benchmarks/int8_accuracy.py)."""
    assert steps.ty.dtype == "int64" and not steps.ty.shape, "SGD's first state counts the steps"
    per_channel = [d for d, n in enumerate(s.ty.shape) if int(n) == 1]  # the axes one scale spans
    peak = relax.op.max(relax.op.abs(new), axis=per_channel, keepdims=True)
    grown = bb.emit(relax.op.maximum(s, relax.op.multiply(peak, relax.const(1.0 / QMAX, "float32"))))
    codes = bb.emit_te(stochastic_codes, new, grown, steps, salt=salt, primfunc_name_hint="stochastic_codes")
    return codes, grown


def stochastic_codes(new: te.Tensor, scale: te.Tensor, steps: te.Tensor, *, salt: int) -> te.Tensor:
    """The int8 codes of `new` at per-channel `scale` (broadcast along its axes of extent 1): each
    value v is floor(v) + 1 when a number u drawn in [0, 1) is below its fraction v - floor(v)
    (both exact in fp32), else floor(v), so it rounds up with the chance of its fraction; then
    clipped to ±127.

    u is a hash (`_hash`) of the value's flat index, the optimizer's step count and `salt`:
    integer arithmetic the board computes as the host does, so the board's codes are the host's
    whenever their floats are (tests/test_c_step.py). A dither taken from the value's own low
    bits instead (tried first) turned each ulp the two platforms differ by into a thousand
    times the chance of another code, and the emulated board's training diverged from the host's."""

    def code(*i):
        flat = tirx.const(0, "uint64")
        for d, extent in enumerate(new.shape):
            flat = flat * tirx.const(int(extent), "uint64") + i[d].astype("uint64")
        drawn = _hash(flat, steps().astype("uint64"), salt) >> tirx.const(8, "uint64")
        u = drawn.astype("float32") * tirx.const(1.0 / (1 << 24), "float32")
        at = [0 if int(scale.shape[d]) == 1 else i[d] for d in range(len(i))]
        v = new(*i) / scale(*at)
        down = tirx.floor(v)
        up = tirx.Select(u < v - down, tirx.const(1.0, "float32"), tirx.const(0.0, "float32"))
        return tirx.max(tirx.min(down + up, tirx.const(QMAX, "float32")), tirx.const(-QMAX, "float32")).astype("int8")

    return te.compute(new.shape, code, name="codes")


_M32 = 0xFFFFFFFF


def _hash(index: tirx.PrimExpr, steps: tirx.PrimExpr, salt: int) -> tirx.PrimExpr:
    """A 32-bit hash of (index, steps, salt) in uint64 arithmetic, every product one of two values
    under 2^32, so none wraps (TVM's unsigned products may not): the three mixed by multiplicative
    constants (Knuth's golden ratio, MurmurHash3's two), then Wellons's lowbias32 finalizer, a
    bijection of 32-bit values whose output bits measure as nearly unbiased on any input bit's
    flip: adjacent indices and steps draw unrelated numbers."""

    def c(v: int) -> tirx.PrimExpr:
        return tirx.const(v, "uint64")

    def mul(a: tirx.PrimExpr, k: int) -> tirx.PrimExpr:
        return (a * c(k)) & c(_M32)

    x = (mul(index & c(_M32), 0x9E3779B1) + mul(steps & c(_M32), 0x85EBCA6B) + mul(c(salt & _M32), 0xC2B2AE35)) & c(_M32)
    x = mul(x ^ (x >> c(16)), 0x7FEB352D)
    x = mul(x ^ (x >> c(15)), 0x846CA68B)
    return x ^ (x >> c(16))
