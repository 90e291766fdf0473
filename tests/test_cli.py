"""The CLI's contract: results on stdout (JSON with --json), progress on stderr."""

from __future__ import annotations

import json
import subprocess
import sys


def planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, timeout=600)


def test_plan_and_run_json(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    res = planner("plan", "--model", str(tiny_model), "--data", str(tiny_data), "--out", str(out),
                  "--trials", "2", "--accuracy-steps", "20", "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan == json.loads((out / "plan.json").read_text())
    assert sum(line.startswith("trial ") for line in res.stderr.splitlines()) == 2

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
