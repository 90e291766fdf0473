"""The compiled training step updates exactly what the candidate trains, with correct gradients."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from builders import gradient_errors
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.inputs.model import load_model
from planner.modes import Layout
from planner.runtime.session import TrainingSession
from planner.types import Candidate

HOST = tvm.target.Target({"kind": "llvm"})


def _batch(model, B=4, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (B, *model.only_input.shape)).astype(np.float32)
    y = rng.integers(0, model.n_classes, B)
    return x, y


def test_ratio_update_trains_only_the_first_channels_and_keeps_state_for_them(tiny_model):
    model = load_model(tiny_model)
    cand = Candidate(trainable=(("c2", "ratio:0.5"),), batch_size=4, optimizer="momentum", lr=0.1)
    step = compile_candidate(model, cand, BuildOptions(HOST))
    assert step.signature.layouts == {"c2.w": Layout("ratio", 0, 3)}
    # momentum keeps one velocity per trainable tensor: the 3-channel slice and the bias, no more
    velocity_shapes = sorted(s for s, _, _ in step.signature.optim_states if s)
    assert velocity_shapes == sorted([(3, 4, 3, 3), (6,)])
    session = TrainingSession(step.library, step.signature, model.initializers)
    session.step(*_batch(model))
    moved = np.abs(session.weights()["c2.w"] - model.initializers["c2.w"]).reshape(6, -1).max(axis=1)
    assert (moved[:3] > 0).all() and (moved[3:] == 0).all()


def test_frozen_params_stay_and_trainable_ones_move(tiny_model):
    model = load_model(tiny_model)
    cand = Candidate(trainable=(("bn", "bias"), ("fc", "full")), batch_size=4, optimizer="sgd", lr=0.1)
    step = compile_candidate(model, cand, BuildOptions(HOST))
    session = TrainingSession(step.library, step.signature, model.initializers)
    before = {k: v.copy() for k, v in session.weights().items()}
    session.step(*_batch(model))
    after = session.weights()
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert moved == {"bn.b", "fc.w", "fc.b"}
    assert set(step.signature.trainable) == {"bn.b", "fc.w", "fc.b"}
    assert "bn.s" in step.signature.frozen and "c1.w" in step.signature.frozen


@pytest.mark.parametrize(
    "trainable",
    [
        (("c1", "full"), ("bn", "full"), ("c2", "full"), ("fc", "full")),
        (("c1", "bias"), ("c2", "full")),
        (("c1", "ratio:0.5"), ("c2", "ratio:0.34"), ("fc", "ratio:0.67")),
    ],
    ids=["all-full", "sparse", "channel-ratio"],
)
def test_gradients_match_float64_finite_differences(tiny_model, trainable):
    errors = gradient_errors(tiny_model, trainable)
    assert set(errors) == {p for layer, mode in trainable for p in load_model(tiny_model).layer(layer).params_for(mode)}
    assert all(e < 1e-3 for e in errors.values()), errors


@pytest.mark.parametrize("precision, scaled", [("fp16", True), ("bf16", False)])
def test_low_precision_step_tracks_the_fp32_step(tiny_model, precision, scaled):
    """Mixed precision: low-precision convolutions/matmuls, fp32 master weights; fp16's loss is
    scaled (and reported unscaled), bf16 has fp32's range and needs no scaling."""
    model = load_model(tiny_model)
    x, y = _batch(model)
    results = {}
    for p in ("fp32", precision):
        cand = Candidate((("c1", "full"), ("c2", "full"), ("fc", "full")), 4, "sgd", 0.1, p)
        step = compile_candidate(model, cand, BuildOptions(HOST))
        session = TrainingSession(step.library, step.signature, model.initializers)
        results[p] = (session.step(x, y), session.weights(), step.signature)
    (loss32, w32, _), (loss_lp, w_lp, sig_lp) = results["fp32"], results[precision]
    assert (sig_lp.loss_scale > 1) == scaled
    assert abs(loss_lp - loss32) <= 2e-2 * abs(loss32)
    for name in ("c1.w", "c2.w", "fc.w", "fc.b"):
        assert w_lp[name].dtype == np.float32  # master weights stay fp32
        d32, d_lp = model.initializers[name] - w32[name], model.initializers[name] - w_lp[name]
        assert np.linalg.norm(d_lp - d32) <= 0.1 * np.linalg.norm(d32), name


