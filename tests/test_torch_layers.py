"""Every torch.nn layer and functional op of `torch_layers.LAYERS`, as both exporters write it,
against the operator table and planner's step.

For each entry and exporter (`survey`):

- the graph as planner analyses it (`fixups.for_import` at batch 1, as `load_model` does) holds no
  operator the table lacks (`operators.operator(node) is not None`);
- `load_model` either loads it or raises `UnsupportedOp` naming a node of that graph the table
  refuses (in that form);
- a loaded model passes `planner.api.inspect` (TVM imports it), and one SGD step training every
  layer `inspect` calls trainable compiles and runs: its logits and loss match ONNX's reference
  runtime on the same file in float64, and each trained tensor's update matches central finite
  differences of that reference's mean cross-entropy (`step_check`); the file's own logits match
  PyTorch's float64 forward (the exporter's faithfulness, so the reference is the model's).

ONNX's reference runtime is corrected where it is wrong or lacking for these files: grouped
`ConvTranspose` (it splits the weight along the wrong axis), negative `Pad`s (`F.pad` cropping),
`RNN` with a Relu activation, and `Erf`/`Gelu` (float32 inside, or tanh GELU computed exactly).

Runtime: about 6 minutes for the ~600 cases on 2 cores with the exports cached (a case is 0.3-1 s,
the first compile ~10 s); exporting them all first adds about 10 minutes.

`python tests/test_torch_layers.py [NAME ...]` prints the survey as a table; `--cover` recomputes
`torch_layers.CORE`, the entries the suite steps by default.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

torch = pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
import torch_layers as tl  # noqa: E402

from builders import REFERENCE_OPS  # noqa: E402
from torch_families import ExportFailed  # noqa: E402

pytestmark = pytest.mark.slow

BATCH = 3  # not the exported example's 2: a batch the exporter baked in would show
# Plain SGD with a large rate: float32 stores the updated weight, and with a small step its
# rounding (about 6e-8 of the weight) is what a comparison would see (test_pytorch_families.py).
LR = 1000.0
FD_STEP = 1e-5  # central differences of the float64 reference
FD_ENTRIES = 4  # entries of each trained tensor checked (every one of a smaller tensor)
GRADIENT_TOLERANCE = 2e-3  # relative (norm over the entries checked): float32 step against float64 differences
# ... of at least this norm: a gradient that is zero (a bias a normalization removes) is float32 noise
# in the step, up to ~2e-7 here
GRADIENT_FLOOR = 1e-3
LOGITS_TOLERANCE = 1e-4  # relative to the largest logit

# Entries an exporter of torch 2.13 cannot export (`survey` records its message): nothing for planner to check.
EXPORT_FAILURES: dict[str, set[str]] = {
    "legacy": {
        *("adaptiveavg1d_5", "adaptiveavg2d_4", "adaptivemax2d_4"),  # an output size that does not divide the input's
        *("rmsnorm", "rmsnorm_2d_shape", "rmsnorm_eps", "channelshuffle", "cumprod", "bilinear", "upsample_nearest_exact"),
        *("downsample_bilinear_antialias", "spectral_norm_linear", "spectral_norm_conv2d"),  # aten::vdot
        *("math_sinh", "math_cosh", "math_asinh", "math_acosh", "math_atanh", "math_expm1", "math_trunc_frac", "math_hypot"),
        *("threshold", "threshold_zero"),  # a non-zero threshold
        *("instancenorm2d_running", "lstm_proj", "maxunpool2d"),
    },
    "dynamo": {"adaptivemax2d_4", "cdist", "cumprod", "math_hypot", "rrelu_eval"},
}
# Exports that are not valid models: ONNX's own reference cannot run them.
BROKEN_EXPORTS: dict[tuple[str, str], str] = {
    ("lstm_proj", "dynamo"): "an LSTM node of hidden size proj_size, without the projection: W [1, 12, 8] for 6 hidden units",
    (
        "diagonal",
        "legacy",
    ): "a CumSum whose axis is [1], not a scalar (inside an If): the reference refuses it; planner reads it as 1",
}
# Entries whose export computes something else than PyTorch: planner is checked against the file,
# which is then not PyTorch's model.
EXPORTER_DEVIATIONS: dict[tuple[str, str], str] = {
    ("softplus_beta_threshold", "legacy"): "the legacy exporter drops Softplus's threshold (linear above it)",
    ("avgpool2d_divisor_override", "legacy"): "ONNX's AveragePool has no divisor_override: the exporter drops it",
    ("avgpool2d_divisor_override", "dynamo"): "ONNX's AveragePool has no divisor_override: the exporter drops it",
    **{
        ("topk_unsorted", e): "the order of an unsorted top-k is the implementation's: ONNX's is not PyTorch's"
        for e in ("legacy", "dynamo")
    },
}


# ------------------------------------------------------------------------------------ the survey


@dataclass
class NodeRecord:
    name: str
    op: str  # domain-qualified when not the standard one
    form: str  # the attributes that make its form, and the rank of its first input
    known: bool  # the table has the operator
    support: str  # trains / frozen only / refused, as the table says of this node
    why: str


@dataclass
class Survey:
    name: str
    exporter: str
    export_error: str | None = None
    file_ops: list[str] = field(default_factory=list)  # the operators of the file as exported
    nodes: list[NodeRecord] = field(default_factory=list)  # the graph as planner analyses it
    analysis_error: str | None = None
    load: str = ""  # "ok", or the error's type
    load_error: str | None = None
    inspect_error: str | None = None
    layers: list[tuple[str, str, str | None]] = field(default_factory=list)  # (name, op, problem)
    step_error: str | None = None
    errors: dict[str, float] = field(default_factory=dict)  # step_check's
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def unknown(self) -> list[NodeRecord]:
        return [n for n in self.nodes if not n.known]

    @property
    def trainable(self) -> list[str]:
        return [name for name, _, problem in self.layers if problem is None]


def _value(value) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, onnx.GraphProto):
        return "<graph>"
    if isinstance(value, onnx.TensorProto):
        return "<tensor>"
    return str(value)


def node_form(node: onnx.NodeProto, ranks: dict[str, int]) -> str:
    """`rank=4 group=2 dilations=[2,2] ...`: what tells a node's forms apart."""
    parts = []
    if node.input and node.input[0] in ranks:
        parts.append(f"rank={ranks[node.input[0]]}")
    for a in sorted(node.attribute, key=lambda a: a.name):
        if node.op_type == "Constant":
            continue
        parts.append(f"{a.name}={_value(onnx.helper.get_attribute_value(a))}")
    return " ".join(parts)


