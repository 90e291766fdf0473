"""Reports: what `planner plan` writes for people to read, and `planner report` in every format."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from planner import api
from processes import planner

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def plans(tiny_model, tiny_data, tmp_path_factory):
    """A plan on the host, and one on a target whose RAM budget half its trials break."""
    root = tmp_path_factory.mktemp("report")
    first = api.plan(
        model=tiny_model,
        data=tiny_data,
        out=root / "roomy",
        storage=api.default_storage(root / "roomy"),
        trials=6,
        accuracy_steps=30,
        latency_repeats=5,
    )
    memories = sorted(t.memory.total for t in first.trials if t.complete)
    tight = root / "tight.yaml"
    tight.write_text(f"tvm_target: {{kind: llvm}}\nram_budget_bytes: {memories[len(memories) // 2]}\n")
    second = api.plan(
        model=tiny_model,
        data=tiny_data,
        out=root / "tight",
        storage=api.default_storage(root / "tight"),
        target=str(tight),
        trials=6,
        accuracy_steps=30,
        latency_repeats=5,
    )
    return first, second


def test_plan_writes_a_self_contained_report(plans):
    out = plans[1].out
    page = (out / "report.html").read_text()
    assert not re.search(r"<(script|link)[^>]+(src|href)=", page), "the page must not load anything"
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js is inlined
    trials = json.loads((out / "trials.json").read_text())
    assert len(trials) == 6 and {t["number"] for t in trials} == set(range(6))
    assert any(not t["feasible"] and t["over_budget"] for t in trials), "the tight target should reject some"


def test_report_json_from_the_plan_and_from_the_study_agree(plans):
    result = plans[1]
    from_plan = json.loads(planner("report", str(result.out), "--format", "json").stdout)
    study = result.plan.study
    res = planner("report", "--storage", study.storage, "--study", study.name, "--format", "json")
    assert res.returncode == 0, res.stderr
    from_study = json.loads(res.stdout)
    assert from_plan["chosen"] == from_study["chosen"] == result.plan.selection.trial
    assert from_plan["pareto"] == sorted(from_study["pareto"]) == [p.trial for p in result.plan.pareto]
    assert [t["number"] for t in from_plan["trials"]] == [t["number"] for t in from_study["trials"]]
    counts = from_plan["counts"]
    assert counts["feasible"] + counts["screened"] + counts["infeasible"] + counts["fail"] == 6 and counts["infeasible"] >= 1
    trains = {r["layer"]: r["mode"] for r in from_plan["layers"]}
    for entry in result.plan.choice.trainable:
        assert trains[entry.layer] == entry.mode
    assert sum(mode == "frozen" for mode in trains.values()) == len(trains) - len(result.plan.choice.trainable)


def test_report_md_to_a_file(plans, tmp_path):
    target = tmp_path / "r.md"
    res = planner("report", str(plans[0].out), "--format", "md", "--out", str(target))
    assert res.returncode == 0, res.stderr
    text = target.read_text()
    for heading in ("## Per-layer map", "## Memory at the step's peak", "## Pareto front", "## How it was measured"):
        assert heading in text
    assert f"| {plans[0].plan.selection.trial} ★ |" in text


def test_report_of_nothing_is_one_line(tmp_path):
    res = planner("report", str(tmp_path))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "holds no plan" in res.stderr
    res = planner("report", "--storage", str(tmp_path / "none.journal"), "--study", "x")
    assert res.returncode == 2 and "no study 'x'" in res.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (Debian's `chromium`; .ci/run installs it)")
def test_headless_chromium_draws_every_figure(plans, tmp_path):
    page = plans[1].out / "report.html"
    res = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=20000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dom = res.stdout
    assert "</html>" in dom, res.stderr[-2000:]
    for plot in ("plot-pareto", "plot-memory", "plot-history"):
        start = dom.index(f'id="{plot}"')
        assert "main-svg" in dom[start : start + 20000], f"{plot} was not drawn"
    history = dom[dom.index('id="plot-history"') :]
    drawn = history[: history.index("</svg>", history.index("main-svg"))].count('class="point"')
    assert drawn >= 6, f"the trial history shows {drawn} of 6 trials"
    pareto = dom[dom.index('id="plot-pareto"') : dom.index('id="plot-memory"')]
    for legend in ("Pareto front (feasible)", "infeasible (over a budget, or diverged)", "chosen plan"):
        assert legend in pareto
