"""GRU, LSTM and RNN nodes unrolled for TVM (`planner/inputs/recurrent.py`), checked against the
ONNX spec and against PyTorch.

The spec: hand-made nodes over every direction, layout, optional input and GRU reset variant,
the unrolled graph's outputs against ONNX's reference implementation of the node itself. PyTorch:
`nn.GRU`, `nn.LSTM` and `nn.RNN` classifiers exported by both exporters with a dynamic batch,
inspected (layers by PyTorch name, all trainable), run forward against PyTorch's logits, and
stepped once through planner against PyTorch autograd in float64. The dynamo exporter writes no
RNN node for `nn.RNN` (it unrolls it itself), so `nn.RNN` is exported with the legacy one here.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from planner import api
from planner.errors import BadInput
from planner.inputs.fixups import for_import

SEQ, FEATURES, HIDDEN, CLASSES, BATCH = 12, 6, 16, 5, 2
LR = 1000.0  # the update dwarfs the weight, so float32 storage of the result does not hide a wrong gradient
MAX_UPDATE_ERROR = 1e-4
_GATES = {"GRU": 3, "LSTM": 4, "RNN": 1}

# ----------------------------------------------------------------------------- the ONNX spec

# (op, attributes): both GRU reset variants, LSTM with and without peepholes.
VARIANTS = {
    "gru": ("GRU", {"linear_before_reset": 1}),
    "gru-reset-first": ("GRU", {"linear_before_reset": 0}),
    "lstm": ("LSTM", {}),
    "lstm-peepholes": ("LSTM", {}),
    "rnn": ("RNN", {}),
}


def _node_model(
    variant: str, direction: str, layout: int, optional: bool, seq_lens: np.ndarray | None = None, opset: int = 17, **extra
) -> onnx.ModelProto:
    """One recurrent node over a [S, N, I] (layout 0) or [N, S, I] input, every output a graph
    output; its tensors initializers (B, initial states and peepholes only if `optional`)."""
    op, attrs = VARIANTS[variant]
    rng = np.random.default_rng(len(variant) + 7 * layout + (3 if optional else 0))
    d = 2 if direction == "bidirectional" else 1
    g = _GATES[op] * HIDDEN
    n = 3
    x_shape = [n, SEQ, FEATURES] if layout else [SEQ, n, FEATURES]
    state = [n, d, HIDDEN] if layout else [d, n, HIDDEN]
    tensors = {"W": rng.normal(0, 0.4, (d, g, FEATURES)), "R": rng.normal(0, 0.4, (d, g, HIDDEN))}
    if optional:
        tensors |= {"B": rng.normal(0, 0.3, (d, 2 * g)), "initial_h": rng.normal(0, 0.5, state)}
        if op == "LSTM":
            tensors["initial_c"] = rng.normal(0, 0.5, state)
    if variant == "lstm-peepholes":
        tensors["P"] = rng.normal(0, 0.3, (d, 3 * HIDDEN))
    slots = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"][: 8 if op == "LSTM" else 6]
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in tensors.items()]
    if seq_lens is not None:
        inits.append(numpy_helper.from_array(seq_lens.astype(np.int32), "sequence_lens"))
    inputs = [s if s == "X" or s in tensors or (s == "sequence_lens" and seq_lens is not None) else "" for s in slots]
    outputs = ["Y", "Y_h", "Y_c"][: 3 if op == "LSTM" else 2]
    node = helper.make_node(
        op, inputs, outputs, name="rnn_node", hidden_size=HIDDEN, direction=direction, layout=layout, **attrs, **extra
    )
    y_shape = [n, SEQ, d, HIDDEN] if layout else [SEQ, d, n, HIDDEN]
    graph = helper.make_graph(
        [node],
        "recurrent",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, y_shape if o == "Y" else state) for o in outputs],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _outputs(proto: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    return ReferenceEvaluator(proto).run(None, {"X": x})


SPEC_CASES = [
    pytest.param(v, d, layout, optional, 17, id=f"{v}-{d}-layout{layout}-{'B-initial' if optional else 'bare'}")
    for v in VARIANTS
    for d in ("forward", "reverse", "bidirectional")
    for layout in (0, 1)
    for optional in (True, False)
] + [pytest.param("lstm", "bidirectional", 0, True, 11, id="lstm-opset11")]  # before 13, Split takes its sizes as an attribute


@pytest.mark.parametrize("variant, direction, layout, optional, opset", SPEC_CASES)
def test_unrolled_node_computes_the_onnx_spec(variant, direction, layout, optional, opset):
    """Y, Y_h (and Y_c) of the unrolled graph equal ONNX's reference implementation of the node,
    and the node's tensors stay initializers of the same names, read by Gathers."""
    proto = _node_model(variant, direction, layout, optional, opset=opset)
    params = {t.name for t in proto.graph.initializer}
    unrolled = for_import(proto, 3, params)
    assert not {n.op_type for n in unrolled.graph.node} & set(_GATES)
    assert {t.name for t in unrolled.graph.initializer} == params
    assert {n.op_type for n in unrolled.graph.node if set(n.input) & params} == {"Gather"}
    x = np.random.default_rng(1).normal(0, 1, [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim])
    x = x.astype(np.float32)
    for name, want, got in zip(["Y", "Y_h", "Y_c"], _outputs(proto, x), _outputs(unrolled, x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_full_sequence_lens_is_accepted_and_anything_else_refused():
    """sequence_lens equal to the sequence length is the unrolled graph; a shorter sequence, cell
    clipping or an activation planner does not differentiate is refused by name, not miscomputed."""
    full = _node_model("gru", "forward", 0, True, seq_lens=np.full(3, SEQ))
    params = {t.name for t in full.graph.initializer if t.data_type == TensorProto.FLOAT}
    x = np.random.default_rng(2).normal(0, 1, (SEQ, 3, FEATURES)).astype(np.float32)
    np.testing.assert_allclose(_outputs(for_import(full, 3, params), x)[0], _outputs(full, x)[0], rtol=1e-5, atol=1e-6)
    refused = {
        "sequence_lens": _node_model("gru", "forward", 0, True, seq_lens=np.array([SEQ, SEQ - 1, SEQ])),
        "clip": _node_model("lstm", "forward", 0, True, clip=5.0),
        "input_forget": _node_model("lstm", "forward", 0, True, input_forget=1),
        "'Softsign'": _node_model("rnn", "forward", 0, True, activations=["Softsign"]),
    }
    for what, proto in refused.items():
        with pytest.raises(BadInput, match=what):
            for_import(proto, 3, params)


# ----------------------------------------------------------------------------- PyTorch

# (kind, layers, bidirectional, head): every kind 1 and 2 layers, one direction and both, the
# head on the last time step of Y or on the last layer's final hidden state Y_h.
MODELS = {
    "gru-1": ("GRU", 1, False, "last"),
    "gru-2-bi": ("GRU", 2, True, "hidden"),
    "lstm-1-bi": ("LSTM", 1, True, "hidden"),
    "lstm-2": ("LSTM", 2, False, "last"),
    "rnn-1-bi": ("RNN", 1, True, "last"),
    "rnn-2": ("RNN", 2, False, "hidden"),
}
CASES = [
    pytest.param(m, e, id=f"{m}-{e}") for m in MODELS for e in ("dynamo", "legacy") if not (m.startswith("rnn") and e == "dynamo")
]
# ONNX's gate order from PyTorch's: GRU r,z,n -> z,r,h; LSTM i,f,g,o -> i,o,f,c.
_TORCH_GATE = {"GRU": (1, 0, 2), "LSTM": (0, 3, 1, 2), "RNN": (0,)}


def _classifier(name: str):
    torch = pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
    kind, layers, bidirectional, head = MODELS[name]

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(torch.nn, kind)(FEATURES, HIDDEN, num_layers=layers, batch_first=True, bidirectional=bidirectional)
            self.head = torch.nn.Linear(HIDDEN * (2 if bidirectional else 1), CLASSES)

        def forward(self, x):
            y, state = self.rnn(x)
            if head == "last":
                return self.head(y[:, -1])
            h = state[0] if kind == "LSTM" else state
            return self.head(torch.cat(list(h[-2:]), dim=1) if bidirectional else h[-1])

    torch.manual_seed(sum(map(ord, name)))
    return Classifier().eval()


def _export(name: str, exporter: str, directory: Path):
    """The classifier and its export (dynamo: weights in NAME.onnx.data beside it), made in a
    folder of its own renamed into `directory` whole (another test worker may export it too)."""
    module = _classifier(name)
    entry = directory / f"{name}-{exporter}"
    if not (entry / f"{name}.onnx").exists():
        directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=directory))
        try:
            _export_to(module, exporter, staging / f"{name}.onnx")
            with contextlib.suppress(OSError):  # another worker's rename came first
                staging.rename(entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return entry / f"{name}.onnx", module


def _export_to(module, exporter: str, path: Path) -> None:
    import torch

    x = torch.zeros(BATCH, SEQ, FEATURES)
    dynamic = {"dynamic_shapes": ({0: torch.export.Dim("batch")},), "external_data": True}
    legacy = {"dynamic_axes": {"x": {0: "batch"}, "logits": {0: "batch"}}}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (x,),
            str(path),
            input_names=["x"],
            output_names=["logits"],
            dynamo=exporter == "dynamo",
            **(dynamic if exporter == "dynamo" else legacy),
        )


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """`export(name, exporter)`; under `$PLANNER_TORCH_EXPORTS` (kept between CI runs, keyed by
    torch's version and this file), else in the session's temporary folder."""
    torch = pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
    kept = os.environ.get("PLANNER_TORCH_EXPORTS")
    recipe = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]
    directory = Path(kept) / f"recurrent-torch-{torch.__version__}-{recipe}" if kept else tmp_path_factory.mktemp("recurrent")
    done: dict[tuple[str, str], tuple[Path, object]] = {}

    def export(name: str, exporter: str) -> tuple[Path, object]:
        if (name, exporter) not in done:
            done[(name, exporter)] = _export(name, exporter, directory)
        return done[(name, exporter)]

    return export


