"""The CLI's contract: results on stdout (JSON with --json), progress on stderr."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from planner.plan import read_plan


def planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, timeout=600)


def test_plan_and_run_json(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    res = planner("plan", "--model", str(tiny_model), "--data", str(tiny_data), "--out", str(out),
                  "--trials", "2", "--accuracy-steps", "20", "--json")
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


def test_help_teaches_defaults():
    res = planner("plan", "--help")
    assert res.returncode == 0
    for flag in ("--trials", "--select", "--accuracy-tolerance", "--storage", "--study", "--timeout", "--seed"):
        assert flag in res.stdout


def test_verbose_prints_each_trial_and_the_debug_log(tiny_model, tiny_data, tmp_path):
    res = planner("plan", "--model", str(tiny_model), "--data", str(tiny_data), "--out", str(tmp_path / "p"),
                  "--trials", "2", "--accuracy-steps", "20", "-v")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert sum(line.startswith("trial ") for line in lines) == 2
    assert any("DEBUG planner.evaluate" in line and "fine-tuned 20 steps" in line for line in lines)


def test_ctrl_c_finishes_the_trial_in_flight_and_writes_the_plan(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    cmd = [sys.executable, "-m", "planner", "plan", "--model", str(tiny_model), "--data", str(tiny_data),
           "--out", str(out), "--trials", "8", "--accuracy-steps", "20", "-v"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # interrupt once two trials are in
        seen.append(line)
        if sum(s.startswith("trial ") for s in seen) == 2:
            proc.send_signal(signal.SIGINT)
            break
    rest, err = proc.communicate(timeout=300)
    lines = (seen + err.splitlines(keepends=True))
    assert proc.returncode == 130, "".join(lines)
    assert lines[-1].startswith(f"interrupted: plan written to {out}/ from the ")
    assert "plan written to" in rest  # the summary of what was written, on stdout
    finished = read_plan(out).study["n_trials"]
    assert 2 <= finished < 8, "the study should stop after the trial in flight"
    assert not list(out.glob(".plan-*")), "no half-written plan left behind"

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert read_plan(out).study["n_trials"] == 8
    assert sum(s.startswith("trial ") for s in rerun.stderr.splitlines()) == 8 - finished
