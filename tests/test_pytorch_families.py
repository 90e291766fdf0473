"""Models as PyTorch users export them, checked against PyTorch itself.

Every family in `torch_families` (torchvision's mobilenet_v2, mobilenet_v3_small, efficientnet_b0,
mnasnet0_5, resnet18, regnet_x_400mf, shufflenet_v2_x0_5, squeezenet1_1, a small
VisionTransformer, and TransformerEncoder classifiers with pre- and post-norm), exported by
`torch.onnx.export` with the dynamo exporter (external data) and the legacy one: inspected (names,
trainability), measured (full update, bias only, last layer) and stepped once against PyTorch
autograd in float64 on the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tvm

torch = pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
import torch_families as tf  # noqa: E402
from planner import api  # noqa: E402
from planner.backend.graph.estimate import HIGH, LOW, SLACK, estimate  # noqa: E402
from planner.backend.lower.pipeline import BuildOptions, training_module  # noqa: E402
from planner.backend.vm.compile import compile_candidate  # noqa: E402
from planner.cachefile import default_cache_dir  # noqa: E402
from planner.errors import BadInput  # noqa: E402
from planner.inputs.model import load_model  # noqa: E402
from planner.runtime.session import TrainingSession  # noqa: E402
from planner.tasks import TASKS  # noqa: E402
from planner.types import Candidate  # noqa: E402
from processes import PLANNED, planner  # noqa: E402

pytestmark = pytest.mark.slow

CASES = [pytest.param(f, e, id=f"{f}-{e}") for f in tf.FAMILIES for e in tf.EXPORTERS]
HOST = tvm.target.Target({"kind": "llvm"})
BATCH = 2  # one batch size for every compile here: candidates share their forward and backward kernels

# A step of plain SGD with a large learning rate: float32 stores the updated weight, so with a
# small step its rounding (about 6e-8 of the weight) would be what the comparison sees. With
# lr 1000 the update dwarfs the weight, and the update's relative error is the gradient's.
LR = 1000.0
FLOAT32_NOISE = 1e-4  # the relative error float32 arithmetic may leave in a gradient
NOISE_FACTOR = 10  # ... or this many times what PyTorch's own float32 step shows for that tensor
MAX_FLIPS_TRIED = 32  # the closest kinks tried, one flipped at a time, when a step is off float64 autograd


@pytest.mark.parametrize("family, exporter", CASES)
def test_layers_are_pytorch_modules_and_all_train(family, exporter):
    """`inspect` names each layer by its PyTorch module path (or parameter name), whichever
    exporter wrote the file; every layer of these families can train; and every parameter planner
    would train is a PyTorch tensor (a constant, such as an attention scale, never is)."""
    _check_layers(family, exporter, tf.export(family, exporter))


def _check_layers(family: str, exporter: str, path: Path) -> None:
    """Layer names are PyTorch's, every layer trains, and each parameter is one PyTorch tensor."""
    model = api.inspect(path)
    one = tf.tied_modules(family)  # modules sharing a tensor: one layer, named after either
    assert {one.get(n, n) for n in (layer.name for layer in model.layers)} == {
        one.get(n, n) for n in tf.pytorch_layer_names(family, exporter)
    }
    assert [(layer.name, layer.problem) for layer in model.layers if not layer.trainable] == []
    params = [p for layer in model.layers for p in layer.params_for("full")]
    assert set(tf.parameter_map(family, path, params)) == set(params)  # raises on a non-PyTorch tensor


@pytest.mark.parametrize("family, exporter", CASES)
def test_one_sgd_step_matches_pytorch_autograd_in_float64(family, exporter):
    """Every layer trained: each updated tensor within float32 noise of PyTorch's float64 step."""
    _check_one_step(family, tf.export(family, exporter))


