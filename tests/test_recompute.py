"""Recomputation: the step trains exactly as it does keeping every activation, in less memory."""

from __future__ import annotations

import numpy as np
import optuna
import pytest
import tvm
import yaml

import zoo
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.errors import BadInput
from planner.inputs.model import load_model
from planner.inputs.schemes import load_scheme
from planner.inputs.spaces import SearchSpace
from planner.runtime.session import TrainingSession
from planner.types import Candidate, Recompute

HOST = BuildOptions(tvm.target.Target({"kind": "llvm"}))
STEPS = 3


def _train(model, cand: Candidate, seed: int = 0) -> tuple[list[float], dict[str, np.ndarray]]:
    """Losses and weights after `STEPS` steps on fixed random batches."""
    step = compile_candidate(model, cand, HOST)
    session = TrainingSession(step.library, step.signature, model.initializers)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(STEPS):
        B = step.signature.batch_size
        x = rng.normal(0, 1, (B, *model.only_input.shape)).astype(np.float32)
        losses.append(session.step(x, rng.integers(0, model.n_classes, B)))
    return losses, session.weights()


def _same_training(model, cand: Candidate, recompute) -> None:
    plain = _train(model, cand)
    recomputed = _train(model, Candidate(**{**cand.__dict__, "recompute": recompute}))
    assert recomputed[0] == plain[0], "losses differ"
    for name, w in plain[1].items():
        assert np.array_equal(recomputed[1][name], w), f"{name} differs"


def _full(model, **options) -> Candidate:
    return Candidate(tuple((layer.name, "full") for layer in model.layers if layer.trainable), **options)


@pytest.fixture(scope="module")
def resnet8(tmp_path_factory):
    return load_model(zoo.save(zoo.resnet(8, resolution=16), tmp_path_factory.mktemp("r8") / "resnet8.onnx"))


@pytest.mark.parametrize("updates", ["in-place", "copy"])
@pytest.mark.parametrize("recompute", ["auto", ("s1.b0.conv1", "s2.b0.conv2")], ids=["auto", "listed"])
def test_a_recomputing_step_trains_bit_for_bit_as_the_plain_one(resnet8, updates, recompute):
    """Residual blocks and BatchNorm. In place, plain SGD's updates move up into the backward
    pass, and a recomputed forward pass must not read a weight (or a view of one: a BatchNorm
    scale reshaped) already overwritten."""
    _same_training(resnet8, _full(resnet8, batch_size=4, optimizer="sgd", lr=0.05, updates=updates), recompute)


def test_recomputation_composes_with_sparse_ratio_int8_and_accumulated_updates(resnet8):
    names = [layer.name for layer in resnet8.layers if layer.trainable]
    cand = Candidate(
        trainable=((names[4], "ratio:0.5"), *((n, "bias") for n in names[5:-3]), *((n, "full") for n in names[-3:])),
        batch_size=2,
        grad_accum=2,
        optimizer="adam",
        lr=0.01,
        frozen_weights="int8",
    )
    _same_training(resnet8, cand, "auto")


@pytest.mark.slow
def test_mobilenet_recomputes_bit_for_bit(tmp_path):
    """Depthwise convolutions, ReLU6 (a clip whose gradient reads its output), inverted residuals."""
    model = load_model(zoo.save(zoo.mobilenet_v2(0.35, 32), tmp_path / "mbv2.onnx"))
    _same_training(model, _full(model, batch_size=4, optimizer="sgd", lr=0.05), "auto")


def test_auto_lowers_a_full_updates_peak_and_says_by_how_much(tmp_path):
    model = load_model(zoo.save(zoo.resnet(8, resolution=32), tmp_path / "resnet8.onnx"))
    plain = compile_candidate(model, _full(model, batch_size=16, optimizer="sgd", lr=0.05), HOST)
    auto = compile_candidate(model, _full(model, batch_size=16, optimizer="sgd", lr=0.05, recompute="auto"), HOST)
    assert auto.memory.total < 0.8 * plain.memory.total, (auto.memory, plain.memory)
    held = auto.memory.activations + auto.memory.gradients
    assert auto.memory.recompute_saved == plain.memory.activations + plain.memory.gradients - held
    assert plain.memory.recompute_saved == 0 and plain.signature.kept == ()
    layers = {layer.name for layer in model.layers}
    assert auto.signature.kept and set(auto.signature.kept) <= layers


def test_a_scheme_lists_the_layers_whose_inputs_are_kept(resnet8, tmp_path):
    scheme = {
        "name": "kept",
        "trainable": [{"layer": "classifier"}],
        "batch_size": 4,
        "optimizer": {"name": "sgd", "lr": 0.1},
        "recompute": ["s1.b0.conv1"],
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scheme))
    assert load_scheme(path).candidate(resnet8).recompute == ("s1.b0.conv1",)
    path.write_text(yaml.safe_dump({**scheme, "recompute": "auto"}))
    assert load_scheme(path).candidate(resnet8).recompute is Recompute.AUTO
    path.write_text(yaml.safe_dump({**scheme, "recompute": ["no.such.layer"]}))
    with pytest.raises(BadInput, match="no layer named 'no.such.layer'"):
        load_scheme(path).candidate(resnet8)


def test_a_space_searches_recomputation(resnet8):
    space = SearchSpace(name="s", recompute=["none", "auto"])
    params = {"batch_size": 8, "optimizer": "sgd", "lr": 0.05, "precision": "fp32", "grad_accum": 1}
    params |= {"frozen_weights": "fp32", "updates": "in-place"}
    params |= {f"mode:{n}": "full" for n in space.layer_names(resnet8)}
    for choice in ("none", "auto"):
        cand = space.sample(optuna.trial.FixedTrial({**params, "recompute": choice}), resnet8)
        assert cand.recompute == choice
    assert Candidate.from_json(cand.to_json()) == cand


def test_auto_keeps_everything_where_no_cut_pays(tiny_model):
    """The tiny CNN's backward pass reads nearly every activation it has: recomputing them would
    cost time and save nothing, so `auto` marks nothing."""
    model = load_model(tiny_model)
    auto = compile_candidate(model, _full(model, batch_size=4, optimizer="sgd", lr=0.1, recompute="auto"), HOST)
    assert auto.signature.kept == () and auto.memory.recompute_saved == 0