def _op_name(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def _walk_ops(graph: onnx.GraphProto) -> list[str]:
    out = []
    for node in graph.node:
        out.append(_op_name(node))
        for a in node.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                out += _walk_ops(sub)
    return out


def analysed_nodes(path: Path) -> list[NodeRecord]:
    """The graph `load_model` judges (`model._analyse`: the model bound to batch 1, constants
    folded, recurrent layers unrolled, decompositions applied), each node with the table's word on it."""
    from planner.inputs import fixups
    from planner.inputs.operators import operator, support
    from planner.inputs.trainability import Graph

    try:  # where the layer table lives (planner.inputs.model before it had a module of its own)
        from planner.inputs.layers import _analyse, parameters_of
    except ImportError:
        from planner.inputs.model import _analyse
        from planner.inputs.model import _parameters as parameters_of

    proto = onnx.load(str(path))
    fixups.name_nodes(proto.graph)
    fixups.tie_identities(proto.graph)
    if hasattr(fixups, "tie_copies"):
        fixups.tie_copies(proto.graph)
    analysed, types, ranks = _analyse(proto, parameters_of(proto.graph))
    table = Graph(analysed.graph.node, types, fixups.constant_values(analysed.graph), ranks)
    records = []
    for node in analysed.graph.node:
        level, why = support(table.view(node))
        records.append(
            NodeRecord(node.name, _op_name(node), node_form(node, ranks), operator(node) is not None, level.value, why)
        )
    return records


def survey(name: str, exporter: str, check_step: bool = True) -> Survey:
    """What planner makes of entry `name` as `exporter` writes it (see the module docstring);
    failures are recorded, never raised."""
    from planner import api
    from planner.errors import BadInput, PlannerError
    from planner.inputs.model import load_model

    s = Survey(name, exporter)
    start = time.perf_counter()
    try:
        path = tl.export(name, exporter)
    except ExportFailed as exc:
        s.export_error = str(exc)
        return s
    s.seconds["export"] = time.perf_counter() - start
    s.file_ops = sorted(set(_walk_ops(onnx.load(str(path), load_external_data=False).graph)))
    start = time.perf_counter()
    try:
        s.nodes = analysed_nodes(path)
    except Exception as exc:  # noqa: BLE001 - recorded, the test says what it means
        s.analysis_error = f"{type(exc).__name__}: {exc}"
    try:
        model = load_model(path)
        s.load = "ok"
    except BadInput as exc:
        s.load, s.load_error = type(exc).__name__, str(exc)
        s.seconds["load"] = time.perf_counter() - start
        return s
    s.layers = [(layer.name, layer.op, layer.problem) for layer in model.layers]
    try:
        api.inspect(path)
    except PlannerError as exc:  # TVM refused it (a planner bug, as the table accepted it) or another refusal
        s.inspect_error = str(exc)
    s.seconds["load"] = time.perf_counter() - start
    if s.inspect_error or not check_step or not s.trainable:
        return s
    start = time.perf_counter()
    try:
        s.errors = step_check(name, model)
    except Exception as exc:  # noqa: BLE001 - a compile or runtime failure is the finding
        s.step_error = f"{type(exc).__name__}: {_last_lines(exc)}"
    s.seconds["step"] = time.perf_counter() - start
    return s


def _last_lines(exc: Exception, keep: int = 600) -> str:
    text = str(exc).strip()
    if len(text) <= keep:
        return text
    return "..." + text[-keep:]


# ---------------------------------------------------------------- the step against the reference


def _to_double(graph: onnx.GraphProto) -> None:
    """`graph` computing in float64 where it computed in float32 (in place, subgraphs included)."""
    for i, t in enumerate(graph.initializer):
        if t.data_type == TensorProto.FLOAT:
            graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for v in [*graph.input, *graph.output]:
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    del graph.value_info[:]
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and not node.attribute:  # zeros of float32 by default
            node.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(np.zeros(1, np.float64))))
        for a in list(node.attribute):
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
            elif node.op_type == "Constant" and a.name in ("value_float", "value_floats"):
                value = np.array(a.f if a.name == "value_float" else list(a.floats), np.float64)
                node.attribute.remove(a)
                node.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(value)))
            elif a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE  # Cast, EyeLike
            elif a.type == onnx.AttributeProto.GRAPH:
                _to_double(a.g)


