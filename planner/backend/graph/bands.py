"""Row bands: a CNN's frozen first layers computed a band of rows at a time (patch-based inference).

Why: a microcontroller holds a step's widest moment in SRAM, and in a CNN that moment is usually
near the input, before any trained layer: MobileNetV2-w0.35 at 96x96 expands a 48x48 map to 48
channels (442 KB in fp32) while its 74 KB input is alive, more than a 512 KB board holds beside
anything else. Nothing there needs a whole map at once: no gradient flows back through frozen
layers, and an output row of a convolution reads a few rows of its input. So the layers up to a
cut tensor T (one that the rest of the network reads alone) run once per band of T's rows, each
time on the rows of every earlier tensor that the band needs (its receptive field; the overlap
between bands is computed again), and the bands are concatenated into T: MCUNetV2's patch-based
inference (Lin et al., 2021), along rows only.

The result is the same tensor: a band's convolution pads with zeros where the band meets the
map's border, as the whole convolution does there, and reads real rows everywhere else
(tests/test_bands.py checks it against the unbanded function over strides, dilations, kernel
sizes, odd and even heights and residual additions).

The cut and the number of bands are chosen to minimise the function's peak of live activations
(`plan`): among those within `SLACK` of the least peak, the one that computes the least overlap
again. The `c` back end asks for it (`build_training_module(..., bands=True)`); on a board
with gigabytes the recomputed overlap would be time lost for memory nobody needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax

from planner.backend.graph.memory import tensor_bytes
from planner.backend.graph.quantized import read_counts, unheld
from planner.backend.graph.rewrites import frozen_quantized_values
from planner.backend.graph.weights import read_in_place

# ops whose output row r reads row r of each operand alone (operands of the same shape, or
# broadcast over rows: a per-channel scale, a bias)
ELEMENTWISE = frozenset(
    f"relax.{name}"
    for name in (
        "add subtract multiply divide maximum minimum power clip astype negative exp sqrt rsqrt sigmoid tanh "
        "nn.relu nn.silu nn.gelu nn.gelu_tanh nn.leakyrelu quantize dequantize grad.no_grad"  # the last: int8 activations
    ).split()
)
BAND_COUNTS = (2, 3, 4, 6, 8, 12, 16)
SLACK = 1.05  # a plan's peak within this factor of the least counts as the least
WORTH = 0.8  # band only for a peak at most this share of the unbanded one


@dataclass(frozen=True)
class Plan:
    """Bands of the cut tensor's rows: `rows[k]` = (start, stop) of band k."""

    members: tuple[int, ...]  # the bindings computed in bands (indices in the one block)
    cut: int  # the binding of the cut tensor T (the last member)
    rows: tuple[tuple[int, int], ...]
    peak: int  # live activation bytes at the widest moment, estimated
    unbanded_peak: int
    again: float  # bytes the bands write beyond the unbanded layers', as a share of those


def _op(binding: relax.VarBinding) -> str | None:
    value = binding.value
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else None


def _shape(ty) -> tuple[int, ...] | None:
    if isinstance(ty, relax.TensorType) and ty.shape is not None and all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape):
        return tuple(int(d) for d in ty.shape)
    return None


def _height(v: relax.Expr) -> int:
    """Rows of a 4-D NCHW tensor."""
    return int(v.ty.shape[2])


def _bytes(ty) -> int:
    return tensor_bytes(ty.shape.values, ty.dtype) if _shape(ty) is not None else 0


def _bandable(binding: relax.VarBinding, data: set[relax.Var]) -> bool:
    """Whether each output row of `binding` (a 4-D NCHW tensor) reads a band of rows of the data
    tensors it reads, and only broadcast-over-rows values of everything else."""
    out = _shape(binding.var.ty)
    if out is None or len(out) != 4:
        return False
    op, call = _op(binding), binding.value
    if op == "relax.nn.conv2d":
        a = call.attrs
        layouts = (a.data_layout, a.kernel_layout, a.out_layout or "NCHW")
        return layouts == ("NCHW", "OIHW", "NCHW") and call.args[0] in data and call.args[1] not in data
    if op not in ELEMENTWISE:
        return False
    for arg in call.args:
        if not isinstance(getattr(arg, "ty", None), relax.TensorType):
            continue  # a scalar (clip's bounds)
        shape = _shape(arg.ty)
        if shape is None:
            return False
        if arg in data:
            if shape != out:
                return False
        elif len(shape) >= 2 and shape[-2] != 1:  # a value that varies along rows
            return False
    return True


