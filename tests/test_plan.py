"""`planner plan` end to end on a tiny model: the plan directory, the budget, resuming a killed run."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import optuna
import pytest
import tvm

from builders import tiny_cnn
from planner import api
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.inputs.model import load_model
from planner.plans.directory import read_plan
from planner.plans.schema import SCHEMA_VERSION
from planner.plans.select import select
from planner.types import AccuracyResult, Candidate, Latency, MemoryBreakdown, TrialRecord


@pytest.fixture(scope="module")
def tiny_plan(tiny_model, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    result = api.plan(
        model=tiny_model,
        data=tiny_data,
        out=out,
        storage=api.default_storage(out),
        trials=5,
        accuracy_steps=30,
        latency_repeats=5,
    )
    return result


def test_plan_dir_is_complete_and_self_describing(tiny_plan, tiny_model):
    out = tiny_plan.out
    for name in ("plan.json", "train_step.so", "weights.npz", "report.md", "model.onnx", "study.db"):
        assert (out / name).is_file(), name
    plan = json.loads((out / "plan.json").read_text())
    assert plan["schema_version"] == SCHEMA_VERSION
    # the step is the VM back end's artifact: one library, named with its kind
    assert plan["step"]["kind"] == "relax-vm" and plan["step"]["files"] == ["train_step.so"]
    assert plan["target"]["backend"] == "vm"
    assert plan["dataset"]["format"] == "npz" and plan["dataset"]["preprocess"] is None and plan["dataset"]["tokenizer"] is None
    # every file a run loads carries its sha256, which `run` checks before loading anything
    assert plan["files"].keys() == {"train_step.so", "weights.npz", "model.onnx"}
    for name, digest in plan["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    assert plan["target"]["device"] == "local"
    assert plan["study"]["n_trials"] == 5
    lat = plan["metrics"]["step_latency_ms"]
    assert lat["repeats"] >= 5 and 0 < lat["median"] <= lat["p90"]
    mem = plan["metrics"]["peak_memory_bytes"]
    parts = ("activations", "trainable_params", "gradients", "optimizer_state", "frozen_params", "scratch")
    assert mem["total"] == sum(mem[p] for p in parts)
    assert plan["pareto"] and all({"trial", "choice", "metrics"} <= set(p) for p in plan["pareto"])
    # the board starts from the model's own weights, not from an accuracy run's leftovers
    model = load_model(tiny_model)
    with np.load(out / "weights.npz") as w:
        assert set(w.files) == set(model.initializers)
        for k, v in model.initializers.items():
            np.testing.assert_array_equal(w[k], v)
    chosen = plan["choice"]["trainable"]
    report = (out / "report.md").read_text()
    assert all(t["layer"] in report for t in chosen)


def test_a_version_2_plan_still_reads_as_a_plan_of_arrays(tiny_plan, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_plan.out, old)
    raw = json.loads((old / "plan.json").read_text())
    raw["schema_version"] = 2
    for key in ("format", "classes", "preprocess", "split"):
        del raw["dataset"][key]
    (old / "plan.json").write_text(json.dumps(raw))
    plan = read_plan(old)
    assert plan.dataset.format == "npz" and plan.dataset.preprocess is None and plan.dataset.classes is None


def test_a_version_3_plan_still_reads_as_a_plan_without_a_tokenizer(tiny_plan, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_plan.out, old)
    raw = json.loads((old / "plan.json").read_text())
    raw["schema_version"] = 3
    del raw["dataset"]["tokenizer"]
    (old / "plan.json").write_text(json.dumps(raw))
    assert read_plan(old).dataset.tokenizer is None


def test_a_version_4_plan_still_runs_as_the_vm_back_ends_library(tiny_plan, tiny_data, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_plan.out, old)
    raw = json.loads((old / "plan.json").read_text())
    raw["schema_version"] = 4
    del raw["target"]["backend"]
    raw["step"]["library"] = raw["step"].pop("files")[0]
    del raw["step"]["kind"]
    (old / "plan.json").write_text(json.dumps(raw))
    plan = read_plan(old)
    assert (plan.step.kind, plan.step.files, plan.target.backend) == ("relax-vm", ["train_step.so"], "vm")
    ran = api.run(old, data=tiny_data, steps=3, out=tmp_path / "ran")
    assert ran.device == "local" and (tmp_path / "ran" / "weights.npz").is_file()


def test_a_version_5_plan_keeps_a_mode_s_number_apart_and_still_runs(tiny_model, tiny_data, tmp_path):
    """Before version 6 a layer's mode and its number were separate fields (`mode: ratio, ratio:
    0.5`), and the step's signature kept ratio splits and LoRA adapters apart."""
    scheme = tmp_path / "s.yaml"
    scheme.write_text(
        "trainable:\n  - {layer: c2, mode: ratio, ratio: 0.5}\n  - {layer: fc, mode: lora, rank: 2}\n"
        "batch_size: 4\noptimizer: {name: sgd, lr: 0.05}\n"
    )
    new = api.measure(tiny_model, scheme=scheme, data=tiny_data, out=tmp_path / "new", accuracy_steps=10).plan
    raw = json.loads((tmp_path / "new" / "plan.json").read_text())
    raw["schema_version"] = 5
    for choice in [raw["choice"], *(p["choice"] for p in raw["pareto"])]:
        for t in choice["trainable"]:
            kind, _, number = t["mode"].partition(":")
            t.update({"mode": kind} | ({"ratio": float(number)} if kind == "ratio" else {"rank": int(number)} if number else {}))
    layouts = raw["step"]["signature"].pop("layouts")
    raw["step"]["signature"]["splits"] = {w: [a, n] for w, (m, a, n) in layouts.items() if m == "ratio"}
    raw["step"]["signature"]["adapters"] = {w: [a, r] for w, (m, a, r) in layouts.items() if m == "lora"}
    assert raw["step"]["signature"]["splits"] and raw["step"]["signature"]["adapters"]
    (tmp_path / "new" / "plan.json").write_text(json.dumps(raw))
    old = read_plan(tmp_path / "new")
    assert old.candidate == new.candidate and old.signature == new.signature
    assert [t.mode for t in old.choice.trainable] == ["ratio:0.5", "lora:2"]
    ran = api.run(tmp_path / "new", data=tiny_data, steps=3, out=tmp_path / "ran")
    assert ran.device == "local"


def test_rerun_resumes_instead_of_repeating(tiny_plan, tiny_model, tiny_data):
    again = api.plan(
        model=tiny_model,
        data=tiny_data,
        out=tiny_plan.out,
        storage=api.default_storage(tiny_plan.out),
        trials=6,
        accuracy_steps=30,
        latency_repeats=5,
    )
    assert len(again.trials) == 6
    assert [t.candidate for t in again.trials[:5]] == [t.candidate for t in tiny_plan.trials]


def _rec(n, acc, mem, feasible):
    return TrialRecord(
        number=n,
        state="COMPLETE",
        candidate=Candidate((("fc", "full"),), 4, "sgd", 0.1),
        accuracy=AccuracyResult(0.1, acc, 1.0, 0.5, 10, 0.1),
        latency=Latency(1.0, 1.1, 0.9, 1.2, 5, 1, "local"),
        memory=MemoryBreakdown(mem, mem, 0, 0, 0, 0),
        feasible=feasible,
    )


def test_layers_behind_an_op_without_gradient_stay_frozen_and_are_named(tiny_data, tmp_path):
    """A model with an op whose gradient is zero (a Floor) plans over the layers after it; the
    plan and its report name each excluded layer and why."""
    blocked = tiny_cnn(tmp_path / "blocked.onnx", extra_op="Floor")
    result = api.plan(model=blocked, data=tiny_data, out=tmp_path / "p", trials=3, accuracy_steps=10, latency_repeats=2)
    assert result.plan.selection.layers_searched == ["fc"]
    excluded = {e.layer: e.reason for e in result.plan.selection.layers_excluded}
    assert set(excluded) == {"c1", "bn", "c2"} and all("'blocker' (Floor)" in r for r in excluded.values())
    assert [t.layer for t in result.plan.choice.trainable] == ["fc"]
    report = (tmp_path / "p" / "report.md").read_text()
    assert "its path to the output passes node 'blocker' (Floor), whose gradient is zero" in report


def test_selection_policies_never_pick_an_over_budget_trial():
    trials = [_rec(0, 0.99, 900, False), _rec(1, 0.90, 500, True), _rec(2, 0.895, 300, True), _rec(3, 0.5, 100, True)]
    assert select(trials, "memory", 0.01).number == 2
    assert select(trials, "accuracy").number == 1
    assert select(trials, "memory", 0.0).number == 1


def test_the_latency_policy_does_not_choose_on_timing_noise():
    """Two trials as accurate, 0.59 ms and 0.62 ms median, the faster's own spread reaching 0.8 ms:
    they are as fast, and the one of less memory is the plan; a trial slower than that spread is not."""

    def timed(n: int, median: float, p90: float, mem: int) -> TrialRecord:
        return replace(_rec(n, 0.9, mem, True), latency=Latency(median, p90, median * 0.9, p90 * 1.1, 5, 1, "local"))

    trials = [timed(0, 0.59, 0.80, 900), timed(1, 0.62, 0.70, 300)]
    assert select(trials, "latency", 0.01).number == 1
    assert select([timed(0, 0.59, 0.60, 900), timed(1, 0.62, 0.70, 300)], "latency", 0.01).number == 0


def test_over_budget_candidates_are_infeasible_and_never_chosen(tiny_model, tiny_data, tmp_path):
    model = load_model(tiny_model)
    host = tvm.target.Target({"kind": "llvm"})
    small = compile_candidate(model, Candidate((("fc", "bias"),), 4, "sgd", 0.1), BuildOptions(host)).memory.total
    big = compile_candidate(
        model, Candidate(tuple((layer.name, "full") for layer in model.layers), 4, "sgd", 0.1), BuildOptions(host)
    ).memory.total
    budget = (small + big) // 2
    target = tmp_path / "tight.yaml"
    target.write_text(f"tvm_target: {{kind: llvm}}\nram_budget_bytes: {budget}\n")
    space = tmp_path / "space.yaml"
    space.write_text("batch_size: [4, 32]\nlr: {low: 0.05, high: 0.2}\n")
    result = api.plan(
        model=tiny_model,
        data=tiny_data,
        target=str(target),
        space=str(space),
        out=tmp_path / "p",
        trials=8,
        accuracy_steps=20,
        latency_repeats=3,
        policy="accuracy",
    )
    done = [t for t in result.trials if t.complete]
    assert any(t.memory.total > budget for t in done), "the test needs an over-budget trial"
    for t in done:
        assert t.feasible == (t.memory.total <= budget)
    assert result.plan.metrics.peak_memory_bytes.total <= budget
    assert all(p.metrics.peak_memory_bytes.total <= budget for p in result.plan.pareto)


@pytest.mark.slow  # signals to a real study: the fault tier
def test_killed_plan_keeps_finished_trials_and_resumes(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    cmd = [
        sys.executable,
        "-m",
        "planner",
        "plan",
        "--model",
        str(tiny_model),
        "--data",
        str(tiny_data),
        "--out",
        str(out),
        "--trials",
        "7",
        "--accuracy-steps",
        "40",
        "-v",
    ]
    log_path = tmp_path / "first-run.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    url = f"sqlite:///{out / 'study.db'}"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # kill once two trials are reported done
        time.sleep(0.2)
        if sum(line.startswith("trial ") for line in log_path.read_text().splitlines()) >= 2:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, log_path.read_text()
    finished = [t for t in optuna.load_study(study_name="planner", storage=url).get_trials() if t.state.is_finished()]
    assert len(finished) >= 2
    kept = {t.number: t.params for t in finished}

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    trials = optuna.load_study(study_name="planner", storage=url).get_trials()
    by_number = {t.number: t for t in trials}
    for number, params in kept.items():
        assert by_number[number].state.is_finished() and by_number[number].params == params
    # the trial the kill cut short is PRUNED (not counted) and its candidate measured again
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert sum(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL) for t in trials) == 7
    assert read_plan(out).study.n_trials == 7


def test_run_executes_the_plan_and_no_shuffle_is_file_order(tiny_plan, tiny_data, tmp_path):
    from planner.inputs.data import load_dataset
    from planner.runtime.session import TrainingSession

    r1 = api.run(tiny_plan.out, steps=60, out=tmp_path / "a", shuffle=False)
    api.run(tiny_plan.out, steps=60, out=tmp_path / "b", shuffle=False)
    assert r1.after["loss"] < r1.before["loss"]
    with np.load(tmp_path / "a" / "weights.npz") as a, np.load(tmp_path / "b" / "weights.npz") as b:
        wa = {k: a[k] for k in a.files}
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k])
    # file order: step k trains on samples [k*B, (k+1)*B), wrapping around
    plan = read_plan(tiny_plan.out)
    model = load_model(tiny_plan.out / "model.onnx")
    data = load_dataset(tiny_data, model)
    session = TrainingSession(tiny_plan.out / "train_step.so", plan.signature, model.initializers)
    B, n = plan.choice.batch_size, len(data.train)
    for k in range(60):
        idx = np.arange(k * B, (k + 1) * B) % n
        session.step(*data.train.batch(idx))
    for k, v in session.weights().items():
        np.testing.assert_allclose(wa[k], v, rtol=0, atol=1e-6)
    # the fine-tuned ONNX model carries the new weights
    tuned = load_model(tmp_path / "a" / "model.onnx")
    for k, v in tuned.initializers.items():
        np.testing.assert_array_equal(v, wa[k])


def test_no_feasible_plan_says_how_many_trials_failed_and_the_commonest_reason():
    from planner.errors import NoFeasiblePlan
    from planner.types import TrialRecord

    trials = [
        TrialRecord(0, "FAIL", None, fail_reason="TVM compile failed: X"),
        TrialRecord(1, "FAIL", None, fail_reason="linking the step failed: Y"),
        TrialRecord(2, "FAIL", None, fail_reason="TVM compile failed: X"),
        TrialRecord(3, "PRUNED", None, fail_reason="environment: board lost; queued again"),  # not counted
    ]
    with pytest.raises(NoFeasiblePlan) as err:
        select(trials)
    assert str(err.value) == "no feasible plan: 0 of 3 trials completed; 3 failed, 2 of them with: TVM compile failed: X"