class Reference:
    """The ONNX file in float64 by ONNX's reference runtime, the parameters `trained` as inputs."""

    def __init__(self, path: Path, trained: list[str]) -> None:
        proto = onnx.load(str(path))
        _to_double(proto.graph)
        inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
        self.weights = {n: inits[n] for n in trained}
        for t in [t for t in proto.graph.initializer if t.name in self.weights]:
            proto.graph.initializer.remove(t)
        for n in trained:
            proto.graph.input.append(onnx.helper.make_tensor_value_info(n, TensorProto.DOUBLE, inits[n].shape))
        self.inputs = [i.name for i in proto.graph.input if i.name not in self.weights]
        self.evaluator = ReferenceEvaluator(proto, new_ops=REFERENCE_OPS)

    def logits(self, xs: list[np.ndarray], weights: dict[str, np.ndarray] | None = None) -> np.ndarray:
        feeds = {n: (x.astype(np.float64) if x.dtype == np.float32 else x) for n, x in zip(self.inputs, xs)}
        return np.asarray(self.evaluator.run(None, {**feeds, **(weights or self.weights)})[0])

    def loss(self, xs: list[np.ndarray], y: np.ndarray, weights: dict[str, np.ndarray] | None = None) -> float:
        return cross_entropy(self.logits(xs, weights), y)


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> float:
    logits = logits - logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def _relative(a: np.ndarray, b: np.ndarray, floor: float = 1e-12) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), floor))