INPUT = -1  # the function's input batch, among binding indices


@dataclass(frozen=True)
class _Op:
    """A binding as the planning sees it, read once from the IR (the planning tries every cut in
    many band counts: over FFI objects, MobileNetV2's took a minute and a half)."""

    reads: tuple[int, ...]  # the bindings whose outputs it reads (INPUT: the batch)
    data: tuple[int, ...]  # those it reads by rows, if it is bandable (a convolution: its input)
    nbytes: int
    height: int  # rows of its output, if a 4-D map
    last: int  # the last binding that reads its output (len(bindings): returned)
    elementwise: bool
    conv: tuple[int, int, int, int] | None  # stride, dilation, kernel height, top padding


def _summary(func: relax.Function, bindings: list, data: set[relax.Var]) -> list[_Op]:
    index = {b.var: i for i, b in enumerate(bindings)} | {func.params[0]: INPUT}
    last = {i: i for i in range(len(bindings))}
    for i, b in enumerate(bindings):
        for v in relax.analysis.free_vars(b.value):
            if v in index:
                last[index[v]] = i
    for v in relax.analysis.free_vars(func.body.body):
        if v in index:
            last[index[v]] = len(bindings)
    ops = []
    for i, b in enumerate(bindings):
        reads = tuple(index[v] for v in relax.analysis.free_vars(b.value) if v in index)
        shape = _shape(b.var.ty)
        conv: tuple[int, int, int, int] | None = None
        band_reads: tuple[int, ...] = ()
        if _op(b) == "relax.nn.conv2d":
            at = b.value.attrs
            conv = (int(at.strides[0]), int(at.dilation[0]), int(b.value.args[1].ty.shape[2]), int(at.padding[0]))
        if b.var in data:
            args = b.value.args[:1] if conv else [a for a in b.value.args if a in data and _shape(a.ty) == shape]
            band_reads = tuple(index[a] for a in args)
        height = shape[2] if shape is not None and len(shape) == 4 else 0
        ops.append(_Op(reads, band_reads, _bytes(b.var.ty), height, last[i], _op(b) in ELEMENTWISE, conv))
    return ops


def _conv_rows(conv: tuple[int, int, int, int], rows: tuple[int, int], height: int) -> tuple[int, int, int, int]:
    """The input rows [a, b) a convolution reads for output rows `rows` of an input `height` rows
    high, and the zero rows (top, bottom) padded around them."""
    s, d, k, pad = conv
    lo = rows[0] * s - pad
    hi = (rows[1] - 1) * s - pad + d * (k - 1) + 1
    a, b = max(lo, 0), min(hi, height)
    return a, b, a - lo, hi - b


def _needs(ops: list[_Op], members: tuple[int, ...], rows: tuple[int, int], input_height: int) -> dict[int, tuple[int, int]]:
    """Rows of each tensor (members' outputs, INPUT) that band `rows` of the last member reads."""
    need = {members[-1]: rows}
    for i in reversed(members):
        r = need.get(i)
        if r is None:
            continue
        op = ops[i]
        if op.conv is not None:
            (j,) = op.data
            a, e, _, _ = _conv_rows(op.conv, r, input_height if j == INPUT else ops[j].height)
            wanted = [(j, (a, e))]
        else:
            wanted = [(j, r) for j in op.data]
        for j, (a, e) in wanted:
            old = need.get(j)
            need[j] = (a, e) if old is None else (min(old[0], a), max(old[1], e))
    return need


