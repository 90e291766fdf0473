"""Two trials in flight on a local target: the next candidate compiles while this one fine-tunes,
a latency measurement never runs beside anything, and a seeded study still proposes the same
candidates and measures the same accuracies every run."""

from __future__ import annotations

import threading
import time

import pytest

from builders import blobs
from planner import api
from planner.backend.vm import VmBackend
from planner.measurement.local import LocalRunner
from planner.search import evaluate


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    space = root / "space.yaml"
    space.write_text("batch_size: [4, 16]\nlr: {low: 0.001, high: 0.3}\n")
    return blobs(root / "blobs.npz", n=600), space


def _plan(tiny_model, task, out, **kw):
    data, space = task
    return api.plan(
        model=tiny_model,
        data=data,
        space=str(space),
        out=out,
        trials=11,  # 3 hand-made schemes, 5 more random startup trials, then TPE
        accuracy_steps=60,
        screen_steps=15,
        latency_repeats=3,
        overlap=True,
        **kw,
    )


def _screen(t):
    a = t.fidelity.screen if t.fidelity else None  # everything but the seconds it took
    return a and (a.before, a.after, a.loss_before, a.loss_after, a.steps, a.diverged_at)


def test_a_seeded_study_proposes_and_measures_the_same_every_run(tiny_model, task, tmp_path):
    """Latency is measured, so it varies from run to run, and with it what TPE proposes and what a
    screen promotes; the random sampler's draws, the screens' accuracies and what each screen was
    compared with do not, whatever the threads' timing."""
    # separate caches: every compile and fine-tune is done again, with other timings
    first = _plan(tiny_model, task, tmp_path / "a", cache_dir=tmp_path / "cache-a", sampler="random")
    second = _plan(tiny_model, task, tmp_path / "b", cache_dir=tmp_path / "cache-b", sampler="random")
    assert [t.candidate for t in first.trials] == [t.candidate for t in second.trials]
    assert [_screen(t) for t in first.trials] == [_screen(t) for t in second.trials]
    assert [t.fidelity and t.fidelity.against for t in first.trials] == [t.fidelity and t.fidelity.against for t in second.trials]


def test_compiles_overlap_fine_tunes_and_timing_runs_alone(tiny_model, task, tmp_path, monkeypatch):
    spans: dict[str, list[tuple[float, float]]] = {"compile": [], "measure": [], "finetune": []}
    lock = threading.Lock()

    def timed(kind, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    spans[kind].append((t0, time.perf_counter()))

        return run

    monkeypatch.setattr(VmBackend, "build", timed("compile", VmBackend.build))
    monkeypatch.setattr(VmBackend, "host_build", timed("compile", VmBackend.host_build))
    monkeypatch.setattr(LocalRunner, "measure", timed("measure", LocalRunner.measure))
    monkeypatch.setattr(evaluate.FineTune, "result", timed("finetune", evaluate.FineTune.result))
    result = _plan(tiny_model, task, tmp_path / "p", cache_dir=tmp_path / "cache")
    assert sum(t.complete for t in result.trials) >= 9

    def overlap(a, b):
        return a[0] < b[1] and b[0] < a[1]

    others = spans["compile"] + spans["finetune"]
    assert len(spans["measure"]) >= 9
    for m in spans["measure"]:
        assert not any(overlap(m, o) for o in others), "a latency measurement ran beside a compile or fine-tune"
    assert any(overlap(c, f) for c in spans["compile"] for f in spans["finetune"]), "nothing compiled during a fine-tune"
