"""Recurrent ONNX ops (GRU, LSTM, RNN) written out step by step in the plain ops TVM imports.

Why: TVM 0.27's ONNX frontend has no importer for GRU, LSTM or RNN, and PyTorch writes
`nn.GRU`, `nn.LSTM` (and, with the legacy exporter, `nn.RNN`) as those nodes. A training step
has a fixed input shape, so the sequence length is a constant: `unroll_recurrent` replaces each
node by its time steps in MatMul, Add, Mul, Sub, Sigmoid, Tanh, Relu, Slice, Split, Concat,
Transpose, Reshape and Gather, ops planner differentiates, following the ONNX operator spec
(gate order LSTM iofc, GRU zrh; `linear_before_reset`; `direction`; `layout`; B, initial_h,
initial_c and P optional; Y, Y_h and Y_c written only where something reads them).

Per direction, X·Wᵀ (+ the biases that stay outside the recurrence) is one MatMul over all time
steps, split into steps once; a step is H·Rᵀ and its gates. The node's W, R, B (and P, initial
states) stay the initializers they were, each first read by a Gather of one direction, so a step
trains the tensors the file holds and the fine-tuned model is written back as the recurrent node
it was. A planner layer trains one weight and one bias, so each of those tensors is a layer of
its own, named as PyTorch names it: the k-th recurrent node of module `rnn` has
`rnn.weight_ih_l{k}` (W), `rnn.weight_hh_l{k}` (R) and `rnn.bias_l{k}` (B: the input and
hidden biases together; a bidirectional node's tensors hold both directions). The Gather that
first reads a tensor is named by that path in the legacy exporter's style, which is how
`names.layer_name` reads it for either exporter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from planner.errors import BadInput
from planner.inputs.names import module_path

_GATES = {"GRU": 3, "LSTM": 4, "RNN": 1}
_DEFAULT_ACTIVATIONS = {"GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh"), "RNN": ("Tanh",)}
# The spec's activations planner differentiates (the spec spells them in either case).
_ACTIVATION_OPS = {"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu"}
# The layer-table name of the tensor in each input slot (suffixed `_l{k}`): PyTorch's where it has one.
_SLOT_NAMES = {1: "weight_ih", 2: "weight_hh", 3: "bias", 5: "initial_h", 6: "initial_c", 7: "peephole"}


def unroll_recurrent(proto: onnx.ModelProto) -> None:
    """Every GRU, LSTM and RNN node of `proto`'s graph replaced by its unrolled steps (in place;
    its batch already bound). Raises BadInput for what the unrolled form cannot express."""
    g = proto.graph
    if not any(_is_recurrent(n) for n in g.node):
        return
    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True).graph
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in [*inferred.input, *inferred.value_info]}
    shapes |= {t.name: list(t.dims) for t in g.initializer}
    constants = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    constants |= {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in g.node if n.op_type == "Constant" and n.attribute}
    used = _reads(g) | {o.name for o in g.output}
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 17)
    per_module: dict[str, int] = {}
    nodes: list[onnx.NodeProto] = []
    for node in g.node:
        if not _is_recurrent(node):
            nodes.append(node)
            continue
        module = module_path(node) or node.name
        index = per_module.get(module, 0)
        per_module[module] = index + 1
        steps = _Unrolled(node, f"{module}.", f"_l{index}", opset)
        steps.build(_sequence_length(node, shapes), shapes, constants, used)
        nodes += steps.nodes
    del g.node[:]
    g.node.extend(nodes)


def _is_recurrent(node: onnx.NodeProto) -> bool:
    return node.op_type in _GATES and node.domain in ("", "ai.onnx")


def _reads(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name the graph's nodes read, inside subgraphs too."""
    names: set[str] = set()
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                names |= _reads(sub)
    return names


