"""The operator table's proof: forms of every operator, and the checks each form must pass.

A `Case` is one ONNX node in one attribute and shape form: its inputs are data (a model input,
batch first), parameters (trained initializers) or constants (indices, shapes, bounds). Checks:

- `gradient_check` (every form of a *trains* row): the node imported as planner imports a model
  (`fixups.for_import`, `importer.to_relax`, `graph.inference_form`), differentiated by Relax's
  gradient pass with planner's gradients in force, built by TVM's default (unscheduled) lowering
  in float64 — against central finite differences of `onnx.reference.ReferenceEvaluator` running
  the original node in float64, for every data and parameter input a gradient reaches;
- `pipeline_check` (every form): the node inside a classifier (each data input scaled by a trained
  per-feature parameter first, then the node, a Flatten and a Linear head), compiled by planner's
  own pipeline and stepped once: the loss matches ONNX's float64 reference, and for a *trains*
  form every trained tensor's update matches finite differences of it; a *frozen only* form is
  compiled with only the head trained (the node in the frozen part) and its logits must match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from tvm import relax

from builders import REFERENCE_OPS

_FLOAT = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE}


@dataclass(frozen=True)
class Data:
    """A data input: a model input whose first axis is the batch. Floats are drawn uniformly from
    [low, high]; integers from [low, high); `dtype` bool draws True and False."""

    shape: tuple[int, ...]
    low: float = -1.5
    high: float = 1.5
    dtype: str = "float32"


@dataclass(frozen=True)
class Param:
    """A trained parameter (an initializer), drawn uniformly from [low, high]."""

    shape: tuple[int, ...]
    low: float = -1.0
    high: float = 1.0


@dataclass(frozen=True)
class Const:
    """A constant input (indices, a shape, bounds): a Constant node, never a parameter."""

    value: np.ndarray


Input = Data | Param | Const | None  # None: an optional input left out


@dataclass(frozen=True)
class Case:
    op: str
    form: str
    inputs: tuple[Input, ...]
    attrs: dict = field(default_factory=dict)
    opset: int = 20
    outputs: int = 1  # how many outputs the node has; the loss reads the first
    float32: bool = False  # TVM has the op in float32 only (its layer norm): checked in float32
    tolerance: float = 1e-6
    # its output is a loss reduced over the batch, a scalar: not a layer of a classifier, so the
    # pipeline runs it as a model's own loss (tests/test_tasks.py: the detector) and not in `pipeline_check`
    scalar: bool = False

    @property
    def allowed(self) -> float:
        """The relative error a correct gradient may show: float64's, or float32's rounding."""
        return 1e-4 if self.float32 else self.tolerance

    @property
    def id(self) -> str:
        return f"{self.op}[{self.form}]"

    @property
    def batch(self) -> int:
        return next(i.shape[0] for i in self.inputs if isinstance(i, Data))


def _tensor_type(dtype: str, double: bool) -> int:
    if dtype == "float32":
        return TensorProto.DOUBLE if double else TensorProto.FLOAT
    return {"int64": TensorProto.INT64, "int32": TensorProto.INT32, "bool": TensorProto.BOOL}[dtype]


def _const_node(name: str, value: np.ndarray, double: bool) -> onnx.NodeProto:
    value = np.asarray(value)
    if double and value.dtype == np.float32:
        value = value.astype(np.float64)
    return helper.make_node("Constant", [], [name], name=f"const_{name}", value=numpy_helper.from_array(value, name))


def draw(case: Case, seed: int = 0) -> list[np.ndarray]:
    """Values for the case's data and parameter inputs, in input order (float64 for floats)."""
    rng = np.random.default_rng(seed)
    values = []
    for spec in case.inputs:
        if isinstance(spec, Data) and spec.dtype != "float32":
            if spec.dtype == "bool":
                values.append(rng.random(spec.shape) < 0.5)
            else:
                values.append(rng.integers(int(spec.low), int(spec.high), spec.shape).astype(spec.dtype))
        elif isinstance(spec, (Data, Param)):
            values.append(rng.uniform(spec.low, spec.high, spec.shape))
    return values


