"""The CLI's contract: results on stdout (JSON with --json), progress on stderr."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from planner.plans.directory import read_plan
from processes import PLANNED, planner


def test_plan_and_run_json(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    res = planner(
        "plan",
        "--model",
        str(tiny_model),
        "--data",
        str(tiny_data),
        "--out",
        str(out),
        "--trials",
        "2",
        "--accuracy-steps",
        "20",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan == json.loads((out / "plan.json").read_text())
    assert res.stderr == "", "not a terminal and no -v: no progress on stderr"

    res = planner("run", str(out), "--steps", "30", "--json", "--out", str(tmp_path / "ft"))
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["steps"] == 30
    assert set(report["before"]) == set(report["after"]) == {"loss", "accuracy"}
    assert (tmp_path / "ft" / "weights.npz").is_file() and (tmp_path / "ft" / "model.onnx").is_file()
    # the run's own step time and memory, beside the plan's
    check, metrics = report["check"], plan["metrics"]
    assert check["steps_timed"] == 30 and 0 < check["step_ms_p10"] <= check["step_ms"] <= check["step_ms_p90"]
    assert check["planned_step_ms"] == metrics["step_latency_ms"]["median"]
    assert check["planned_memory_bytes"] == metrics["peak_memory_bytes"]["total"]
    assert check["memory_bytes"] > metrics["peak_memory_bytes"]["activations"], check  # (the C heap one step gains, and more)
    assert [f"warning: {w}" for w in check["warnings"]] == res.stderr.splitlines()


def test_a_step_slower_than_planned_is_a_one_line_warning_beside_the_figures(tiny_model, tiny_data, tmp_path):
    """A step made 3 ms slower than the plan measured it (a wait inside the timed step,
    `PLANNER_DELAY_AT`): the run measures it and says so in one line."""
    out = tmp_path / "p"
    res = planner("plan", "--model", tiny_model, "--data", tiny_data, "--out", out, "--trials", "1", "--accuracy-steps", "20")
    assert res.returncode in PLANNED, res.stderr
    res = planner("run", out, "--steps", "20", "--out", tmp_path / "ft", env={"PLANNER_DELAY_AT": "step:3"})
    assert res.returncode == 0, res.stderr
    (warning,) = [line for line in res.stderr.splitlines() if line.startswith("warning: the step took")]
    assert "above the plan's" in warning
    (line,) = [line for line in res.stdout.splitlines() if line.startswith("step ")]
    assert "ms measured (median of 20" in line and "ms planned; memory" in line
    measured = float(line.split()[1])
    assert measured >= 3.0


def test_help_teaches_defaults():
    res = planner("plan", "--help")
    assert res.returncode == 0
    for flag in ("--trials", "--select", "--accuracy-tolerance", "--storage", "--study", "--timeout", "--seed"):
        assert flag in res.stdout


def test_verbose_prints_each_trial_and_the_debug_log(tiny_model, tiny_data, tmp_path):
    res = planner(
        "plan",
        "--model",
        str(tiny_model),
        "--data",
        str(tiny_data),
        "--out",
        str(tmp_path / "p"),
        "--trials",
        "2",
        "--accuracy-steps",
        "20",
        "-v",
    )
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert sum(line.startswith("trial ") for line in lines) == 2
    assert any("DEBUG planner.search.evaluate" in line and "fine-tuned 20 steps" in line for line in lines)


@pytest.mark.slow  # signals to a real study: the fault tier
def test_ctrl_c_finishes_the_trial_in_flight_and_writes_the_plan(tiny_model, tiny_data, tmp_path):
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
        "8",
        "--accuracy-steps",
        "20",
        "-v",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # interrupt once two trials are in
        seen.append(line)
        if sum(s.startswith("trial ") for s in seen) == 2:
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=300)
    lines = seen + err.splitlines(keepends=True)
    assert proc.returncode == 130, "".join(lines)
    assert lines[-1].startswith(f"interrupted: plan written to {out}/ from the ")
    assert "plan written to" in rest  # the summary of what was written, on stdout
    finished = read_plan(out).study.n_trials
    assert 2 <= finished < 8, "the study should stop after the trial in flight"
    assert not list(out.glob(".staged-*")) and not (out / ".planner-commit").exists(), "no half-written plan left behind"

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert read_plan(out).study.n_trials == 8
    assert sum(s.startswith("trial ") for s in rerun.stderr.splitlines()) == 8 - finished


@pytest.mark.slow  # signals to a real study: the fault tier
def test_a_trial_whose_linker_the_ctrl_c_killed_is_measured_again_on_resume(tiny_model, tiny_data, tmp_path):
    """A terminal's Ctrl-C reaches every process of the group: here the linker of the first
    trial dies of it (a wrapper around g++ that interrupts planner, as the terminal would, then
    fails). That failure must not be held against the candidate."""
    mark = tmp_path / "interrupted-once"
    cxx = tmp_path / "g++-ctrl-c"
    cxx.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *-shared*) if [ ! -e {mark} ]; then touch {mark}; kill -INT $PPID; sleep 1; exit 130; fi;; esac\n'
        'exec g++ "$@"\n'
    )
    cxx.chmod(0o755)
    target = tmp_path / "host-wrapped.yaml"
    target.write_text(f"tvm_target: {{kind: llvm}}\nram_budget_bytes: 512MiB\ntoolchain: {cxx}\n")
    out = tmp_path / "p"
    cmd = [
        "plan",
        "--model",
        str(tiny_model),
        "--data",
        str(tiny_data),
        "--target",
        str(target),
        "--out",
        str(out),
        "--trials",
        "3",
        "--accuracy-steps",
        "20",
        "--no-overlap",  # one trial in flight: the one the Ctrl-C cuts short
        "-v",
    ]
    env_cache = {"PLANNER_CACHE_DIR": str(tmp_path / "cache")}  # cold: the first trial links
    first = planner(*cmd, env=env_cache)
    assert mark.exists() and first.returncode == 130, first.stderr
    assert (
        "cut short: interrupted mid-trial; queued again" in first.stderr
        and "no feasible trial among the 0 finished" in first.stderr
    )

    second = planner(*cmd, env=env_cache)
    assert second.returncode == 0, second.stderr
    trials = json.loads((out / "trials.json").read_text())
    assert [t["state"] for t in trials].count("PRUNED") == 1
    cut = next(t for t in trials if t["state"] == "PRUNED")
    again = [t for t in trials if t["state"] == "COMPLETE" and t["candidate"] == cut["candidate"]]
    assert len(again) == 1, "the interrupted candidate should have been measured on resume"
    assert sum(t["state"] == "COMPLETE" for t in trials) == 3


def test_inspect_never_cuts_a_layer_name_short(tiny_model, tmp_path):
    """A PyTorch module path can be longer than the terminal is wide: the text table keeps every
    name whole, on one line, so it can be pasted into a scheme."""
    import onnx

    proto = onnx.load(tiny_model)
    long = "features.12.block.3.squeeze_excitation.fc2.projection"
    renamed = {}
    for init in proto.graph.initializer:
        if init.name.startswith("c1"):
            renamed[init.name] = f"{long}.{'weight' if init.name.endswith('.w') else 'bias'}"
            init.name = renamed[init.name]
    for node in proto.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    path = tmp_path / "long.onnx"
    onnx.save(proto, path)
    res = planner("inspect", path, env={"COLUMNS": "60"})
    assert res.returncode == 0, res.stderr
    assert any(long in line for line in res.stdout.splitlines()), res.stdout