def step_check(name: str, model, labels_seed: int = 3, fd_labels: np.ndarray | None = None) -> dict[str, float]:
    """One SGD step of `model` (entry `name`) training every layer `inspect` calls trainable,
    against the file's float64 reference: relative errors of the logits ("logits"), the loss
    ("loss"), each trained tensor's gradient (by name; central differences over `FD_ENTRIES` of
    its entries) and of the file's logits against PyTorch's float64 forward ("onnx~torch").
    `fd_labels`: labels for the differences other than the step's (the check must then fail)."""
    import tvm

    from planner.backend.lower.pipeline import BuildOptions
    from planner.backend.vm.compile import compile_candidate
    from planner.runtime.session import TrainingSession
    from planner.types import Candidate

    layers = [layer for layer in model.layers if layer.trainable]
    trained = [p for layer in layers for p in layer.params_for("full")]
    candidate = Candidate(tuple((layer.name, "full") for layer in layers), BATCH, "sgd", LR)
    step = compile_candidate(model, candidate, BuildOptions(tvm.target.Target({"kind": "llvm"})))
    w0 = {k: v.astype(np.float32) for k, v in model.initializers.items()}
    session = TrainingSession(step.library, step.signature, w0)
    xs = tl.sample_inputs(name, BATCH)
    y = np.random.default_rng(labels_seed).integers(0, model.n_classes, BATCH)
    inputs = xs[0] if len(xs) == 1 else tuple(xs)
    reference = Reference(model.path, trained)
    expected = reference.logits(xs)
    errors = {"logits": float(np.abs(session.outputs(inputs) - expected).max() / max(np.abs(expected).max(), 1e-6))}
    with torch.no_grad():
        pytorch = tl.torch_module(name).double()(
            *(torch.from_numpy(x.astype(np.float64) if x.dtype == np.float32 else x) for x in xs)
        )
    errors["onnx~torch"] = float(np.abs(pytorch.numpy() - expected).max() / max(np.abs(expected).max(), 1e-6))
    loss = session.step(inputs, y)
    errors["loss"] = abs(loss - reference.loss(xs, y)) / max(abs(reference.loss(xs, y)), 1e-6)
    after = session.weights()
    rng = np.random.default_rng(4)
    fd_y = y if fd_labels is None else fd_labels
    base = {n: v.copy() for n, v in reference.weights.items()}
    for n in trained:
        grad = (w0[n].astype(np.float64) - after[n].astype(np.float64)).ravel() / LR
        picked = np.arange(grad.size) if grad.size <= FD_ENTRIES else rng.choice(grad.size, FD_ENTRIES, replace=False)
        fd = []
        for i in picked:
            plus, minus = dict(base), dict(base)
            plus[n], minus[n] = base[n].copy(), base[n].copy()
            plus[n].ravel()[i] += FD_STEP
            minus[n].ravel()[i] -= FD_STEP
            fd.append((reference.loss(xs, fd_y, plus) - reference.loss(xs, fd_y, minus)) / (2 * FD_STEP))
        errors[n] = _relative(grad[picked], np.array(fd), GRADIENT_FLOOR)
    return errors


# -------------------------------------------------------------------------------------- the tests

# The entries stepped by default: `tl.CORE`, a cover of every operator form the whole catalogue's
# exports hold (`--cover` recomputes it); PLANNER_TORCH_LAYERS=all steps every entry (about 10
# minutes on 2 cores, half of it the dynamo exporter's, where CI's budget has room for the cover).
_ALL = os.environ.get("PLANNER_TORCH_LAYERS") == "all"
CASES = [pytest.param(n, e, id=f"{n}-{e}") for n in (tl.LAYERS if _ALL else tl.CORE) for e in tl.EXPORTERS]


def _refusing_node(message: str, nodes: list[NodeRecord]) -> NodeRecord | None:
    return next((n for n in nodes if f"node '{n.name}' ({n.op.split('::')[-1]})" in message), None)


@pytest.mark.parametrize("name, exporter", CASES)
def test_layer_against_the_table_and_the_step(name, exporter):
    s = survey(name, exporter)
    if s.export_error is not None:
        assert name in EXPORT_FAILURES[exporter], f"the exporter failed: {s.export_error}"
        pytest.xfail(f"{exporter} cannot export it: {s.export_error}")
    if (name, exporter) in BROKEN_EXPORTS:
        pytest.xfail(BROKEN_EXPORTS[name, exporter])
    assert s.analysis_error is None, s.analysis_error
    unknown = sorted({f"{n.op} ({n.form})" for n in s.unknown})
    assert not unknown, f"operators missing from the table: {unknown}"
    if s.load != "ok":
        assert s.load == "UnsupportedOp", f"load_model failed otherwise: {s.load}: {s.load_error}"
        node = _refusing_node(s.load_error, s.nodes)
        assert node is not None and node.support == "refused", f"refused without naming a refused node: {s.load_error}"
        return
    assert s.inspect_error is None, s.inspect_error
    assert s.trainable, f"no layer trains: {s.layers}"
    assert s.step_error is None, s.step_error
    assert s.errors["logits"] < LOGITS_TOLERANCE and s.errors["loss"] < LOGITS_TOLERANCE, s.errors
    if (name, exporter) not in EXPORTER_DEVIATIONS:
        assert s.errors["onnx~torch"] < LOGITS_TOLERANCE, f"the export is not PyTorch's model: {s.errors}"
    wrong = {k: v for k, v in s.errors.items() if k not in ("logits", "loss", "onnx~torch") and not v < GRADIENT_TOLERANCE}
    assert not wrong, f"gradients off the float64 reference: {wrong} (every error: {s.errors})"


