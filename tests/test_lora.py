"""LoRA adapters: gradients by the chain rule through B·A, training, and the merged export."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

import zoo
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.inputs.model import load_model
from planner.modes.lora import adapter_delta, adapter_shapes, lora_a, lora_b
from planner.runtime.session import TrainingSession
from planner.types import Candidate

HOST = BuildOptions(tvm.target.Target({"kind": "llvm"}))
LR = 0.5


def _batch(model, B: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (B, *model.only_input.shape)).astype(np.float32), rng.integers(0, model.n_classes, B)


def _adapter(shape, axis, rank, seed):
    """B and A both non-zero, so both factors receive a gradient."""
    rng = np.random.default_rng(seed)
    b_shape, a_shape = adapter_shapes(shape, axis, rank)
    return rng.normal(0, 0.3, b_shape).astype(np.float32), rng.normal(0, 0.3, a_shape).astype(np.float32)


def _sgd_gradients(session: TrainingSession, x, y) -> dict[str, np.ndarray]:
    """Each trainable input's gradient, read off one plain-SGD step: (old - new) / lr."""
    before = {n: t.numpy() for n, t in zip(session.sig.trainable, session.trainable)}
    session.step(x, y)
    after = {n: t.numpy() for n, t in zip(session.sig.trainable, session.trainable)}
    return {n: (before[n].astype(np.float64) - after[n]) / LR for n in before}


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    return load_model(zoo.save(zoo.vit_block(16, classes=4), tmp_path_factory.mktemp("vit") / "vit.onnx"))


@pytest.mark.parametrize(
    "which, layers",
    [
        ("tiny", {"c2": 2, "fc": 1}),  # a 3×3 Conv and a Gemm (transB): output channels on axis 0
        ("vit", {"attn.q": 4, "mlp.fc1": 2, "embed": 3}),  # MatMul weights, (in, out): axis 1; a 4×4 patch Conv
    ],
)
def test_adapter_gradients_are_the_weights_gradient_through_b_times_a(which, layers, tiny_model, vit):
    """The reference is the step's own weight gradient at the merged weight W + B·A (itself
    checked against PyTorch autograd and finite differences): dB = dW'·Aᵀ, dA = Bᵀ·dW'."""
    model = load_model(tiny_model) if which == "tiny" else vit
    x, y = _batch(model, 4)
    weights, merged = dict(model.initializers), dict(model.initializers)
    for i, (name, rank) in enumerate(layers.items()):
        layer = model.layer(name)
        w = layer.weight
        b, a = _adapter(layer.param_shapes[w], layer.out_axis, rank, seed=i)
        weights[lora_b(w)], weights[lora_a(w)] = b, a
        merged[w] = weights[w] + adapter_delta(b, a, weights[w].shape, layer.out_axis)

    lora = compile_candidate(model, Candidate(tuple((n, f"lora:{r}") for n, r in layers.items()), 4, "sgd", LR), HOST)
    got = _sgd_gradients(TrainingSession(lora.library, lora.signature, weights), x, y)
    plain = compile_candidate(model, Candidate(tuple((n, "weight") for n in layers), 4, "sgd", LR), HOST)
    want = _sgd_gradients(TrainingSession(plain.library, plain.signature, merged), x, y)

    assert set(got) == {f(model.layer(n).weight) for n in layers for f in (lora_a, lora_b)}
    for name in layers:
        layer = model.layer(name)
        w, axis = layer.weight, layer.out_axis
        dw = np.moveaxis(want[w], axis, 0).reshape(layer.param_shapes[w][axis], -1)  # (out, rest)
        b, a = weights[lora_b(w)].astype(np.float64), weights[lora_a(w)].astype(np.float64)
        for part, expected in ((lora_b(w), dw @ a.T), (lora_a(w), b.T @ dw)):
            scale = np.abs(expected).max()
            assert scale > 1e-6, f"{part}: no gradient to compare"
            np.testing.assert_allclose(got[part], expected, atol=2e-4 * scale, err_msg=part)