@pytest.mark.parametrize("family", ["vit", "mobilenet_v3_small"])
@pytest.mark.parametrize("exporter, opset", [("legacy", 17), ("dynamo", 18), ("dynamo", 21)])
def test_other_opsets_train_like_pytorch(family, exporter, opset):
    """Opsets 17 to 21 (the default exports above are opset 20), from both exporters: at 17 and
    18 GELU is written with Erf, LayerNormalization and HardSwish as their own ops; the step still
    matches autograd."""
    path = tf.export(family, exporter, opset=opset)
    assert {layer.name for layer in api.inspect(path).layers} == tf.pytorch_layer_names(family, exporter)
    _check_one_step(family, path)


@pytest.mark.parametrize(
    "family, exporter", [("vit", "legacy"), ("encoder_prenorm", "dynamo"), ("mobilenet_v3_small", "dynamo"), ("bert", "dynamo")]
)
def test_last_layers_with_gradient_accumulation_train_like_pytorch(family, exporter):
    """The last layers only, two micro-batches per step: the frozen front runs outside the
    differentiated function (per micro-batch), and the step is PyTorch's on the whole batch."""
    path = tf.export(family, exporter)
    model = api.inspect(path)
    _check_one_step(family, path, [layer.name for layer in model.layers[-5:]], accum=2)


