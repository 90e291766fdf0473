"""Scale-out: `planner worker` processes join a study `planner plan` created — on one journal file
or a PostgreSQL database — and a trial whose worker was killed is failed and run again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import optuna
import pytest

from planner import api
from planner.errors import BadInput
from planner.search import study as search_study
from planner.search.study import GRACE_ENV, HEARTBEAT_ENV, open_storage

pytestmark = pytest.mark.slow  # plans and workers on journal files, SQLite and PostgreSQL: minutes

State = optuna.trial.TrialState


def _planner(*args: str, env: dict, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    # a session of its own, so a test can kill a process together with any child it started
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "planner", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _on_another_host() -> tuple[str, ...]:
    """A command prefix that runs a process under another hostname (a UTS namespace of its own),
    as a worker on another machine: its pid means nothing here, only its heartbeat tells."""
    prefix = ("unshare", "--uts", "sh", "-c", 'hostname planner-test-elsewhere && exec "$0" "$@"')
    if shutil.which("unshare") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot run a process under another hostname here (unshare --uts needs root)")
    return prefix


def _kill(processes: list[subprocess.Popen]) -> str:
    """SIGKILL what is still running (with its children); returns the last one's stderr."""
    err = ""
    for p in processes:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            err = p.communicate()[1]
    return err


def _study_name() -> str:
    return f"s-{uuid.uuid4().hex[:8]}"  # a database may outlive the test run ($PLANNER_TEST_POSTGRES)


def _env(tmp_path) -> dict:
    return {**os.environ, "PLANNER_CACHE_DIR": str(tmp_path / "cache"), "TVM_NUM_THREADS": "1"}


def _plan_and_two_workers(url: str, model, data, tmp_path) -> None:
    """A `planner plan` and two `planner worker`s share the study at `url`: all its trials are run,
    both workers run some, and no candidate is compiled twice."""
    storage = open_storage(url)  # creates the database's tables before any of the processes does
    name, env = _study_name(), _env(tmp_path)
    plan = _planner(
        "plan",
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(tmp_path / "plan"),
        "--storage",
        url,
        "--study",
        name,
        "--trials",
        "10",
        "--accuracy-steps",
        "20",
        env=env,
    )
    processes = [plan]
    try:
        deadline = time.time() + 120
        while time.time() < deadline and plan.poll() is None:  # the workers join once the plan created the study
            try:
                if "inputs" in optuna.load_study(study_name=name, storage=storage).user_attrs:
                    break
            except Exception:  # not created yet, or caught mid-write
                pass
            time.sleep(0.5)
        processes += [_planner("worker", "--storage", url, "--study", name, "--json", env=env) for _ in range(2)]
        outputs = [p.communicate(timeout=600) for p in processes]
    finally:
        _kill(processes)
    for p, (out, err) in zip(processes, outputs):
        assert p.returncode == 0, err

    trials = optuna.load_study(study_name=name, storage=storage).get_trials()
    finished = [t for t in trials if t.state.is_finished()]
    assert len(finished) >= 10
    assert len({t.user_attrs["worker"] for t in finished}) >= 2, "the workers ran no trial"
    for out, _ in outputs[1:]:  # each worker's --json: what it ran, as the study records it
        said = json.loads(out)
        assert said["finished"] >= 10
        assert said["ran_here"] == sum(t.user_attrs.get("worker") == said["worker"] for t in finished)
    report = json.loads((tmp_path / "plan" / "trials.json").read_text())
    assert len({t["worker"] for t in report}) >= 2, "trials.json should say which process ran each trial"
    compiled = [str(t.user_attrs["candidate"]) for t in finished if t.user_attrs.get("compile_s", 0) > 0]
    assert len(compiled) == len(set(compiled)), "a candidate was compiled twice"
    assert (tmp_path / "plan" / "plan.json").is_file()


def test_a_plan_and_two_workers_share_one_journal_and_compile_nothing_twice(tiny_model, tiny_data, tmp_path):
    _plan_and_two_workers(str(tmp_path / "study.journal"), tiny_model, tiny_data, tmp_path)


def test_a_plan_and_two_workers_share_one_postgresql_database(postgres_url, tiny_model, tiny_data, tmp_path):
    _plan_and_two_workers(postgres_url, tiny_model, tiny_data, tmp_path)