def test_lora_trains_the_adapters_only_and_merges_them_into_the_same_weights(vit):
    cand = Candidate((("attn.q", "lora:2"), ("attn.v", "lora:2"), ("classifier", "full")), 8, "sgd", 0.1)
    step = compile_candidate(vit, cand, HOST)
    sig = step.signature
    q, v = vit.layer("attn.q").weight, vit.layer("attn.v").weight
    assert set(sig.trainable) == {lora_a(q), lora_b(q), lora_a(v), lora_b(v), "classifier.weight", "classifier.bias"}
    assert q in sig.frozen and "attn.q.bias" in sig.frozen
    # the adapters and their optimizer state count, the frozen weight does not train
    adapter_bytes = sum(4 * int(np.prod(s)) for s in (*adapter_shapes((32, 32), 1, 2),)) * 2
    assert step.memory.trainable_params == adapter_bytes + 4 * (4 * 32 + 4)

    session = TrainingSession(step.library, sig, vit.initializers)
    start = session.weights()
    assert all(np.array_equal(start[n], w) for n, w in vit.initializers.items()), "B starts at zero: the model is unchanged"
    x, y = _batch(vit, 8)
    for _ in range(3):
        session.step(x, y)
    after = session.weights()
    assert set(after) == set(vit.initializers)
    assert all(after[n].shape == w.shape and after[n].dtype == w.dtype for n, w in vit.initializers.items())
    moved = {n for n, w in vit.initializers.items() if not np.array_equal(after[n], w)}
    assert moved == {q, v, "classifier.weight", "classifier.bias"}
    # the merged weights are the trained model: the plain graph with them predicts what the step does
    plain = compile_candidate(vit, Candidate((("classifier", "full"),), 8, "sgd", 0.1), HOST)
    merged_logits = TrainingSession(plain.library, plain.signature, after).outputs(x)
    np.testing.assert_allclose(session.outputs(x), merged_logits, rtol=1e-4, atol=1e-5)


def test_a_lora_plan_runs_and_writes_the_original_graph_with_merged_weights(vit, tmp_path):
    """`measure` a LoRA scheme (with recomputation), `run` it: the fine-tuned model.onnx has the
    original nodes and initializers (names, shapes, dtypes), the adapted weights changed."""
    import onnx
    import yaml
    from onnx import numpy_helper

    import planner

    data = tmp_path / "task.npz"
    np.savez(data, **zoo.synthetic_task(vit.only_input.shape, classes=vit.n_classes, n=64, seed=0))
    scheme = tmp_path / "lora.yaml"
    scheme.write_text(
        yaml.safe_dump(
            {
                "name": "lora",
                "trainable": [
                    {"layer": "attn.q", "mode": "lora", "rank": 2},
                    {"layer": "mlp.fc1", "mode": "lora", "rank": 4},
                    {"layer": "classifier"},
                ],
                "recompute": ["mlp.fc1"],
                "batch_size": 8,
                "optimizer": {"name": "adam", "lr": 0.01},
            }
        )
    )
    result = planner.measure(vit.path, scheme=scheme, data=data, out=tmp_path / "plan", accuracy_steps=4, latency_repeats=2)
    choice = result.plan.choice
    assert [(t.layer, t.mode) for t in choice.trainable][:2] == [("attn.q", "lora:2"), ("mlp.fc1", "lora:4")]
    assert choice.recompute == ["mlp.fc1"]
    report = (tmp_path / "plan" / "report.md").read_text()
    assert "| attn.q | MatMul | lora rank 2 |" in report
    assert "Recomputation (as the scheme lists): the backward pass keeps the inputs of mlp.fc1" in report

    planner.run(tmp_path / "plan", data=data, steps=5, out=tmp_path / "tuned")
    before, after = onnx.load(vit.path), onnx.load(tmp_path / "tuned" / "model.onnx")
    assert [(n.op_type, list(n.input), list(n.output)) for n in after.graph.node] == [
        (n.op_type, list(n.input), list(n.output)) for n in before.graph.node
    ]
    old = {t.name: numpy_helper.to_array(t) for t in before.graph.initializer}
    new = {t.name: numpy_helper.to_array(t) for t in after.graph.initializer}
    assert {n: (a.shape, a.dtype) for n, a in new.items()} == {n: (a.shape, a.dtype) for n, a in old.items()}
    changed = {n for n in old if not np.array_equal(old[n], new[n])}
    assert changed == {"attn.q.weight", "mlp.fc1.weight", "classifier.weight", "classifier.bias"}