def test_the_gradient_check_can_fail():
    """Differences of the loss for other labels than the step's: every gradient is off."""
    from planner.inputs.model import load_model

    model = load_model(tl.export("conv2d_stride2_pad1", "legacy"))
    errors = step_check("conv2d_stride2_pad1", model, fd_labels=np.array([1, 2, 0]))
    gradients = [v for k, v in errors.items() if k not in ("logits", "loss", "onnx~torch")]
    assert gradients and min(gradients) > 0.1, errors


# ---------------------------------------------------------------------------------- the report


def _short(text: str | None, keep: int = 160) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= keep else text[: keep - 3] + "..."


def report_row(s: Survey) -> str:
    if s.export_error:
        return f"| {s.name} | {s.exporter} | export failed: {_short(s.export_error)} | | | |"
    forms = sorted({f"{n.op}" + (f"[{n.support}]" if n.support != "trains" else "") for n in s.nodes if n.op != "Constant"})
    load = "ok" if s.load == "ok" else f"{s.load}: {_short(s.load_error)}"
    if s.inspect_error:
        load += f"; inspect: {_short(s.inspect_error)}"
    untrainable = [f"{n} ({_short(p, 90)})" for n, _, p in s.layers if p]
    layers = ", ".join(s.trainable) + (f"; untrainable: {'; '.join(untrainable)}" if untrainable else "")
    if s.step_error:
        step = f"FAILED {_short(s.step_error)}"
    elif s.errors:
        grads = [v for k, v in s.errors.items() if k not in ("logits", "loss", "onnx~torch")]
        step = f"grad {max(grads):.1e}, logits {s.errors['logits']:.1e}, onnx~torch {s.errors['onnx~torch']:.1e}"
    else:
        step = "-"
    return f"| {s.name} | {s.exporter} | {' '.join(forms)} | {load} | {layers} | {step} |"


def _coarse(form: str) -> tuple[str, ...]:
    """A node form with its sizes dropped: rank, and each attribute by kind (a list or number of
    ones and zeros, or larger; a string as it is)."""
    out = []
    for part in form.split():
        name, _, value = part.partition("=")
        if name == "rank":
            out.append(part)
            continue
        try:
            numbers = [float(v) for v in value.strip("[]").split(",") if v]
        except ValueError:
            out.append(part)  # a mode, a coordinate transformation, an equation
            continue
        out.append(f"{name}={'unit' if all(v in (0.0, 1.0) for v in numbers) else 'other'}")
    return tuple(out)


def cover() -> list[str]:
    """The fewest entries (greedily) whose exports, both exporters', hold every (exporter,
    operator, coarse form) the whole catalogue's do, refusals included: `tl.CORE`."""
    signatures: dict[str, set] = {}
    for name in tl.LAYERS:
        found = signatures.setdefault(name, set())
        for exporter in tl.EXPORTERS:
            s = survey(name, exporter, check_step=False)
            found |= {(exporter, n.op, n.support, _coarse(n.form)) for n in s.nodes}
            if s.load not in (None, "ok"):
                found.add((exporter, "load", s.load, ()))
    wanted, chosen = set().union(*signatures.values()), []
    covered: set = set()
    while covered != wanted:
        best = max(signatures, key=lambda n: len(signatures[n] - covered))
        chosen.append(best)
        covered |= signatures[best]
    return sorted(chosen)


def main(names: list[str]) -> None:
    print("| entry | exporter | analysed ops ([support] if not trains) | load | trainable layers | step vs float64 |")
    print("|---|---|---|---|---|---|")
    for name in names or list(tl.LAYERS):
        for exporter in tl.EXPORTERS:
            try:
                s = survey(name, exporter)
            except Exception:  # noqa: BLE001
                print(f"| {name} | {exporter} | survey crashed: {_short(traceback.format_exc(), 300)} | | | |")
                continue
            print(report_row(s), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    if sys.argv[1:] == ["--cover"]:
        print(f"CORE = {tuple(cover())!r}")
    else:
        main(sys.argv[1:])
