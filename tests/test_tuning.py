"""MetaSchedule tuning: one database per target, shared by every candidate and plan."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import tvm

from planner import api
from planner.backend.lower import tune
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.inputs.model import load_model
from planner.runtime.session import TrainingSession
from planner.types import Candidate

pytestmark = pytest.mark.slow  # MetaSchedule tuning runs, locally and over RPC: minutes

SCHEME = "trainable: [{layer: c2}, {layer: fc}]\nbatch_size: 4\noptimizer: {name: sgd, lr: 0.1}\n"


def test_tuned_kernels_are_recorded_shared_and_train_like_default_ones(tiny_model, tiny_data, tmp_path):
    cache = tmp_path / "cache"
    scheme = tmp_path / "s.yaml"
    scheme.write_text(SCHEME)
    result = api.measure(
        tiny_model,
        scheme=scheme,
        data=tiny_data,
        out=tmp_path / "m",
        accuracy_steps=5,
        latency_repeats=3,
        cache_dir=cache,
        tune_trials=4,
    )
    step = result.plan.step.model_dump()
    assert step["tune_trials"] == 4 and 1 <= len(step["tuned_kernels"]) <= step["kernels"]
    assert f"{len(step['tuned_kernels'])} of {step['kernels']} kernels" in result.plan.measurement.schedules

    # another candidate (the same layers, another optimizer: new update kernels), one trial of
    # its own (spent on a kernel the database does not know): the kernels it shares with the
    # first come tuned from the first's records
    model = load_model(tiny_model)
    cand = Candidate((("c2", "full"), ("fc", "full")), 4, "momentum", 0.1)
    host = tvm.target.Target({"kind": "llvm"})
    tuned = compile_candidate(model, cand, BuildOptions(host, cache, tune_trials=1))
    assert set(step["tuned_kernels"]) <= set(tuned.tuned_kernels), (step["tuned_kernels"], tuned.tuned_kernels)

    default = compile_candidate(model, cand, BuildOptions(host, cache))
    assert default.tuned_kernels == ()
    rng = np.random.default_rng(0)
    x, y = rng.normal(0, 1, (4, *model.only_input.shape)).astype(np.float32), rng.integers(0, model.n_classes, 4)
    after = []
    for compiled in (tuned, default):
        session = TrainingSession(compiled.library, compiled.signature, model.initializers)
        session.step(x, y)
        after.append(session.weights())
    for name in after[0]:
        np.testing.assert_allclose(after[0][name], after[1][name], rtol=1e-5, atol=1e-6)


def test_tuning_for_boards_behind_a_tracker_times_its_trials_there(tiny_model, tiny_data, tmp_path):
    """A target behind a tracker tunes on its boards: candidate kernels are built here, timed by
    MetaSchedule's RPC runner on a board (a real tracker and server on 127.0.0.1)."""
    from test_rpc import Boards

    scheme = tmp_path / "s.yaml"
    scheme.write_text(SCHEME)
    boards = Boards("tuning-board", 1)
    try:
        result = api.measure(
            tiny_model,
            scheme=scheme,
            data=tiny_data,
            out=tmp_path / "m",
            accuracy_steps=5,
            latency_repeats=3,
            cache_dir=tmp_path / "cache",
            tune_trials=4,
            tracker=boards.tracker,
            key=boards.key,
        )
    finally:
        boards.close()
    step = result.plan.step.model_dump()
    assert result.plan.target.device == "rpc:tuning-board"
    assert 1 <= len(step["tuned_kernels"]) <= step["kernels"]


def test_tvmscript_sees_the_same_stack_while_the_intrinsics_import():
    """planner imports TVM's tensor intrinsics with its own `inspect.stack` (55 s -> 6 s per
    process): TVMScript's parser must see exactly the frames, names and lines it would have."""

    def both() -> tuple[list, list]:
        return tune._stack(), inspect.stack()

    def fields(frames: list) -> list[tuple]:
        return [(f.frame, f.filename, f.lineno, f.function, f.code_context, f.index) for f in frames]

    ours, theirs = both()
    assert len(ours) > 10 and fields(ours) == fields(theirs)