def _onnx_tensors(model: api.Model, module, kind: str) -> dict[str, np.ndarray]:
    """Every parameter of `module` as the ONNX initializer holding it (by the initializer's name):
    the k-th recurrent node's W, R, B stack layer k's directions, gates in ONNX's order, B the
    input biases, then the hidden ones."""
    rnn = module.rnn
    order = _TORCH_GATE[kind]
    suffixes = ["", "_reverse"] if rnn.bidirectional else [""]

    def onnx_order(value) -> np.ndarray:
        blocks = np.split(value.detach().numpy().astype(np.float64), len(order))
        return np.concatenate([blocks[i] for i in order])

    nodes = [n for n in model.proto.graph.node if n.op_type == kind]
    out = {"head.weight": module.head.weight.detach().numpy(), "head.bias": module.head.bias.detach().numpy()}
    for k, node in enumerate(nodes):
        for slot, pieces in ((1, ["weight_ih"]), (2, ["weight_hh"]), (3, ["bias_ih", "bias_hh"])):
            out[node.input[slot]] = np.stack(
                [np.concatenate([onnx_order(getattr(rnn, f"{p}_l{k}{s}")) for p in pieces]) for s in suffixes]
            )
    return {n: np.asarray(v, np.float64) for n, v in out.items()}