# ---------------------------------------------------------------------------- the node on its own


_STASHED = ("GroupNormalization",)


def node_model(case: Case, double: bool = True) -> onnx.ModelProto:
    """The node alone: data inputs `d0, d1, ...`, then parameters `p0, ...` as graph inputs,
    constants as Constant nodes; output `y` (the node's first output)."""
    inputs, names, nodes = [], [], []
    d = p = 0
    for i, spec in enumerate(case.inputs):
        if spec is None:
            names.append("")
        elif isinstance(spec, Const):
            nodes.append(_const_node(f"c{i}", spec.value, double))
            names.append(f"c{i}")
        elif isinstance(spec, Data):
            inputs.append(helper.make_tensor_value_info(f"d{d}", _tensor_type(spec.dtype, double), spec.shape))
            names.append(f"d{d}")
            d += 1
        else:
            inputs.append(helper.make_tensor_value_info(f"p{p}", _tensor_type("float32", double), spec.shape))
            names.append(f"p{p}")
            p += 1
    outs = ["y"] + [f"y{k}" for k in range(1, case.outputs)]
    attrs = dict(case.attrs)
    if double and attrs.get("to") == TensorProto.FLOAT:  # a cast to float32 would round the reference
        attrs["to"] = TensorProto.DOUBLE
    if double and case.op in _STASHED:  # statistics in float32 by default (`stash_type`): in float64 here
        attrs.setdefault("stash_type", TensorProto.DOUBLE)
    nodes.append(helper.make_node(case.op, names, outs, name="op", **attrs))
    opsets = [helper.make_opsetid("", case.opset)]
    untyped = helper.make_model(
        helper.make_graph(nodes, case.id, inputs, [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)]),
        opset_imports=opsets,
    )
    y = reference(case, untyped, [a if a.dtype != np.float64 or double else a.astype(np.float32) for a in draw(case)])
    output = helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(y.dtype), y.shape)
    return helper.make_model(helper.make_graph(nodes, case.id, inputs, [output]), opset_imports=opsets)