@pytest.mark.parametrize(
    "family, exporter", [("vit", "legacy"), ("resnet18", "dynamo"), ("mobilenet_v2", "dynamo"), ("gpt2", "legacy")]
)
def test_recomputing_steps_train_like_pytorch(family, exporter):
    """Every layer trained with `recompute: auto`, and with one listed layer's input kept over two
    micro-batches (their gradients summed in place, an OpenBLAS weight gradient adding onto the
    sum): the step still matches PyTorch autograd on the whole batch."""
    path = tf.export(family, exporter)
    model = api.inspect(path)
    _check_one_step(family, path, recompute="auto")
    _check_one_step(family, path, recompute=(model.layers[len(model.layers) // 2].name,), accum=2)


def _build() -> BuildOptions:
    """The host build, through the run's compile cache (conftest's, shared by pytest's workers):
    a family's kernels are compiled once for all its tests, as a study compiles them once for all
    its candidates; what the cache gives back trains as a fresh compile does (test_compile_cache)."""
    return BuildOptions(HOST, cache_dir=default_cache_dir())


def _check_one_step(
    family: str, path: Path, layers: list[str] | None = None, accum: int = 1, recompute: str | tuple[str, ...] = "none"
) -> None:
    """One plain SGD step of `layers` (default: all), compared with PyTorch's on the same weights
    and batch (`accum` micro-batches of BATCH).

    How it is judged: the relative error of the update, ||planner - reference|| / ||reference
    step||, must be at most 1e-4, or — where float32 itself cannot do better — at most ten times
    the error of PyTorch's own float32 step on the same weights and batch; the reference is
    float64 autograd, or float64 autograd with one ReLU input that float32 cannot place on a side
    of its kink put on the other side (`tf.undecidable_kinks`)."""
    model = api.inspect(path)
    if model.task.name != (task := tf._family(family).task):  # an output a classifier's could be (an autoencoder's)
        model = model.with_task(TASKS[task])
    layers = layers or [layer.name for layer in model.layers]
    candidate = Candidate(tuple((name, "full") for name in layers), BATCH, "sgd", LR, grad_accum=accum, recompute=recompute)
    step = compile_candidate(model, candidate, _build())
    x, y = tf.sample_batch(family, BATCH * accum)
    before = {name: value.copy() for name, value in model.initializers.items()}
    session = TrainingSession(step.library, step.signature, before)
    session.step(x, y)
    after = session.weights()
    trained = list(step.signature.trainable)
    assert set(trained) == {p for name in layers for p in model.layer(name).params_for("full")}
    assert all(np.array_equal(after[n], before[n]) for n in before if n not in trained)  # frozen stays
    expected = tf.reference_update(family, path, x, y, LR, trained)
    float32 = tf.reference_update(family, path, x, y, LR, trained, dtype=torch.float32)
    allowed = {n: max(FLOAT32_NOISE, NOISE_FACTOR * tf.update_error(before[n], float32[n], expected[n])) for n in trained}

    def wrong(reference: dict[str, np.ndarray]) -> dict[str, str]:
        errors = {n: tf.update_error(before[n], after[n], reference[n]) for n in trained}
        return {n: f"{errors[n]:.2e} > {allowed[n]:.1e}" for n in trained if not errors[n] <= allowed[n]}

    if off := wrong(expected):
        # One ReLU input within float32's error of its kink may land on the other side in
        # float32 (`tf.undecidable_kinks`): then the step must be float64's with that one mask
        # flipped, as exactly as above. A wrong gradient is not made right by one flip.
        kinks = tf.undecidable_kinks(family, path, x)[:MAX_FLIPS_TRIED]
        flipped = (tf.reference_update(family, path, x, y, LR, trained, flip=k) for k in kinks)
        assert any(not wrong(reference) for reference in flipped), off


# language models: LoRA where it is used on them, the attention and MLP projections
_PROJECTIONS = {
    "gpt2": ("attn.c_attn", "mlp.c_fc"),
    "llama": ("self_attn.q_proj", "self_attn.v_proj"),
    "bert": ("attention.self.query", "attention.self.value"),
}


@pytest.mark.parametrize(
    "family, exporter",
    [
        ("vit", "legacy"),
        ("vit", "dynamo"),
        ("mobilenet_v2", "dynamo"),
        ("gpt2", "legacy"),
        ("gpt2", "dynamo"),
        ("llama", "dynamo"),
        ("bert", "legacy"),
    ],
)
def test_lora_adapters_train_like_pytorch(family, exporter):
    """LoRA on a patch-embedding or first Conv, a 1×1 Conv or a Linear, and the last layer (on a
    language model: its attention and MLP projections, every block's): the adapters' step is
    PyTorch's gradient of the merged weight W + B·A through the product, dB = dW·Aᵀ and
    dA = Bᵀ·dW, with W's gradient from PyTorch autograd in float64 on a model holding the merged
    weights."""
    from planner.modes.lora import adapter_delta, adapter_shapes, lora_a, lora_b, max_rank

    path = tf.export(family, exporter)
    model = api.inspect(path)
    fits = [layer for layer in model.layers if max_rank(layer) >= 2]
    if family in _PROJECTIONS:
        projections = [layer for layer in fits if layer.name.endswith(_PROJECTIONS[family])]
        assert len(projections) == 2 * len(_PROJECTIONS[family]), [layer.name for layer in fits]  # two blocks
        chosen = {layer.name: (2, 4)[i % 2] for i, layer in enumerate(projections)}
    else:
        chosen = {layer.name: rank for layer, rank in zip((fits[0], fits[len(fits) // 2], fits[-1]), (2, 4, 2))}
    rng = np.random.default_rng(0)
    weights, merged = dict(model.initializers), dict(model.initializers)
    for name, rank in chosen.items():
        layer = model.layer(name)
        w = layer.weight
        b_shape, a_shape = adapter_shapes(weights[w].shape, layer.out_axis, rank)
        b, a = (rng.normal(0, 0.05, s).astype(np.float32) for s in (b_shape, a_shape))
        weights[lora_b(w)], weights[lora_a(w)] = b, a
        merged[w] = weights[w] + adapter_delta(b, a, weights[w].shape, layer.out_axis)
    x, y = tf.sample_batch(family, BATCH)
    step = compile_candidate(model, Candidate(tuple((n, f"lora:{r}") for n, r in chosen.items()), BATCH, "sgd", LR), _build())
    session = TrainingSession(step.library, step.signature, weights)
    before = {n: t.numpy() for n, t in zip(step.signature.trainable, session.trainable)}
    session.step(x, y)
    after = {n: t.numpy() for n, t in zip(step.signature.trainable, session.trainable)}
    ws = [model.layer(n).weight for n in chosen]
    reference = tf.reference_update(family, path, x, y, LR, ws, overrides={w: merged[w] for w in ws})
    wrong = {}
    for name in chosen:
        layer = model.layer(name)
        w, axis = layer.weight, layer.out_axis
        dw = np.moveaxis((merged[w].astype(np.float64) - reference[w]) / LR, axis, 0).reshape(merged[w].shape[axis], -1)
        b, a = weights[lora_b(w)].astype(np.float64), weights[lora_a(w)].astype(np.float64)
        for part, grad in ((lora_b(w), dw @ a.T), (lora_a(w), b.T @ dw)):
            error = tf.update_error(before[part], after[part], before[part] - LR * grad)
            if not error <= FLOAT32_NOISE * 10:
                wrong[part] = f"{error:.2e}"
    assert wrong == {}, wrong


def _scheme(path: Path, layers: list[tuple[str, str]]) -> Path:
    entries = "\n".join(f"  - {{layer: '{name}', mode: {mode}}}" for name, mode in layers)
    path.write_text(f"name: {path.stem}\ntrainable:\n{entries}\nbatch_size: {BATCH}\noptimizer: {{name: sgd, lr: 0.01}}\n")
    return path


def _dataset(path: Path, family: str, n: int = 24) -> Path:
    """An `.npz` of `n` samples: `x`, or one array per input named as the input."""
    x, _ = tf.sample_batch(family, n, seed=3)
    np.savez(path, **dict(zip(tf.FAMILIES[family].input_names, x if isinstance(x, tuple) else (x,))), y=np.arange(n) % 10)
    return path


# each family by one exporter, the two in turn (both step against PyTorch above): three measures a
# family are minutes of CI, and what they check — plans, the estimate's bound — is the pipeline's
ONE_EXPORTER = [pytest.param(f, tf.EXPORTERS[i % 2], id=f"{f}-{tf.EXPORTERS[i % 2]}") for i, f in enumerate(tf.FAMILIES)]


@pytest.mark.parametrize("family, exporter", ONE_EXPORTER)
def test_measure_full_bias_only_and_last_layer(family, exporter, tmp_path):
    """`planner measure` of the three classic schemes writes a plan each; the full update holds
    more memory than the last layer alone; and the memory estimate a search screens candidates
    with, from the training graph before compiling, is within its stated error of the plan's."""
    path = tf.export(family, exporter)
    model = api.inspect(path)
    data = _dataset(tmp_path / "data.npz", family)
    schemes = {
        "full": [(layer.name, "full") for layer in model.layers],
        "bias": [(layer.name, "bias") for layer in model.layers if layer.bias],
        "last": [(model.layers[-1].name, "full")],
    }
    if not schemes["bias"]:  # Llama's layers have no biases
        del schemes["bias"]
    peak = {}
    for name, layers in schemes.items():
        out = tmp_path / name
        result = api.measure(
            path, scheme=_scheme(tmp_path / f"{name}.yaml", layers), data=data, out=out, accuracy_steps=2, latency_repeats=2
        )
        metrics = result.plan.metrics
        assert metrics.step_latency_ms.median > 0 and np.isfinite(metrics.accuracy.after)
        peak[name] = metrics.peak_memory_bytes.total
        candidate = Candidate(trainable=tuple(layers), batch_size=BATCH, optimizer="sgd", lr=0.01)
        mod, sig = training_module(load_model(path), candidate)
        estimated = estimate(mod["train_step"], sig, candidate).memory.total
        assert LOW * estimated <= peak[name] <= HIGH * estimated + SLACK, (name, peak[name], estimated)
        for data_file in model.data_files:  # the plan directory stands alone
            assert (out / data_file).read_bytes() == (path.parent / data_file).read_bytes()
    assert peak["full"] > peak["last"], peak


SEQUENCE_CASES = [c for c in CASES if tf.FAMILIES[c.values[0]].tokens is not None or c.values[0] == "sensor_cnn"]


@pytest.mark.parametrize("family, exporter", SEQUENCE_CASES)
def test_sequence_models_plan_with_the_default_space_and_run(family, exporter, tmp_path):
    """Text and sensor models as exported: `planner plan` with the default space finishes with a
    plan that records every input (token ids and masks as int64), and `planner run` trains it on
    the same arrays."""
    path = tf.export(family, exporter)
    data = _dataset(tmp_path / "data.npz", family, n=40)
    result = api.plan(model=path, data=data, out=tmp_path / "plan", trials=2, accuracy_steps=4, latency_repeats=2)
    assert result.plan is not None
    recorded = json.loads((tmp_path / "plan" / "plan.json").read_text())["model"]["inputs"]
    assert [(i["name"], i["dtype"]) for i in recorded] == [(i.name, i.dtype) for i in api.inspect(path).inputs]
    ran = api.run(tmp_path / "plan", data=data, steps=4, out=tmp_path / "ran")
    assert np.isfinite(ran.after["loss"])


@pytest.mark.parametrize("exporter", tf.EXPORTERS)
def test_a_dynamic_sequence_length_is_bound_by_the_data(exporter, tmp_path):
    """BERT exported with a dynamic sequence length: inspected at any length; measured at the
    data's (10, not the export's 12), which the plan records; `run` trains at that length and
    refuses data of another one in one line."""
    path = tf.export("bert", exporter, dynamic_length=True)
    model = api.inspect(path)
    assert [i.shape for i in model.inputs] == [("sequence",), ("sequence",)]
    (ids, mask), y = tf.sample_batch("bert", 24, seed=3)
    np.savez(tmp_path / "short.npz", input_ids=ids[:, :10], attention_mask=mask[:, :10], y=y)
    scheme = _scheme(tmp_path / "full.yaml", [(layer.name, "full") for layer in model.layers])
    result = api.measure(
        path, scheme=scheme, data=tmp_path / "short.npz", out=tmp_path / "plan", accuracy_steps=2, latency_repeats=2
    )
    assert [i.shape for i in result.plan.model.inputs] == [["batch", 10], ["batch", 10]]
    ran = api.run(tmp_path / "plan", data=tmp_path / "short.npz", steps=3, out=tmp_path / "ran")
    assert np.isfinite(ran.after["loss"])
    np.savez(tmp_path / "long.npz", input_ids=ids, attention_mask=mask, y=y)
    with pytest.raises(BadInput, match=r"needs \(10,\)"):
        api.run(tmp_path / "plan", data=tmp_path / "long.npz", steps=3, out=tmp_path / "ran-long")


def test_a_dynamo_export_plans_and_runs_from_anywhere(tmp_path):
    """The dynamo exporter's two files, from another folder: inspect, plan with the default space,
    then the plan directory moved elsewhere runs and writes its fine-tuned model the same way
    (graph + external data), which loads with the fine-tuned weights."""
    family = "encoder_postnorm"
    source = tf.export(family, "dynamo")
    user = tmp_path / "models"
    user.mkdir()
    shutil.copy(source, user / "encoder.onnx")
    shutil.copy(source.parent / f"{source.name}.data", user / f"{source.name}.data")  # the name the model refers to
    data = _dataset(tmp_path / "data.npz", family, n=40)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    res = planner("inspect", str(user / "encoder.onnx"), "--json", cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    assert {r["layer"] for r in json.loads(res.stdout)["layers"]} == tf.pytorch_layer_names(family, "dynamo")

    res = planner(
        "plan",
        "--model",
        str(user / "encoder.onnx"),
        "--data",
        str(data),
        "--trials",
        "3",
        "--accuracy-steps",
        "4",
        "--out",
        str(tmp_path / "plan"),
        cwd=elsewhere,
    )
    assert res.returncode in PLANNED, res.stderr  # a plan written (four steps may learn nothing)
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "plan", moved)
    assert (moved / f"{source.name}.data").is_file()

    res = planner("run", str(moved), "--data", str(data), "--steps", "3", "--out", str(tmp_path / "tuned"), cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    tuned = api.inspect(tmp_path / "tuned" / "model.onnx")
    assert tuned.data_files == ("model.onnx.data",)
    with np.load(tmp_path / "tuned" / "weights.npz") as npz:
        for name, value in tuned.initializers.items():
            np.testing.assert_array_equal(value, npz[name])