def test_int8_frozen_weights_quarter_their_memory_and_train_like_fp32(tiny_model):
    """Frozen conv/linear weights stored int8 (per-channel scales): 1/4 of their bytes, the same
    update to within quantization error, and trainable weights untouched by quantization."""
    model = load_model(tiny_model)
    x, y = _batch(model)
    out = {}
    for storage in ("fp32", "int8"):
        cand = Candidate((("bn", "full"), ("fc", "full")), 4, "sgd", 0.1, frozen_weights=storage)
        step = compile_candidate(model, cand, BuildOptions(HOST))
        session = TrainingSession(step.library, step.signature, model.initializers)
        out[storage] = (step, session.step(x, y), session.weights())
    (s32, loss32, w32), (s8, loss8, w8) = out["fp32"], out["int8"]
    assert s8.signature.quantized == {"c1.w": 0, "c2.w": 0}  # frozen conv weights; fc trains
    conv_bytes = sum(model.initializers[n].nbytes for n in ("c1.w", "c2.w"))
    assert s32.memory.frozen_params - s8.memory.frozen_params >= 0.7 * conv_bytes
    for name in ("c1.w", "c2.w"):  # what the step used: within half a quantization step
        w = model.initializers[name]
        step_size = np.abs(w).max(axis=(1, 2, 3), keepdims=True) / 127
        assert (np.abs(w8[name] - w) <= step_size / 2 + 1e-7).all() and not np.array_equal(w8[name], w)
    assert abs(loss8 - loss32) <= 1e-2 * abs(loss32)
    d32, d8 = model.initializers["fc.w"] - w32["fc.w"], model.initializers["fc.w"] - w8["fc.w"]
    assert np.linalg.norm(d8 - d32) <= 0.05 * np.linalg.norm(d32)


def test_gradient_accumulation_equals_one_big_batch(tiny_model):
    """batch 2 x 4 micro-batches updates exactly like batch 8 (mean loss over the effective batch)."""
    model = load_model(tiny_model)
    x, y = _batch(model, B=8)
    results = []
    for batch, accum in ((8, 1), (2, 4)):
        cand = Candidate((("c1", "full"), ("c2", "full"), ("fc", "full")), batch, "momentum", 0.1, grad_accum=accum)
        step = compile_candidate(model, cand, BuildOptions(HOST))
        assert step.signature.batch_size == 8 and step.signature.micro_batch == batch
        session = TrainingSession(step.library, step.signature, model.initializers)
        losses = [session.step(x, y) for _ in range(2)]
        results.append((losses, session.weights(), session.evaluate(x, y)))
    (l_big, w_big, e_big), (l_acc, w_acc, e_acc) = results
    np.testing.assert_allclose(l_acc, l_big, rtol=1e-5)
    for name in w_big:
        np.testing.assert_allclose(w_acc[name], w_big[name], atol=1e-6)
    assert e_acc[1] == e_big[1]


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_in_place_updates_train_exactly_like_copies_in_less_memory(tiny_model, optimizer):
    """`updates: in-place` overwrites weights and optimizer state during the backward pass: the
    same numbers as new buffers would hold, without holding both."""
    model = load_model(tiny_model)
    every = tuple((layer.name, "full") for layer in model.layers if layer.weight or layer.bias)
    steps = {
        u: compile_candidate(
            model, Candidate(trainable=every, batch_size=4, optimizer=optimizer, lr=0.05, updates=u), BuildOptions(HOST)
        )
        for u in ("copy", "in-place")
    }
    assert steps["copy"].in_place_updates == 0
    assert steps["in-place"].in_place_updates >= len(steps["in-place"].signature.trainable)
    assert steps["in-place"].memory.total < steps["copy"].memory.total
    runs = {}
    for u, step in steps.items():
        session = TrainingSession(step.library, step.signature, model.initializers)
        losses = [session.step(*_batch(model, seed=i)) for i in range(3)]
        runs[u] = losses, session.weights(), [s.numpy() for s in session.states]
    assert runs["copy"][0] == runs["in-place"][0]
    for name, w in runs["copy"][1].items():
        np.testing.assert_array_equal(runs["in-place"][1][name], w, err_msg=name)
    for a, b in zip(runs["copy"][2], runs["in-place"][2], strict=True):
        np.testing.assert_array_equal(b, a)


def test_training_graphs_built_in_several_threads_at_once_are_each_whole(tiny_model):
    """A search builds in several threads (trials on parallel boards; a memory estimate beside a
    compile), and Relax's block builder is one per process: each build, and the model's import
    inside it, must hold it alone — or one breaks the other, and a candidate is blamed for it."""
    import threading

    from planner.backend.graph.training import build_training_module

    model, failures = load_model(tiny_model), []

    def build(batch: int) -> None:
        for k in range(3):  # a new batch each time: each imports the model afresh
            candidate = Candidate(trainable=(("fc", "full"),), batch_size=batch + k, optimizer="adam", lr=0.01)
            try:
                build_training_module(model, candidate)
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                failures.append(f"batch {batch + k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=build, args=(b,)) for b in (3, 11, 19)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