def reference(case: Case, model: onnx.ModelProto, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The node's first output by ONNX's reference runtime."""
    feeds = {i.name: a for i, a in zip(model.graph.input, arrays)}
    return np.asarray(ReferenceEvaluator(model, new_ops=REFERENCE_OPS).run(["y"], feeds)[0])


def differentiated(case: Case) -> list[int]:
    """The inputs (positions among data and parameter inputs) a gradient reaches: floats the
    table's row passes a gradient to."""
    from planner.inputs.operators import OPERATORS

    row = OPERATORS[case.op]
    out, k = [], 0
    for slot, spec in enumerate(case.inputs):
        if isinstance(spec, (Data, Param)):
            if (isinstance(spec, Param) or spec.dtype == "float32") and row.passes_to(slot):
                out.append(k)
            k += 1
    return out


def _retyped_attrs(attrs: tvm.ir.Attrs) -> tvm.ir.Attrs:
    info = type(attrs).__tvm_ffi_type_info__
    fields = {f.name: getattr(attrs, f.name) for f in info.fields}
    if not any(k in ("dtype", "out_dtype") and str(v) == "float32" for k, v in fields.items()):
        return attrs
    return tvm.ir.make_node(
        info.type_key, **{k: "float64" if k in ("dtype", "out_dtype") and str(v) == "float32" else v for k, v in fields.items()}
    )


def _float64(func: relax.Function) -> relax.Function:
    """`func` computing in float64 wherever it computed in float32: parameters, constants and
    every dtype an op's attributes name. Why: TVM's ONNX frontend writes float32 constants into
    float64 graphs (ELU's 1.0, a mask's cast), so a float64 file does not import; the float32
    import is planner's own, and float64 makes its gradient exact enough to compare at 1e-6."""

    def retype(ty):
        return relax.TensorType(ty.shape, "float64") if isinstance(ty, relax.TensorType) and ty.dtype == "float32" else ty

    params = [relax.Var(v.name, retype(v.ty)) for v in func.params]
    mapping = dict(zip(func.params, params))

    @relax.expr_functor.mutator
    class Retype(relax.PyExprMutator):
        def visit_var_(self, var):
            return mapping[var] if var in mapping else super().visit_var_(var)

        def visit_call_(self, call):
            call = super().visit_call_(call)
            if isinstance(call.op, tvm.ir.Op) and call.attrs is not None:
                attrs = _retyped_attrs(call.attrs)
                if not attrs.same_as(call.attrs):
                    return relax.Call(call.op, call.args, attrs, call.ty_args)
            return call

        def visit_generic_const_(self, const):
            if str(const.value.dtype) == "float32":
                return relax.const(const.value.numpy().astype(np.float64), "float64")
            return const

    body = Retype().visit_expr(func.body)
    return relax.Function(params, body, None, func.is_pure, func.attrs)


def planner_gradients(case: Case, arrays: Sequence[np.ndarray], cotangent: np.ndarray) -> tuple[float, list[np.ndarray]]:
    """`sum(node(arrays) * cotangent)` and its gradient for each `differentiated` input, as
    planner's import and gradients give them (the float32 graph planner imports, computed in
    float64: `_float64`; float32 where TVM has the op in float32 only, `Case.float32`), built by
    TVM's default lowering."""
    from planner.backend.graph import gradients
    from planner.backend.graph.importer import to_relax
    from planner.backend.graph.training import inference_form
    from planner.inputs.fixups import for_import

    model = node_model(case, double=False)
    source = to_relax(for_import(model, case.batch, set()))
    main = source.func if case.float32 else _float64(source.func)
    dtype = "float32" if case.float32 else "float64"
    wanted = differentiated(case)
    params = [relax.Var(v.name, v.ty) for v in main.params]
    bb = relax.BlockBuilder()
    main_gv = bb.add_func(main, "node")
    with bb.function("loss", params):
        with bb.dataflow():
            y = bb.emit(relax.Call(main_gv, params))
            product = bb.emit(relax.op.multiply(y, relax.const(cotangent.astype(dtype), dtype)))
            loss = bb.emit_output(relax.op.sum(product))
        bb.emit_func_output(loss)
    built = bb.get()
    mod = source.with_kernels({"loss": built["loss"].inline_functions({"node": main})})
    mod = inference_form(mod)
    with gradients.installed():
        mod = relax.transform.Gradient("loss", require_grads=[mod["loss"].params[i] for i in wanted])(mod)
    executable = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(executable, tvm.cpu())
    feeds = [np.ascontiguousarray(a.astype(dtype) if a.dtype == np.float64 else a) for a in arrays]
    value, grads = vm["loss_adjoint"](*[tvm.runtime.tensor(a) for a in feeds])
    return float(value.numpy()), [g.numpy().astype(np.float64) for g in grads]


def gradient_check(case: Case, entries: int = 24, h: float = 1e-6, seed: int = 0) -> dict[str, float]:
    """Relative error of planner's float64 gradient of each differentiated input against central
    differences of the reference runtime (at most `entries` entries each, boundary ones among
    them), and of the loss itself (key "loss")."""
    arrays = draw(case, seed)
    model = node_model(case, double=True)
    y = reference(case, model, arrays)
    cotangent = np.random.default_rng(seed + 1).normal(0, 1, y.shape)

    def loss(values: Sequence[np.ndarray]) -> float:
        return float((reference(case, model, values) * cotangent).sum())

    value, grads = planner_gradients(case, arrays, cotangent)
    errors = {"loss": abs(value - loss(arrays)) / max(abs(loss(arrays)), 1e-12)}
    rng = np.random.default_rng(seed + 2)
    for k, grad in zip(differentiated(case), grads):
        size = arrays[k].size
        picked = np.unique(np.r_[0, size - 1, rng.choice(size, size=min(size, entries), replace=False)])
        fd = []
        for i in picked:
            plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
            plus[k].ravel()[i] += h
            minus[k].ravel()[i] -= h
            fd.append((loss(plus) - loss(minus)) / (2 * h))
        ours = grad.ravel()[picked]
        errors[model.graph.input[k].name] = float(np.linalg.norm(ours - fd) / max(np.linalg.norm(fd), 1e-12))
    return errors


# ---------------------------------------------------------------------------- the node in a model

N_CLASSES = 3


def classifier(case: Case, path: Path, seed: int = 0) -> tuple[Path, list[np.ndarray]]:
    """The node in a classifier, saved at `path`: each float data input `x{i}` scaled by a
    trained `pre{i}` of its sample shape, the node, a Cast to float (a comparison's output), a
    Flatten and a Linear head `fc`. Returns the path and the data inputs' values (batch first)."""
    rng = np.random.default_rng(seed)
    values = draw(case, seed)
    data = [v for v, spec in zip(values, (i for i in case.inputs if isinstance(i, (Data, Param)))) if isinstance(spec, Data)]
    params = [v for v, spec in zip(values, (i for i in case.inputs if isinstance(i, (Data, Param)))) if isinstance(spec, Param)]
    inputs, names, nodes, inits = [], [], [], []
    d = p = 0
    for i, spec in enumerate(case.inputs):
        if spec is None:
            names.append("")
        elif isinstance(spec, Const):
            nodes.append(_const_node(f"c{i}", spec.value, double=False))
            names.append(f"c{i}")
        elif isinstance(spec, Data):
            name = f"x{d}"
            inputs.append(helper.make_tensor_value_info(name, _tensor_type(spec.dtype, False), ["N", *spec.shape[1:]]))
            if spec.dtype == "float32":
                scale = rng.uniform(0.9, 1.1, (1, *spec.shape[1:])).astype(np.float32)
                inits.append(numpy_helper.from_array(scale, f"pre{d}"))
                nodes.append(helper.make_node("Mul", [name, f"pre{d}"], [f"{name}s"], name=f"pre{d}"))
                name = f"{name}s"
            names.append(name)
            d += 1
        else:
            inits.append(numpy_helper.from_array(params[p].astype(np.float32), f"op.p{p}"))
            names.append(f"op.p{p}")
            p += 1
    outs = ["y"] + [f"y{k}" for k in range(1, case.outputs)]
    nodes.append(helper.make_node(case.op, names, outs, name="op", **case.attrs))
    nodes.append(helper.make_node("Cast", ["y"], ["yf"], name="to_float", to=TensorProto.FLOAT))
    nodes.append(helper.make_node("Flatten", ["yf"], ["flat"], name="flat"))
    width = int(np.prod(reference(case, node_model(case, double=True), values).shape[1:]))
    head = rng.normal(0, 1 / np.sqrt(width), (N_CLASSES, width)).astype(np.float32)
    inits += [numpy_helper.from_array(head, "fc.weight"), numpy_helper.from_array(np.zeros(N_CLASSES, np.float32), "fc.bias")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1))
    graph = helper.make_graph(
        nodes, case.id, inputs, [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", N_CLASSES])], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path, [a.astype(np.float32) if a.dtype == np.float64 else a for a in data]


def classifier_loss(model: onnx.ModelProto, weights: dict[str, np.ndarray], xs: Sequence[np.ndarray], y: np.ndarray) -> float:
    """Mean cross-entropy of the classifier by the reference runtime in float64."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for i, t in enumerate(m.graph.initializer):
        m.graph.initializer[i].CopyFrom(numpy_helper.from_array(weights[t.name].astype(np.float64), t.name))
    for v in m.graph.input:
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    m.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    for node in m.graph.node:
        if node.op_type == "Constant":
            value = numpy_helper.to_array(node.attribute[0].t)
            if value.dtype == np.float32:
                node.attribute[0].t.CopyFrom(numpy_helper.from_array(value.astype(np.float64), node.attribute[0].t.name))
        for a in node.attribute:
            if a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE
    feeds = {i.name: (x.astype(np.float64) if x.dtype == np.float32 else x) for i, x in zip(m.graph.input, xs)}
    logits = ReferenceEvaluator(m, new_ops=REFERENCE_OPS).run(None, feeds)[0]
    logits = logits - logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


Cases = Callable[[], list[Case]]


def pipeline_check(case: Case, directory: Path, entries: int = 8, h: float = 1e-4, frozen: bool = False) -> dict[str, float]:
    """The case in a classifier through planner's pipeline (see the module docstring): relative
    errors of the logits and the loss against the reference, and of each trained tensor's
    gradient against central differences (float64 reference, float32 step). `frozen`: only the
    head trained, the node in the frozen part, whatever the table says of it."""
    from planner.backend.lower.pipeline import BuildOptions
    from planner.backend.vm.compile import compile_candidate
    from planner.inputs.model import load_model
    from planner.runtime.session import TrainingSession
    from planner.types import Candidate

    path, xs = classifier(case, directory / "model.onnx")
    model = load_model(path)
    proto = onnx.load(str(path))
    from planner.inputs.operators import OPERATORS

    zero = OPERATORS[case.op].zero_gradient  # a path through it teaches nothing: the layers before it stop there
    trains = form_support(case) == "trains" and not frozen and not zero
    layers = [layer for layer in model.layers if trains or layer.name == "fc"]
    untrainable = {layer.name: layer.problem for layer in layers if not layer.trainable}
    assert not untrainable, f"inspect refuses layers the table trains: {untrainable}"
    if form_support(case) != "trains" or zero:  # the layers before the node: inspect names the node that stops their gradient
        before = [layer for layer in model.layers if layer.name.startswith("pre") or layer.name.startswith("op")]
        wrong = {layer.name: layer.problem for layer in before if layer.trainable or "'op'" not in (layer.problem or "")}
        assert not wrong, f"a frozen-only or zero-gradient node must stop the gradient of the layers before it: {wrong}"
    candidate = Candidate(tuple((layer.name, "full") for layer in layers), case.batch, "sgd", 1.0)
    step = compile_candidate(model, candidate, BuildOptions(tvm.target.Target({"kind": "llvm"})))
    w0 = {k: v.astype(np.float32) for k, v in model.initializers.items()}
    session = TrainingSession(step.library, step.signature, w0)
    labels = np.random.default_rng(3).integers(0, N_CLASSES, case.batch)
    inputs = xs[0] if len(xs) == 1 else tuple(xs)
    logits = session.outputs(inputs)
    expected = ReferenceEvaluator(proto, new_ops=REFERENCE_OPS).run(None, {i.name: x for i, x in zip(proto.graph.input, xs)})[0]
    errors = {"logits": float(np.abs(logits - expected).max() / max(np.abs(expected).max(), 1e-6))}
    loss = session.step(inputs, labels)
    reference_loss = classifier_loss(proto, w0, xs, labels)
    errors["loss"] = abs(loss - reference_loss) / max(abs(reference_loss), 1e-6)
    if not trains:
        return errors
    after = session.weights()
    rng = np.random.default_rng(4)
    for name in step.signature.trainable:
        grad = (w0[name].astype(np.float64) - after[name].astype(np.float64)).ravel()
        picked = rng.choice(grad.size, size=min(grad.size, entries), replace=False)
        fd = []
        for i in picked:
            plus = {k: v.astype(np.float64) for k, v in w0.items()}
            minus = {k: v.astype(np.float64) for k, v in w0.items()}
            plus[name].ravel()[i] += h
            minus[name].ravel()[i] -= h
            fd.append((classifier_loss(proto, plus, xs, labels) - classifier_loss(proto, minus, xs, labels)) / (2 * h))
        errors[name] = float(np.linalg.norm(grad[picked] - fd) / max(np.linalg.norm(fd), 1e-8))
    return errors


def form_support(case: Case) -> str:
    """What the table says of this form of the node ("trains", "frozen only" or "refused")."""
    from planner.inputs.fixups import constant_values, tensor_info
    from planner.inputs.operators import Node, support

    model = node_model(case, double=False)
    node = next(n for n in model.graph.node if n.name == "op")
    return support(Node(node, constant_values(model.graph), tensor_info(model)[1]))[0].value