def _sequence_length(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int:
    """The node's sequence length (0 in `shapes`: a dimension shape inference does not know)."""
    layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
    dims = shapes.get(node.input[0], [])
    length = dims[1 if layout else 0] if len(dims) == 3 else 0
    if not length:
        raise BadInput(
            f"{node.op_type} node '{node.name}': its sequence length is not a fixed dimension of the model input "
            "(planner unrolls the recurrence over a static sequence)"
        )
    return length


class _Unrolled:
    """The nodes that replace one recurrent node: tensors named under the node's name, the first
    read of each parameter named `/<module path>/<tensor name>/...` for the layer table."""

    def __init__(self, node: onnx.NodeProto, prefix: str, suffix: str, opset: int) -> None:
        self.node, self.prefix, self.suffix, self.opset = node, prefix, suffix, opset
        self.nodes: list[onnx.NodeProto] = []
        self.attrs: dict[str, Any] = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self.count = 0
        self.constants: dict[tuple, str] = {}  # one Constant per value: steps repeat the same slice bounds

    def op(self, op_type: str, inputs: Sequence[str], output: str | None = None, name: str | None = None, **attrs) -> str:
        """One node; its output's name (`output` when given: an output of the recurrent node)."""
        self.count += 1
        out = output or f"{self.node.name}/{op_type}_{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=name or out, **attrs))
        return out

    def const(self, value: np.ndarray | list | int | float, dtype: type = np.int64) -> str:
        array: np.ndarray = np.asarray(value, dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self.constants:
            self.count += 1
            out = self.constants[key] = f"{self.node.name}/const_{self.count}"
            self.nodes.append(helper.make_node("Constant", [], [out], name=out, value=numpy_helper.from_array(array)))
        return self.constants[key]

    def zeros(self, hidden: int) -> str:
        """A missing initial state: zeros [1, H], broadcast over the batch."""
        return self.const(np.zeros((1, hidden)), np.float32)

    def slice(self, x: str, start: int, end: int, axis: int = -1) -> str:
        return self.op("Slice", [x, self.const([start]), self.const([end]), self.const([axis])])

    def split(self, x: str, parts: int, size: int) -> list[str]:
        """`x` [N, parts·size] as `parts` tensors [N, size] (one node: its gradient is one Concat)."""
        self.count += 1
        outs = [f"{self.node.name}/Split_{self.count}_{i}" for i in range(parts)]
        name = f"{self.node.name}/Split_{self.count}"
        if self.opset >= 13:
            node = helper.make_node("Split", [x, self.const([size] * parts)], outs, name=name, axis=1)
        else:
            node = helper.make_node("Split", [x], outs, name=name, axis=1, split=[size] * parts)
        self.nodes.append(node)
        return outs

    def direction_of(self, tensor: str, slot: int, d: int, axis: int = 0) -> str:
        """Direction `d` of an input that has a num_directions axis; the first such read of a
        tensor is named for the layer table."""
        name = f"/{(self.prefix + _SLOT_NAMES[slot] + self.suffix).replace('.', '/')}/Gather_{d}"
        return self.op("Gather", [tensor, self.const(d)], name=name, axis=axis)

    def activation(self, name: str, x: str) -> str:
        return self.op(_ACTIVATION_OPS[name.lower()], [x])

    def build(self, seq: int, shapes: dict[str, list[int]], constants: dict[str, np.ndarray], used: set[str]) -> None:
        """The node's steps over a sequence of `seq`, its outputs under their names where `used`."""
        node, attrs = self.node, self.attrs
        op = node.op_type
        gates = _GATES[op]
        inputs = [*node.input, *[""] * (8 - len(node.input))]
        x, w, r, b, lens, h0, c0, peep = inputs
        hidden: int = attrs.get("hidden_size") or shapes[r][-1]  # optional in the spec: R is [D, G, H]
        direction = attrs.get("direction", b"forward").decode()
        directions = 2 if direction == "bidirectional" else 1
        layout = attrs.get("layout", 0)
        activations = [a.decode() for a in attrs.get("activations", [])] or list(_DEFAULT_ACTIVATIONS[op]) * directions
        self._check(seq, constants.get(lens) if lens else None, lens, activations)
        per_direction = len(activations) // directions
        width = gates * hidden
        xb = x if layout else self.op("Transpose", [x], perm=[1, 0, 2])  # [N, S, I]: a step is a column block
        ys, hs, cs = [], [], []
        for d in range(directions):
            acts = activations[d * per_direction : (d + 1) * per_direction]
            pre = self.op("MatMul", [xb, self.op("Transpose", [self.direction_of(w, 1, d)], perm=[1, 0])])  # [N, S, G]
            rt_all = self.op("Transpose", [self.direction_of(r, 2, d)], perm=[1, 0])  # [H, G]
            r_t: str | tuple[str, str] = rt_all
            if op == "GRU" and not attrs.get("linear_before_reset", 0):  # Rhᵀ multiplies rt ⊙ Ht-1, apart
                r_t = (self.slice(rt_all, 0, 2 * hidden), self.slice(rt_all, 2 * hidden, 3 * hidden))
            step_bias = ""  # none: the biases are all in the precomputed X·Wᵀ
            if b:
                bias = self.direction_of(b, 3, d)
                wb, rb = self.slice(bias, 0, width), self.slice(bias, width, 2 * width)
                if op == "GRU" and attrs.get("linear_before_reset", 0):
                    pre, step_bias = self.op("Add", [pre, wb]), rb  # Rbh is reset with Ht-1·Rhᵀ
                else:
                    pre = self.op("Add", [pre, self.op("Add", [wb, rb])])
            xs = self.split(self.op("Reshape", [pre, self.const([0, -1])]), seq, width)
            h = self.direction_of(h0, 5, d, axis=layout) if h0 else self.zeros(hidden)
            c = (self.direction_of(c0, 6, d, axis=layout) if c0 else self.zeros(hidden)) if op == "LSTM" else ""  # no cell
            p = self.direction_of(peep, 7, d) if peep else ""  # no peepholes
            outs: list[str] = [""] * seq
            order = range(seq - 1, -1, -1) if direction == "reverse" or d == 1 else range(seq)
            step = {"GRU": self._gru, "LSTM": self._lstm, "RNN": self._rnn}[op]
            for t in order:
                h, c = step(xs[t], h, c, r_t, step_bias, p, acts, hidden)
                outs[t] = h
            ys.append(outs)
            hs.append(h)
            cs.append(c)
        y, y_h, y_c = [*node.output, "", ""][:3]
        if y in used:
            last = y if layout else None  # layout 1 is [N, S, D, H] as built; layout 0 is it transposed
            shape = self.const([0, seq, 1, hidden])
            per_dir = [self.op("Reshape", [self.op("Concat", o, axis=1), shape], last if directions == 1 else None) for o in ys]
            joined = per_dir[0] if directions == 1 else self.op("Concat", per_dir, last, axis=2)
            if not layout:
                self.op("Transpose", [joined], y, perm=[1, 2, 0, 3])
        for final, name in ((hs, y_h), (cs, y_c)):
            if name and name in used:
                shape = self.const([-1, 1, hidden] if layout else [1, -1, hidden])
                if directions == 1:
                    self.op("Reshape", [final[0], shape], name)
                else:
                    self.op("Concat", [self.op("Reshape", [f, shape]) for f in final], name, axis=layout)

    def _check(self, seq: int, lens_value: np.ndarray | None, lens: str, activations: list[str]) -> None:
        """Refuse what the unrolled steps would compute differently from the node."""
        node = self.node
        where = f"{node.op_type} node '{node.name}'"
        if lens and (lens_value is None or np.any(np.asarray(lens_value) != seq)):
            raise BadInput(
                f"{where}: sequence_lens must be a constant equal to the sequence length ({seq}) for every sample "
                "(planner unrolls full sequences only; pad to the full length instead of passing lengths)"
            )
        # The spec does not say whether `clip` bounds h(Ct)'s input, nor how `input_forget` couples the gates.
        if "clip" in self.attrs:
            raise BadInput(f"{where}: cell clipping (`clip`) is not supported")
        if self.attrs.get("input_forget", 0):
            raise BadInput(f"{where}: coupled input and forget gates (`input_forget`) are not supported")
        unknown = sorted({a for a in activations if a.lower() not in _ACTIVATION_OPS})
        if unknown:
            raise BadInput(f"{where}: activations {unknown} are not supported (planner trains through Sigmoid, Tanh and Relu)")

    def _rnn(self, xt, h, c, r_t, step_bias, p, acts, hidden):
        """Ht = f(Xt·Wᵀ + Wb + Rb + Ht-1·Rᵀ)."""
        return self.activation(acts[0], self.op("Add", [xt, self.op("MatMul", [h, r_t])])), c

    def _gru(self, xt, h, c, r_t, step_bias, p, acts, hidden):
        """zt, rt = f(Xt·Wzrᵀ + Ht-1·Rzrᵀ + biases); ht = g(Xt·Whᵀ + Wbh + rt ⊙ (Ht-1·Rhᵀ + Rbh)) with
        `linear_before_reset`, else g(Xt·Whᵀ + (rt ⊙ Ht-1)·Rhᵀ + Wbh + Rbh); Ht = ht + zt ⊙ (Ht-1 - ht).
        `r_t` is Rᵀ, or (Rzrᵀ, Rhᵀ) without `linear_before_reset`."""
        f, g = acts
        if isinstance(r_t, tuple):
            hzr = self.op("MatMul", [h, r_t[0]])
        else:
            hr = self.op("MatMul", [h, r_t])
            hr = self.op("Add", [hr, step_bias]) if step_bias else hr
            hzr, hh = self.slice(hr, 0, 2 * hidden), self.slice(hr, 2 * hidden, 3 * hidden)
        zr = self.activation(f, self.op("Add", [self.slice(xt, 0, 2 * hidden), hzr]))
        z, rt = self.slice(zr, 0, hidden), self.slice(zr, hidden, 2 * hidden)
        if isinstance(r_t, tuple):
            reset = self.op("MatMul", [self.op("Mul", [rt, h]), r_t[1]])
        else:
            reset = self.op("Mul", [rt, hh])
        ht = self.activation(g, self.op("Add", [self.slice(xt, 2 * hidden, 3 * hidden), reset]))
        return self.op("Add", [ht, self.op("Mul", [z, self.op("Sub", [h, ht])])]), c

    def _lstm(self, xt, h, c, r_t, step_bias, p, acts, hidden):
        """it, ft = f(Xt·Wᵀ + Ht-1·Rᵀ + biases [+ P ⊙ Ct-1]); ct = g(...); Ct = ft ⊙ Ct-1 + it ⊙ ct;
        ot = f(... [+ P ⊙ Ct]); Ht = ot ⊙ h(Ct)."""
        f, g, act_h = acts
        gates = self.op("Add", [xt, self.op("MatMul", [h, r_t])])

        def gate(k: int, state: str) -> str:
            pre = self.slice(gates, k * hidden, (k + 1) * hidden)
            if p:
                pre = self.op("Add", [pre, self.op("Mul", [self.slice(p, k * hidden, (k + 1) * hidden), state])])
            return self.activation(f, pre)

        i = gate(0, c)  # peepholes P are iof, like the gates
        forget = gate(2, c)
        candidate = self.activation(g, self.slice(gates, 3 * hidden, 4 * hidden))
        c_new = self.op("Add", [self.op("Mul", [forget, c]), self.op("Mul", [i, candidate])])
        o = gate(1, c_new)
        return self.op("Mul", [o, self.activation(act_h, c_new)]), c_new