@pytest.fixture(params=["sqlite", "postgresql"])
def rdb_url(request, tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'study.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_url")


@pytest.mark.parametrize("where", ["this host", "another host"])
def test_a_killed_workers_trial_runs_again_with_the_same_parameters(where, rdb_url, tiny_model, tiny_data, tmp_path, monkeypatch):
    """A worker killed mid-trial costs the study no trial. On this host its dead pid tells at
    once: the trial is cut short (PRUNED) and queued again. On another host only its heartbeat
    can: Optuna fails it and runs a copy, and planner counts it as cut short too."""
    prefix = _on_another_host() if where == "another host" else ()
    grace = 3
    monkeypatch.setenv(HEARTBEAT_ENV, "1")  # heartbeats every second, stale after `grace`: here and in the worker
    monkeypatch.setenv(GRACE_ENV, str(grace))
    name, env = _study_name(), _env(tmp_path)

    def plan() -> api.PlanResult:
        return api.plan(
            model=tiny_model,
            data=tiny_data,
            out=tmp_path / "plan",
            trials=1,
            storage=rdb_url,
            study=name,
            accuracy_steps=20,
            cache_dir=tmp_path / "cache",
        )

    plan()
    study = optuna.load_study(study_name=name, storage=open_storage(rdb_url))

    dead: list[optuna.trial.FrozenTrial] = []
    for _ in range(3):  # a trial may finish between seeing it run and the kill: then kill the next one
        worker = _planner("worker", "--storage", rdb_url, "--study", name, "--trials", "100", env=env, prefix=prefix)
        try:
            deadline = time.time() + 120
            while time.time() < deadline and worker.poll() is None:
                # mid-trial: its parameters drawn (the candidate recorded), not yet finished
                if any("candidate" in t.user_attrs for t in study.get_trials(deepcopy=False, states=(State.RUNNING,))):
                    break
                time.sleep(0.05)
        finally:
            err = _kill([worker])  # SIGKILL: no chance to tell the study anything
        stale = study.get_trials(states=(State.RUNNING,))  # (a worker killed between trials leaves one without parameters)
        dead = [t for t in stale if t.params]
        if dead:
            break
    assert len(dead) == 1, f"the worker was never seen mid-trial: {err[-2000:]}"
    (dead,) = dead

    time.sleep(grace + 1.5)  # its heartbeat goes stale
    api.work(storage=rdb_url, study=name, trials=len(stale), cache_dir=tmp_path / "cache")  # fails stale trials before each trial
    trials = study.get_trials()
    if where == "this host":
        assert trials[dead.number].state == State.PRUNED and "died mid-trial" in trials[dead.number].user_attrs["fail_reason"]
    else:
        assert trials[dead.number].state == State.FAIL  # Optuna's doing: planner's records show it cut short
    retries = [t for t in trials if t.user_attrs.get("requeued_from") == dead.number]
    assert len(retries) == 1
    (retry,) = retries
    assert retry.state == State.COMPLETE
    assert retry.params == dead.params
    assert retry.user_attrs["worker"] == search_study.worker()  # this process ran it, before sampling anything new
    assert not [t for t in trials if t.state == State.RUNNING]
    result = plan()  # rerun, the plan reads the study, the dead trial in it, and writes itself again
    # the dead trial is not counted (nor, with two trials at a time, the one that waited beside
    # it to draw a candidate): the plan holds exactly the trials that finished
    requeued = {t.user_attrs.get("requeued_from") for t in trials}
    finished = sum(t.state in (State.COMPLETE, State.FAIL) and t.number not in requeued for t in trials)
    assert result.plan.study.n_trials == finished
    assert [r.state for r in result.trials][dead.number] == "PRUNED"


def test_heartbeat_settings_must_be_whole_seconds_and_the_grace_longer(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    monkeypatch.setenv(HEARTBEAT_ENV, "0.5")
    with pytest.raises(BadInput, match=HEARTBEAT_ENV):
        open_storage(url)
    monkeypatch.setenv(HEARTBEAT_ENV, "5")
    monkeypatch.setenv(GRACE_ENV, "5")
    with pytest.raises(BadInput, match=f"{GRACE_ENV} .* longer"):
        open_storage(url)


def test_a_worker_refuses_a_study_that_does_not_exist(tmp_path):
    with pytest.raises(BadInput, match="no study 'nope'"):
        api.work(storage=str(tmp_path / "empty.journal"), study="nope")


def test_a_worker_on_another_host_killed_with_two_trials_in_flight_blames_neither(tiny_model, tiny_data, tmp_path, monkeypatch):
    """A worker elsewhere runs two trials at a time (`--overlap`) and dies: only the
    heartbeat tells, and it cannot tell which candidate killed the process. Neither uses up its
    crash retry; each runs again alone, where a crash would be its own."""
    prefix = _on_another_host()
    grace = 3
    monkeypatch.setenv(HEARTBEAT_ENV, "1")
    monkeypatch.setenv(GRACE_ENV, str(grace))
    url, name = f"sqlite:///{tmp_path / 'study.db'}", _study_name()
    settings = {"storage": url, "study": name, "accuracy_steps": 3000, "screen_steps": 0, "cache_dir": tmp_path / "cache"}
    api.plan(model=tiny_model, data=tiny_data, out=tmp_path / "plan", trials=1, **settings)
    # the worker's second trial starts compiling while its first fine-tunes 3000 steps: killed there
    env = {**_env(tmp_path), "PLANNER_KILL_AT": "trial-compile@2"}
    worker = _planner("worker", "--storage", url, "--study", name, "--trials", "3", "--overlap", env=env, prefix=prefix)
    try:
        _, err = worker.communicate(timeout=300)
    finally:
        _kill([worker])
    assert worker.returncode == -signal.SIGKILL, err[-2000:]
    study = optuna.load_study(study_name=name, storage=open_storage(url))
    dead = [t for t in study.get_trials(states=(State.RUNNING,)) if t.params]
    assert len(dead) == 2, [(t.number, t.state.name) for t in study.get_trials()]

    time.sleep(grace + 1.5)  # their heartbeats go stale
    records = api.work(storage=url, study=name, trials=2, cache_dir=tmp_path / "cache")
    trials = study.get_trials()
    for t in dead:
        assert trials[t.number].state == State.FAIL  # Optuna's doing; planner counts it cut short:
        assert records[t.number].state == "PRUNED" and "beside another trial" in records[t.number].fail_reason
        (copy,) = [u for u in trials if u.user_attrs.get("requeued_from") == t.number]
        assert copy.state == State.COMPLETE and copy.params == t.params
        assert copy.user_attrs["alone"] and copy.user_attrs["retries"] == 0
        assert copy.user_attrs["worker"] == search_study.worker()
    assert not [t for t in trials if t.state == State.RUNNING]