def _peak(
    ops: list[_Op],
    positions,
    sizes: dict[int, int],
    last: dict[int, int] | None = None,
    base: int = 0,
    held: tuple[int, int] = (0, -1),
) -> int:
    """The most bytes alive at once over `positions` (binding indices in order), each output
    allocated at its binding and freed after its last read (`last`, by default each op's own),
    `base` held throughout and `held` = (bytes, until) up to binding `until` (the input batch,
    which the step's arena holds until its last reader). An elementwise op writes over an operand
    it reads last, as the step's fused kernels and in-place activations (`backend.activations`) do."""
    live: dict[int, int] = {}
    peak = base

    def ends(j: int) -> int:
        return last[j] if last is not None and j in last else ops[j].last

    for i in positions:
        if ops[i].elementwise:
            for j in [j for j in ops[i].reads if j in live and ends(j) <= i]:
                del live[j]
        live[i] = sizes.get(i, 0)
        peak = max(peak, base + (held[0] if i <= held[1] else 0) + sum(live.values()))
        for j in [j for j in live if ends(j) <= i]:
            del live[j]
    return peak


def candidates(func: relax.Function, n_inputs: int, n_trainable: int) -> list[Plan]:
    """Every cut of `func(*inputs, *frozen, *trainable)` (its frozen first layers, `n_inputs`
    model inputs, the last `n_trainable` parameters trained) in each of `BAND_COUNTS` bands; none
    when its input is not one image batch."""
    blocks = func.body.blocks
    if n_inputs != 1 or len(blocks) != 1 or not all(isinstance(b, relax.VarBinding) for b in blocks[0].bindings):
        return []
    x = func.params[0]
    if (shape := _shape(x.ty)) is None or len(shape) != 4:
        return []
    input_rows = shape[2]
    bindings = list(blocks[0].bindings)
    trainable = set(func.params[len(func.params) - n_trainable :]) if n_trainable else set()
    data, members = {x}, []
    for i, b in enumerate(bindings):
        reads = set(relax.analysis.free_vars(b.value))
        if reads & trainable:
            break
        if not reads & data:
            continue  # a weight's own computation (a reshape, a dequantisation): left where it is
        if not _bandable(b, data):
            break
        data.add(b.var)
        members.append(i)
    ops = _summary(func, bindings, data)
    # weights read in place from flash, and an int8 unit's fp32 values (its kernel writes the codes), take no SRAM
    free = read_in_place(bindings) | unheld(bindings, read_counts(func), ELEMENTWISE)
    sizes = {i: 0 if b.var in free else op.nbytes for i, (b, op) in enumerate(zip(bindings, ops))}
    # the input batch lies in the step's arena until its last reader (`planner.backend.mcu.cstep`)
    batch = (_bytes(x.ty), max((i for i, b in enumerate(bindings) if x in relax.analysis.free_vars(b.value)), default=-1))
    unbanded = _peak(ops, range(len(ops)), sizes, held=batch)
    work = sum(sizes[i] for i in members)  # bytes the members write, unbanded
    plans = []
    for j, cut in enumerate(members):
        inside = tuple(members[: j + 1])
        height = ops[cut].height
        if height < 2 or any(ops[i].last > cut for i in inside[:-1]):
            continue  # the rest of the network reads more than T: no cut here
        if bindings[cut].var in free or _op(bindings[cut]) == "relax.dequantize":
            continue  # T is concatenated whole: not a value its kernel never writes, and an int8 map as its codes
        rest = _peak(ops, range(cut, len(ops)), sizes, held=batch)
        for n in (c for c in BAND_COUNTS if c <= height):
            rows = tuple((height * k // n, height * (k + 1) // n) for k in range(n))
            peak = max(2 * sizes[cut], rest)  # T's bands, then T concatenated from them
            done, written = 0, 0
            for r in rows:
                need = _needs(ops, inside, r, input_rows)
                band = {i: sizes[i] // ops[i].height * (need[i][1] - need[i][0]) for i in inside if i in need}
                peak = max(peak, _peak(ops, [i for i in inside if i in need], band, {cut: cut + 1}, base=done + batch[0]))
                done += band[cut]
                written += sum(band.values())
            again = (written - sum(sizes[i] for i in inside)) / work
            plans.append(Plan(inside, cut, rows, peak, unbanded, again))
    return plans


def plan(func: relax.Function, n_inputs: int, n_trainable: int) -> Plan | None:
    """The candidate that computes the least overlap again among those within `SLACK` of the
    least peak, or None when none lowers the peak to `WORTH` of the unbanded one."""
    plans = candidates(func, n_inputs, n_trainable)
    if not plans:
        return None
    least = min(p.peak for p in plans)
    chosen = min((p for p in plans if p.peak <= SLACK * least), key=lambda p: p.again)
    return chosen if chosen.peak <= WORTH * chosen.unbanded_peak else None


@relax.expr_functor.mutator
class _Banded(relax.PyExprMutator):
    """The function with `plan`'s members computed per band at the cut, T their concatenation."""

    def __init__(self, plan: Plan, func: relax.Function):
        super().__init__()
        self.plan, self.func = plan, func
        self.bindings = list(func.body.blocks[0].bindings)
        self.skipped = {self.bindings[i].var for i in plan.members}
        data = {func.params[0], *self.skipped}
        self.ops = _summary(func, self.bindings, data)
        # a member's output (or the input batch) -> its binding index: what each band computes again
        self.index = {self.bindings[i].var: i for i in plan.members} | {func.params[0]: INPUT}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.skipped:
            return super().visit_var_binding_(binding)
        if binding.var.same_as(self.bindings[self.plan.cut].var):
            bands = [self._band(rows, k) for k, rows in enumerate(self.plan.rows)]
            whole = self.builder_.emit(relax.op.concat(bands, axis=2), binding.var.name)
            self.set_var_remap(binding.var, whole)
        return None

    def _band(self, rows: tuple[int, int], k: int) -> relax.Var:
        """Emit band `k` of the cut tensor: every member on the rows it needs for `rows`."""
        x = self.func.params[0]
        need = _needs(self.ops, self.plan.members, rows, _height(x))
        index = self.index
        band: dict[int, tuple[relax.Expr, int]] = {INPUT: (self.visit_expr(x), 0)}  # index -> (its band, its first row)

        def rows_of(v: relax.Expr, want: tuple[int, int]) -> relax.Expr:
            if v not in index:  # a weight, a bias: broadcast over rows
                return self.visit_expr(v)
            have, a = band[index[v]]
            if (a, a + int(have.ty.shape[2])) == want:
                return have
            sliced = relax.op.strided_slice(have, axes=[2], begin=[want[0] - a], end=[want[1] - a])
            return self.builder_.emit(sliced, f"{v.name}_rows")

        for i in self.plan.members:
            if i not in need:
                continue
            b, r = self.bindings[i], need[i]
            call = b.value
            conv = self.ops[i].conv
            if conv is not None:
                data, w = call.args
                a, e, top, bottom = _conv_rows(conv, r, _height(data))
                at = call.attrs
                pad = (top, int(at.padding[1]), bottom, int(at.padding[3]))
                out_dtype = None if at.out_dtype is None or str(at.out_dtype) in ("", "void") else str(at.out_dtype)
                value = relax.op.nn.conv2d(
                    rows_of(data, (a, e)), self.visit_expr(w), at.strides, pad, at.dilation, int(at.groups), out_dtype=out_dtype
                )
            else:
                args = [rows_of(arg, r) if arg in index else arg for arg in call.args]
                value = relax.Call(call.op, args, call.attrs, call.ty_args)
            band[i] = (self.builder_.emit(value, f"{b.var.name}_band{k}"), r[0])
        return band[self.plan.cut][0]


def banded(func: relax.Function, n_inputs: int, n_trainable: int, chosen: Plan | None = None) -> relax.Function:
    """`func` with its frozen first layers computed in row bands as `chosen` says (by default
    `plan`'s choice, for `func` with its unused bindings removed), or `func` when nothing is chosen."""
    if chosen is None:  # the frozen layers' int8 activations as the step computes them, their units whole
        trainable = list(func.params[len(func.params) - n_trainable :]) if n_trainable else []
        func = frozen_quantized_values(relax.analysis.remove_all_unused(func), trainable)
        chosen = plan(func, n_inputs, n_trainable)
    if chosen is None:
        return func
    return _Banded(chosen, func).visit_expr(func)
