"""Multi-fidelity accuracy: every candidate is screened with a short fine-tune, only unbeaten ones
train on to `accuracy_steps`, screened-out ones are never the plan, and training on from the
screen ends exactly where one full run would."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm

from builders import blobs
from planner import api
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.errors import BadInput
from planner.inputs.data import load_dataset
from planner.inputs.model import load_model
from planner.inputs.spaces import load_space
from planner.measurement.accuracy import FineTune
from planner.search.fidelity import ScreenPoint, beaten_by, margin
from planner.types import Candidate

HOST = tvm.target.Target({"kind": "llvm"})


def test_training_on_from_the_screen_ends_where_one_full_run_does(tiny_model, tiny_data, tmp_path):
    model = load_model(tiny_model)
    data = load_dataset(tiny_data, model)
    # every layer trains, with momentum: the optimizer state must carry over from screen to end too
    candidate = Candidate(tuple((layer.name, "full") for layer in model.layers), 4, "momentum", 0.05)
    step = compile_candidate(model, candidate, BuildOptions(HOST))
    run = FineTune(model, data, candidate, step, 3, tmp_path / "a")
    screen, full = run.result(5), run.result(17)
    fresh = FineTune(model, data, candidate, step, 3, tmp_path / "b").result(17)
    assert (screen.steps, full.steps) == (5, 17)
    assert (full.before, full.after, full.loss_before, full.loss_after) == (
        fresh.before,
        fresh.after,
        fresh.loss_before,
        fresh.loss_after,
    )
    assert full.loss_after != screen.loss_after  # it did train on
    # both step counts are cached: a new run reads them and trains nothing
    again = FineTune(model, data, candidate, step, 3, tmp_path / "a")
    assert again.result(17) == full and again.result(5) == screen and again._session is None


def _p(trial, acc, lat, mem):
    return ScreenPoint(trial, acc, lat, mem)


@pytest.mark.parametrize(
    ("rivals", "expected"),
    [
        ([], None),
        ([_p(1, 0.80, 1.0, 100)], 1),  # better everywhere
        ([_p(1, 0.80, 2.0, 100)], 1),  # as fast, as small, more accurate
        ([_p(1, 0.80, 2.1, 100)], None),  # more accurate but slower
        ([_p(1, 0.80, 1.0, 101)], None),  # more accurate but larger
        ([_p(1, 0.54, 1.0, 100)], None),  # within the noise margin (0.05)
        ([_p(1, 0.60, 1.0, 100), _p(2, 0.90, 1.5, 50), _p(3, 0.99, 9.0, 50)], 2),  # the most accurate dominating rival
    ],
)
def test_a_candidate_is_beaten_only_by_a_rival_better_on_every_objective(rivals, expected):
    rival = beaten_by(0.5, 2.0, 100.0, rivals, margin(100))
    assert (rival.trial if rival else None) == expected


def test_margin_is_the_standard_error_of_an_even_accuracy():
    assert margin(100) == pytest.approx(0.05) and margin(2500) == pytest.approx(0.01)
    assert margin(0) == 0.5  # an empty val split: nothing beats anything


@pytest.fixture(scope="module")
def screened(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("screened")
    data = blobs(out / "blobs.npz", n=1000)  # 200 val samples: a noise margin of 0.035
    space = out / "space.yaml"  # learning rates from useless to good: some candidates are plainly beaten
    space.write_text("batch_size: [4, 16]\nlr: {low: 0.0001, high: 0.3}\n")
    result = api.plan(
        model=tiny_model,
        data=data,
        space=str(space),
        out=out / "plan",
        storage=api.default_storage(out / "plan"),
        trials=12,
        accuracy_steps=40,
        screen_steps=10,
        latency_repeats=3,
    )
    return result, space, data


def test_every_candidate_is_screened_and_only_unbeaten_ones_train_on(screened, tiny_model):
    """... except the space's hand-made recipes (the first trials), which always train on: a
    plan is never worse than them."""
    result, space, data = screened
    recipes = len(load_space(str(space)).anchors(load_model(tiny_model)))
    assert 0 < recipes < 10
    done = [t for t in result.trials if t.complete]
    assert len(done) >= 10
    screen = {t.number: t.fidelity.screen for t in done}
    assert all(s.steps == 10 for s in screen.values())
    promoted = [t for t in done if t.fidelity.promoted]
    out = [t for t in done if not t.fidelity.promoted]
    assert promoted and out, "the test needs both a promoted and a screened-out trial"
    noise = margin(len(np.load(data)["y"]) // 5)
    within = [u.number for u in done if not (u.over_budget.keys() - {"screened"})]
    for t in done:  # one trial at a time: every earlier one within the budgets was compared
        assert list(t.fidelity.against) == [n for n in within if n < t.number]
        beats = [
            u
            for u in done
            if u.number in t.fidelity.against
            if screen[u.number].after > screen[t.number].after + noise
            and u.latency.median <= t.latency.median
            and u.memory.total <= t.memory.total
        ]
        recipe = t.number < recipes and not t.over_budget.keys() - {"screened"}
        assert t.fidelity.promoted == (recipe or not beats), (t.number, t.fidelity.reason)
        assert recipe == ("hand-made recipes" in t.fidelity.reason)
        if t.fidelity.promoted:
            assert t.accuracy.steps == 40 and t.feasible
        else:
            assert t.accuracy == t.fidelity.screen  # its objective is the screen's own result
            assert t.screened_out and not t.feasible and t.over_budget == {"screened": 1.0}
            assert f"trial {max(beats, key=lambda u: screen[u.number].after).number}" in t.fidelity.reason
    assert result.plan.selection.trial in {t.number for t in promoted}
    assert {p.trial for p in result.plan.pareto} <= {t.number for t in promoted}


def test_trials_json_and_the_report_say_what_was_screened_out(screened):
    result, _, _ = screened
    saved = {t["number"]: t for t in json.loads((result.out / "trials.json").read_text())}
    for t in result.trials:
        assert saved[t.number]["fidelity"] == (t.fidelity.to_json() if t.fidelity else None)  # (None: failed first)
    n_out = sum(t.screened_out for t in result.trials)
    assert f"{n_out} screened out after a short fine-tune" in (result.out / "report.html").read_text()


def test_resuming_with_other_screen_steps_is_refused(screened, tiny_model):
    result, space, data = screened
    with pytest.raises(BadInput, match="different screen_steps"):
        api.plan(
            model=tiny_model,
            data=data,
            space=str(space),
            out=result.out,
            storage=api.default_storage(result.out),
            trials=13,
            accuracy_steps=40,
            screen_steps=0,
        )


@pytest.mark.parametrize("steps", [-1, 24, 30])
def test_screen_steps_must_be_fewer_than_accuracy_steps(steps, tmp_path):
    with pytest.raises(BadInput, match="screen_steps"):
        api.plan(out=tmp_path / "p", accuracy_steps=24, screen_steps=steps)
    assert not (tmp_path / "p").exists()


def test_without_screening_every_candidate_trains_all_steps(tiny_model, tiny_data, tmp_path):
    result = api.plan(
        model=tiny_model, data=tiny_data, out=tmp_path / "p", trials=3, accuracy_steps=10, screen_steps=0, latency_repeats=3
    )
    assert all(t.fidelity is None and t.accuracy.steps == 10 and "screened" not in t.over_budget for t in result.trials)
    assert np.isfinite([t.accuracy.after for t in result.trials]).all()
