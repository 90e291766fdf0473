"""Scale-out: `planner worker` processes join a study `planner plan` created, on one journal file."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import optuna
import pytest

from planner import api
from planner.errors import BadInput
from planner.search import open_storage


def _planner(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "planner", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_plan_and_two_workers_share_one_journal_and_compile_nothing_twice(tiny_model, tiny_data, tmp_path):
    journal = str(tmp_path / "study.journal")
    env = {**os.environ, "PLANNER_CACHE_DIR": str(tmp_path / "cache"), "TVM_NUM_THREADS": "1"}
    plan = _planner("plan", "--model", str(tiny_model), "--data", str(tiny_data), "--out", str(tmp_path / "plan"),
                    "--storage", journal, "--study", "s", "--trials", "10", "--accuracy-steps", "20", env=env)
    deadline = time.time() + 120
    while time.time() < deadline:  # the workers join once the plan has created the study
        try:
            if "inputs" in optuna.load_study(study_name="s", storage=open_storage(journal)).user_attrs:
                break
        except Exception:
            pass
        time.sleep(0.5)
    workers = [_planner("worker", "--storage", journal, "--study", "s", env=env) for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in (plan, *workers)]
    for p, (out, err) in zip((plan, *workers), outputs):
        assert p.returncode == 0, err

    trials = optuna.load_study(study_name="s", storage=open_storage(journal)).get_trials()
    finished = [t for t in trials if t.state.is_finished()]
    assert len(finished) >= 10
    assert len({t.user_attrs["worker"] for t in finished}) >= 2, "the workers ran no trial"
    compiled = [str(t.user_attrs["candidate"]) for t in finished if t.user_attrs.get("compile_s", 0) > 0]
    assert len(compiled) == len(set(compiled)), "a candidate was compiled twice"
    assert (tmp_path / "plan" / "plan.json").is_file()


def test_a_worker_refuses_a_study_that_does_not_exist(tmp_path):
    with pytest.raises(BadInput, match="no study 'nope'"):
        api.work(str(tmp_path / "empty.journal"), "nope")