def _reference_step(module, kind: str, model: api.Model, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Every initializer after one plain SGD step of PyTorch autograd in float64 (mean cross-entropy)."""
    import torch

    reference = copy.deepcopy(module).double()
    loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(x).double()), torch.from_numpy(y))
    loss.backward()
    with torch.no_grad():
        for param in reference.parameters():
            param -= LR * param.grad
    return _onnx_tensors(model, reference, kind)


def _update_error(before: np.ndarray, after: np.ndarray, expected: np.ndarray) -> float:
    """||planner's step - the reference step|| / ||the reference step|| (as tests/torch_families.py)."""
    step = expected.astype(np.float64) - before
    return float(np.linalg.norm(after.astype(np.float64) - before - step) / np.linalg.norm(step))


def _batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (BATCH, SEQ, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, BATCH)


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter", CASES)
def test_exported_recurrent_models_are_pytorch_layers_and_compute_pytorch_logits(name, exporter, exports):
    """`inspect` lists the recurrent node's W, R and B as layers `rnn.weight_ih_lK`,
    `rnn.weight_hh_lK`, `rnn.bias_lK`, all trainable; they hold PyTorch's weights (gates in ONNX's
    order); the unrolled graph at another batch than the export's computes PyTorch's logits."""
    import torch

    path, module = exports(name, exporter)
    kind, layers, _, _ = MODELS[name]
    model = api.inspect(path)
    assert model.data_files == ((f"{path.name}.data",) if exporter == "dynamo" else ())
    expected = {f"rnn.{p}_l{k}" for k in range(layers) for p in ("weight_ih", "weight_hh", "bias")} | {"head"}
    assert {layer.name for layer in model.layers} == expected
    assert [layer.name for layer in model.layers if not layer.trainable] == []
    tensors = _onnx_tensors(model, module, kind)
    assert set(tensors) == set(model.parameters)
    for onnx_name, value in model.initializers.items():
        np.testing.assert_array_equal(value, tensors[onnx_name].astype(np.float32), err_msg=onnx_name)
    x = np.random.default_rng(5).normal(0, 1, (3, SEQ, FEATURES)).astype(np.float32)
    logits = ReferenceEvaluator(model.import_proto(3)).run(None, {"x": x})[0]
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter", CASES)
def test_one_sgd_step_of_every_layer_matches_pytorch_autograd_in_float64(name, exporter, exports):
    """One plain SGD step of every layer through a compiled planner step: each updated tensor
    within 1e-4 (relative error of the update) of PyTorch's float64 step on the same weights."""
    import tvm

    from planner.backend.lower.pipeline import BuildOptions
    from planner.backend.vm.compile import compile_candidate
    from planner.runtime.session import TrainingSession
    from planner.types import Candidate

    path, module = exports(name, exporter)
    model = api.inspect(path)
    candidate = Candidate(tuple((layer.name, "full") for layer in model.layers), BATCH, "sgd", LR)
    step = compile_candidate(model, candidate, BuildOptions(tvm.target.Target({"kind": "llvm"})))
    x, y = _batch()
    before = {n: v.copy() for n, v in model.initializers.items()}
    session = TrainingSession(step.library, step.signature, before)
    session.step(x, y)
    after = session.weights()
    assert set(step.signature.trainable) == set(model.parameters)
    expected = _reference_step(module, MODELS[name][0], model, x, y)
    errors = {n: _update_error(before[n], after[n], expected[n]) for n in model.parameters}
    print(f"{name}-{exporter}: worst update error {max(errors.values()):.2e} ({max(errors, key=errors.get)})")
    assert {n: f"{e:.2e}" for n, e in errors.items() if not e <= MAX_UPDATE_ERROR} == {}


@pytest.mark.slow
# one exporter each (both exporters step every layer against PyTorch above): a search is minutes of CI
@pytest.mark.parametrize("name, exporter", [c for c in CASES if c.values in (("gru-2-bi", "legacy"), ("lstm-1-bi", "dynamo"))])
def test_recurrent_models_measure_and_plan_with_the_default_space(name, exporter, exports, tmp_path):
    """`measure` of the full update and of the head alone (the full one holds more memory), and
    `plan` with the default space finishing with a plan that `run` trains."""
    path, _ = exports(name, exporter)
    model = api.inspect(path)
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "data.npz", x=rng.normal(0, 1, (40, SEQ, FEATURES)).astype(np.float32), y=np.arange(40) % CLASSES)
    peak = {}
    for scheme, layers in (("full", [layer.name for layer in model.layers]), ("head", [model.layers[-1].name])):
        entries = "\n".join(f"  - {{layer: '{n}', mode: full}}" for n in layers)
        (tmp_path / f"{scheme}.yaml").write_text(
            f"name: {scheme}\ntrainable:\n{entries}\nbatch_size: 4\noptimizer: {{name: sgd, lr: 0.01}}\n"
        )
        result = api.measure(
            path,
            scheme=tmp_path / f"{scheme}.yaml",
            data=tmp_path / "data.npz",
            out=tmp_path / scheme,
            accuracy_steps=2,
            latency_repeats=2,
        )
        peak[scheme] = result.plan.metrics.peak_memory_bytes.total
    assert peak["full"] > peak["head"], peak
    planned = api.plan(
        model=path, data=tmp_path / "data.npz", out=tmp_path / "plan", trials=2, accuracy_steps=4, latency_repeats=2
    )
    assert planned.plan is not None
    assert np.isfinite(api.run(tmp_path / "plan", steps=3, out=tmp_path / "ran").after["loss"])
