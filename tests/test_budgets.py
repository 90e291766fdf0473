"""One study, a plan per memory budget: `planner plan --budgets`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

import planner
from planner.inputs.targets import budget_label, load_target
from planner.plans.directory import read_plan

TOLERANCE = 0.01


def _plan(tiny_model, tiny_data, out, budgets, **options):
    return planner.plan(
        model=tiny_model,
        data=tiny_data,
        out=out,
        trials=8,
        accuracy_steps=12,
        screen_steps=0,
        latency_repeats=2,
        sampler="random",
        seed=5,
        budgets=budgets,
        accuracy_tolerance=TOLERANCE,
        **options,
    )


def _least_memory_within(trials, budget):
    """The `memory` policy, written out: among trials within `budget` (and every other budget),
    those within the tolerance of the best accuracy, then the least peak memory."""
    fits = [t for t in trials if t.feasible and t.memory.total <= budget]
    best = max(t.accuracy.after for t in fits)
    good = [t for t in fits if t.accuracy.after >= best - TOLERANCE]
    return min(good, key=lambda t: (t.memory.total, t.latency.median, t.number)).number


def test_one_study_writes_a_whole_plan_per_memory_budget(tiny_model, tiny_data, tmp_path):
    # a first study finds the memory the candidates need; the same seeded study again, with a
    # budget among them, must choose for each budget from the trials within it
    first = _plan(tiny_model, tiny_data, tmp_path / "a", ["1GiB"])
    middle = first.plan.metrics.peak_memory_bytes.total - 1  # just too small for the study's own plan
    assert any(t.feasible and t.memory.total <= middle for t in first.trials), "the check needs a smaller candidate"
    budgets = [1024, middle, 2**30]
    result = _plan(tiny_model, tiny_data, tmp_path / "b", [str(b) for b in budgets])
    assert [t.candidate for t in result.trials] == [t.candidate for t in first.trials]

    out = tmp_path / "b"
    family = result.plan.selection.budgets
    assert [(b.budget_bytes, b.directory) for b in family] == [(b, budget_label(b)) for b in budgets]
    assert family[0].trial is None and not (out / "1KiB").exists(), "nothing fits 1 KiB: no plan, and it says so"
    for b in family[1:]:
        plan = read_plan(out / b.directory)  # a whole plan: every file verified against its hash
        assert plan.selection.trial == b.trial == _least_memory_within(result.trials, b.budget_bytes)
        assert plan.metrics.peak_memory_bytes.total <= b.budget_bytes
        assert plan.measurement.ram_budget_bytes == b.budget_bytes
    assert family[-1].trial == result.plan.selection.trial, "the largest budget's plan is the study's own"
    assert family[1].trial != family[-1].trial, "a smaller budget must have cost the best trial"

    report = (out / "report.md").read_text()
    assert "## A plan per memory budget" in report and "no trial fits" in report
    assert "most accurate within each memory" in (out / "report.html").read_text()
    run = planner.run(out / family[1].directory, data=tiny_data, steps=2, out=tmp_path / "tuned")
    assert run.steps == 2


def test_a_target_lists_its_budgets_and_bad_ones_are_refused(tmp_path):
    base = yaml.safe_load(open(planner.__path__[0] + "/../hw_targets/host.yaml").read())
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({**base, "ram_budgets": ["1MiB", 262144, "1MiB"]}))
    assert load_target(str(path)).ram_budgets == [262144, 2**20]

    res = subprocess.run(
        [sys.executable, "-m", "planner", "plan", "--budgets", "256KiB,lots", "--out", str(tmp_path / "p")],
        capture_output=True,
        text=True,
    )
    assert (
        res.returncode == 2 and res.stderr.strip() == "error: --budgets: not a size: 'lots' (use bytes or units like 512MiB, 2GB)"
    )
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("nbytes, label", [(262144, "256KiB"), (3 * 2**19, "1536KiB"), (2**30, "1GiB"), (1000, "1000B")])
def test_budget_directories_are_named_as_people_write_sizes(nbytes, label):
    assert budget_label(nbytes) == label


def test_plan_says_where_each_budgets_plan_went(tiny_model, tiny_data, tmp_path):
    from processes import planner as cli

    out = tmp_path / "p"
    res = cli(
        "plan", "--model", tiny_model, "--data", tiny_data, "--out", out, "--trials", "3", "--accuracy-steps", "4",
        "--budgets", "1KiB,1GiB", "--quiet",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[-2:] == [
        "  within 1.0 KiB: no trial fits",
        f"  within 1,048,576.0 KiB: {out}/1GiB/: trial {read_plan(out).selection.trial}",
    ]


def test_a_candidate_estimated_over_the_ram_budget_is_infeasible_and_never_compiled(tiny_model, tiny_data, tmp_path):
    """The training graph's memory estimate screens a candidate before its compile: one clearly
    over the RAM budget ends as an infeasible trial, its memory recorded as estimated, and its step
    is never built; the others are compiled and measured as ever."""
    from planner.backend.graph.estimate import LOW, estimate
    from planner.backend.lower.pipeline import BuildOptions, training_module
    from planner.backend.vm.compile import in_cache
    from planner.inputs.model import load_model

    first = _plan(tiny_model, tiny_data, tmp_path / "a", ["1GiB"])
    model = load_model(tiny_model)
    floors = {}
    for t in first.trials:
        mod, sig = training_module(model, t.candidate)
        floors[t.number] = estimate(mod["train_step"], sig, t.candidate).at_least
    # the most any candidate compiled to below the largest floor: that one fits, the largest is clearly over
    budget = max(t.memory.total for t in first.trials if t.memory.total < max(floors.values()))
    cache = tmp_path / "cache"
    result = _plan(tiny_model, tiny_data, tmp_path / "b", [str(budget)], cache_dir=cache)
    assert [t.candidate for t in result.trials] == [t.candidate for t in first.trials]
    build = BuildOptions.for_target(load_target("host"), cache_dir=cache)
    skipped = [t for t in result.trials if floors[t.number] > budget]
    assert skipped and len(skipped) < len(result.trials)
    for t in result.trials:
        if t in skipped:
            assert t.ended_over_budget and t.memory_estimated and not t.feasible and "ram_budget" in t.over_budget
            assert t.latency is None and t.accuracy is None and int(t.memory.total * LOW) == floors[t.number]
            assert not in_cache(load_model(tiny_model), t.candidate, build), "an estimated-over candidate was compiled"
        else:
            assert t.complete and not t.memory_estimated and in_cache(model, t.candidate, build)
    report = (tmp_path / "b" / "trials.json").read_text()
    assert '"memory_estimated": true' in report
