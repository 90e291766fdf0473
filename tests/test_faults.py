"""Fault injection through the real CLI: kill -9 at each phase, corrupt caches, swapped plan files,
stale and concurrent state, signals, and the leaked-secret grep over every output.

The guarantees under test (README, "Reliability"): a failure that is not the candidate's never
counts as a finished trial, and a rerun measures exactly the missing ones; nothing planner loads
from disk is trusted unchecked; a plan or a run's output is the old one whole or the new one
complete, whatever instant the process dies; no storage password is printed or written.

Kill points are named in `planner.faults` (`PLANNER_KILL_AT=POINT[@N]`): the process sends
itself SIGKILL there, the way an OOM killer or a power cut would.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import optuna
import pytest
from onnx import numpy_helper

from builders import write_plan_json
from planner.digest import file_sha256
from planner.plans.directory import COMMIT, MARKER, STAGED_PREFIX, read_plan, reading, replace_files
from planner.search.study import NOT_BEGUN
from planner.search.urls import redact, scrubbed
from processes import PLANNED, planner

pytestmark = pytest.mark.slow  # every kill point and fault through the real CLI: minutes

TRIALS = 3


def plan_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["plan", "--model", str(model), "--data", str(data), "--out", str(out), "--accuracy-steps", "20", *extra]


def one_error_line(res: subprocess.CompletedProcess, code: int, words: str) -> str:
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert "Traceback" not in res.stderr
    assert lines and lines[-1].startswith("error: ") and words in lines[-1], res.stderr
    return lines[-1]


def study_trials(out: Path) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="planner", storage=f"sqlite:///{out / 'study.db'}").get_trials()


def counted(trials) -> int:
    return sum(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL) for t in trials)


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith((STAGED_PREFIX, COMMIT)))


# --- kill -9 during a trial: the rerun measures exactly the missing trials -------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["one-trial", "overlap"])
@pytest.mark.parametrize("phase", ["trial-compile", "trial-measure", "trial-accuracy"])
def test_kill_9_mid_trial_then_an_immediate_rerun_measures_exactly_the_missing_trials(
    phase, overlap, tiny_model, tiny_data, tmp_path
):
    out = tmp_path / "p"
    args = plan_args(tiny_model, tiny_data, out, "--trials", str(TRIALS), "--overlap" if overlap else "--no-overlap")
    killed = planner(*args, env={"PLANNER_KILL_AT": f"{phase}@2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    before = study_trials(out)
    # mid-trial: its candidate drawn (a trial killed while drawing one is only ended)
    dead = [t for t in before if t.state == optuna.trial.TrialState.RUNNING and "candidate" in t.user_attrs]
    if overlap:  # trial 1 died mid-way, trial 0 maybe with it (its fine-tune beside trial 1's compile)
        assert 1 in [t.number for t in dead] and {t.number for t in dead} <= {0, 1, 2} and counted(before) <= 1
    else:  # trial 0 finished, trial 1 died mid-way
        assert [t.number for t in dead] == [1] and counted(before) == 1

    rerun = planner(*args)  # at once: no heartbeat grace
    assert rerun.returncode in PLANNED, rerun.stderr
    after = study_trials(out)
    assert not [t for t in after if t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL)]
    assert counted(after) == TRIALS
    for d in dead:
        assert (
            after[d.number].state == optuna.trial.TrialState.PRUNED
            and "died mid-trial" in after[d.number].user_attrs["fail_reason"]
        )
        again = [t for t in after if t.user_attrs.get("requeued_from") == d.number]
        assert len(again) == 1 and again[0].state.is_finished() and again[0].params == d.params
        assert again[0].user_attrs["alone"] == (len(dead) > 1)  # two in flight: neither blamed, each alone
    assert read_plan(out).study.n_trials == TRIALS


def test_a_candidate_that_kills_its_process_twice_is_failed_not_retried_forever(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    args = plan_args(tiny_model, tiny_data, out, "--trials", "2")
    for _ in range(2):  # the first measurement of each run: trial 0, then its queued copy
        assert planner(*args, env={"PLANNER_KILL_AT": "trial-measure"}).returncode == -signal.SIGKILL
    final = planner(*args)
    assert final.returncode in PLANNED, final.stderr
    trials = study_trials(out)
    # (beside trial 0, the next trial waited for its turn to draw a candidate: only ended)
    first, (copy,) = trials[0], [t for t in trials if t.user_attrs.get("requeued_from") == 0]
    assert first.state == optuna.trial.TrialState.PRUNED and not copy.user_attrs["alone"]
    assert copy.state == optuna.trial.TrialState.FAIL and "again" in copy.user_attrs["fail_reason"]
    assert not [t for t in trials if t.user_attrs.get("requeued_from") == copy.number]
    assert counted(trials) == 2


def test_with_overlap_a_kill_blames_neither_trial_in_flight_and_both_run_again_alone(tiny_model, tiny_data, tmp_path):
    """Two trials in flight when the process dies: either candidate may have killed it. Neither uses
    up its crash retry; each is queued to run alone, where a crash would be its own."""
    out = tmp_path / "p"
    args = plan_args(tiny_model, tiny_data, out, "--trials", "3", "--accuracy-steps", "3000", "--screen-steps", "0", "--overlap")
    # trial 1 starts compiling while trial 0 fine-tunes its 3000 steps
    killed = planner(*args, env={"PLANNER_KILL_AT": "trial-compile@2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    final = planner(*args)
    assert final.returncode in PLANNED, final.stderr
    trials = study_trials(out)
    cut = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED and t.params]
    assert sorted(t.number for t in cut) == [0, 1]
    assert all("beside another trial" in t.user_attrs["fail_reason"] for t in cut)
    for t in cut:
        (copy,) = [u for u in trials if u.user_attrs.get("requeued_from") == t.number]
        assert copy.state == optuna.trial.TrialState.COMPLETE and copy.params == t.params
        assert copy.user_attrs["alone"] and copy.user_attrs["retries"] == 0
    assert not [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    assert counted(trials) == 3


# --- kill -9 while the plan directory is written: the old plan whole, or the new one complete -----


@pytest.mark.parametrize("point, new", [("write-staged", False), ("write-committed", True), ("write-renaming@2", True)])
def test_kill_9_while_writing_the_plan_leaves_the_old_plan_or_the_new_one(point, new, tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    assert planner(*plan_args(tiny_model, tiny_data, out, "--trials", "1")).returncode in PLANNED
    killed = planner(*plan_args(tiny_model, tiny_data, out, "--trials", "2"), env={"PLANNER_KILL_AT": point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    plan = read_plan(out)  # finishes a committed write; verifies every file against its sha256
    assert plan.study.n_trials == (2 if new else 1)
    assert leftovers(out) == []
    trials = json.loads((out / "trials.json").read_text())
    assert len([t for t in trials if t["state"] in ("COMPLETE", "FAIL")]) == plan.study.n_trials


def test_staged_files_of_a_killed_write_are_removed_by_the_next_run(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    assert (
        planner(*plan_args(tiny_model, tiny_data, out, "--trials", "1"), env={"PLANNER_KILL_AT": "write-staged"}).returncode == -9
    )
    assert [p for p in out.iterdir() if p.name.startswith(STAGED_PREFIX)]
    assert not (out / "plan.json").exists()  # never committed: no plan at all, not half of one
    assert planner(*plan_args(tiny_model, tiny_data, out, "--trials", "1")).returncode in PLANNED
    assert leftovers(out) == [] and read_plan(out).study.n_trials == 1


# --- kill -9 during `planner run` -----------------------------------------------------------------


@pytest.fixture(scope="module")
def a_plan(tiny_model, tiny_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "plan"
    res = planner(*plan_args(tiny_model, tiny_data, out, "--trials", "2"))
    assert res.returncode in PLANNED, res.stderr
    return out


def _pair(out: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    with np.load(out / "weights.npz") as npz:
        weights = {k: npz[k] for k in npz.files}
    model = {t.name: numpy_helper.to_array(t) for t in onnx.load(out / "model.onnx").graph.initializer if t.name in weights}
    return weights, model


@pytest.mark.parametrize("point", ["write-staged", "write-committed", "write-renaming"])
def test_kill_9_while_run_writes_keeps_a_consistent_weights_and_model_pair(point, a_plan, tmp_path):
    out = tmp_path / "ft"
    assert planner("run", str(a_plan), "--steps", "5", "--out", str(out)).returncode == 0
    old, _ = _pair(out)
    killed = planner("run", str(a_plan), "--steps", "30", "--out", str(out), env={"PLANNER_KILL_AT": point})
    assert killed.returncode == -signal.SIGKILL
    assert (out / "weights.npz").stat().st_size > 0
    with reading(out):  # what the next planner command on OUT does first
        pass
    weights, model = _pair(out)
    assert weights.keys() == model.keys()
    for name in weights:  # the weights and the model are of the same run
        np.testing.assert_array_equal(weights[name], model[name])
    changed = any(not np.array_equal(weights[k], old[k]) for k in old)
    assert changed == (point != "write-staged")
    assert leftovers(out) == []


def test_run_refuses_its_own_plan_as_out_and_foreign_or_full_directories(a_plan, tmp_path):
    before = file_sha256(a_plan / "weights.npz")
    one_error_line(planner("run", str(a_plan), "--steps", "5", "--out", str(a_plan)), 2, "is the plan directory")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.onnx").write_text("my model\n")
    one_error_line(planner("run", str(a_plan), "--steps", "5", "--out", str(mine)), 2, "holds files planner did not write")
    assert (mine / "model.onnx").read_text() == "my model\n"
    assert file_sha256(a_plan / "weights.npz") == before


def test_run_on_a_full_disk_is_one_line_before_training(a_plan, tmpfs):
    disk = tmpfs("size=64k")
    if disk is None:
        pytest.skip("needs a tmpfs mount (root)")
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)  # another program filled the disk
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    res = planner("run", str(a_plan), "--steps", "5", "--out", str(disk / "ft"))
    one_error_line(res, 2, "bytes free, it needs about")
    assert not (disk / "ft").exists()


# --- untrusted files in a plan directory: checked before anything is loaded ------------------------


def _copy(plan: Path, tmp: Path) -> Path:
    dst = tmp / "copy"
    shutil.copytree(plan, dst)
    return dst


def _rehash(plan: Path, name: str) -> None:
    """Make plan.json agree with an edited file, as a careless (or hostile) hand edit would."""
    data = json.loads((plan / "plan.json").read_text())
    data["files"][name] = file_sha256(plan / name)
    write_plan_json(plan, data)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _planted_library(path: Path, marker: Path) -> None:
    """A shared library whose constructor runs at load: proof of code that ran unchecked."""
    src = path.with_suffix(".c")
    src.write_text(
        f'#include <stdio.h>\n__attribute__((constructor)) static void f(void) {{ FILE *m = fopen("{marker}", "w"); if (m) fclose(m); }}\n'
    )
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), str(src)], check=True)
    src.unlink()


SWAPS = {  # case -> (the file changed, how)
    "truncated train_step.so": ("train_step.so", lambda p, tmp: _truncate(p / "train_step.so")),
    "another plan's train_step.so": (
        "train_step.so",
        lambda p, tmp: shutil.copyfile(tmp / "other" / "train_step.so", p / "train_step.so"),
    ),
    "a library with a constructor": ("train_step.so", lambda p, tmp: _planted_library(p / "train_step.so", tmp / "ran")),
    "truncated weights.npz": ("weights.npz", lambda p, tmp: _truncate(p / "weights.npz")),
    "edited model.onnx": ("model.onnx", lambda p, tmp: (p / "model.onnx").write_bytes((p / "model.onnx").read_bytes() + b"\0")),
}


@pytest.fixture(scope="module")
def other_plan(a_plan, tiny_model, tiny_data):
    """A second plan of the same model whose step differs (its updates copied, not in place) but has
    the same signature. (Another lr alone would not do: the rate is an input, the library the same.)"""
    scheme = a_plan.parent / "lr05.yaml"
    choice = read_plan(a_plan).choice
    layers = "\n".join(
        f"  - {{layer: {t.layer}, mode: {t.update_mode.kind}"
        + (f", {t.update_mode.spec.argument.name}: {t.update_mode.value}" if t.update_mode.spec.argument else "")
        + "}"
        for t in choice.trainable
    )
    scheme.write_text(
        f"trainable:\n{layers}\nbatch_size: {choice.batch_size}\noptimizer: {{name: {choice.optimizer.name}, lr: 0.5}}\n"
        "updates: copy\n"
    )
    other = a_plan.parent / "other"
    res = planner(
        "measure",
        str(tiny_model),
        "--scheme",
        str(scheme),
        "--data",
        str(tiny_data),
        "--out",
        str(other),
        "--accuracy-steps",
        "5",
    )
    assert res.returncode == 0, res.stderr
    return other


@pytest.mark.parametrize(
    "swap, command",
    [
        *((swap, "run") for swap in SWAPS),
        ("another plan's train_step.so", "compile"),  # compile reads the plan through the same check
        ("edited model.onnx", "compile"),
    ],
)
def test_a_changed_plan_file_is_refused_before_anything_loads(swap, command, a_plan, other_plan, tmp_path):
    plan = _copy(a_plan, tmp_path)
    shutil.copytree(other_plan, tmp_path / "other")
    name, change = SWAPS[swap]
    change(plan, tmp_path)
    args = (
        ["run", str(plan), "--steps", "5", "--out", str(tmp_path / "ft")]
        if command == "run"
        else ["compile", str(plan), "--target", "host", "--out", str(tmp_path / "re")]
    )
    line = one_error_line(planner(*args), 2, "is not the file this plan was written with")
    assert name in line
    assert not (tmp_path / "ran").exists(), "the planted library's constructor ran"
    assert not (tmp_path / "ft").exists() and not (tmp_path / "re").exists()


def _edit_plan_json(plan: Path, edit: str) -> None:
    raw = json.loads((plan / "plan.json").read_text())
    if edit == "learning rate":
        raw["choice"]["optimizer"]["lr"] *= 2
    elif edit == "a trainable layer removed":
        raw["choice"]["trainable"] = raw["choice"]["trainable"][:-1]
    elif edit == "a figure":
        raw["metrics"]["accuracy"]["after"] = 1.0
    (plan / "plan.json").write_text(json.dumps(raw, indent=2 if edit != "re-indented" else 4, sort_keys=edit == "re-indented"))


@pytest.mark.parametrize("edit", ["learning rate", "a trainable layer removed", "a figure", "re-indented"])
def test_a_plan_json_edited_by_hand_is_refused_but_its_layout_is_free(edit, a_plan, tmp_path):
    """plan.json records what was measured: another lr or layer set would train unlike the plan's
    figures. Its own content is checked like every file it names; its layout is not content."""
    plan = _copy(a_plan, tmp_path)
    _edit_plan_json(plan, edit)
    res = planner("run", str(plan), "--steps", "5", "--out", str(tmp_path / "ft"))
    if edit == "re-indented":
        assert res.returncode == 0, res.stderr
        return
    one_error_line(res, 2, "plan.json was changed since it was written")
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize(
    "edit, words", [("float64", "is float64"), ("wrong shape", "the model needs"), ("missing weight", "lacks")]
)
def test_weights_that_do_not_fit_the_model_are_one_line_even_with_a_matching_hash(edit, words, a_plan, tmp_path):
    plan = _copy(a_plan, tmp_path)
    with np.load(plan / "weights.npz") as npz:
        weights = {k: npz[k] for k in npz.files}
    first = next(iter(weights))
    if edit == "float64":
        weights[first] = weights[first].astype(np.float64)
    elif edit == "wrong shape":
        weights[first] = weights[first][..., :1]
    else:
        del weights[first]
    np.savez(plan / "weights.npz", **weights)
    _rehash(plan, "weights.npz")
    one_error_line(planner("run", str(plan), "--steps", "5", "--out", str(tmp_path / "ft")), 2, words)


# --- corrupt caches: a bad entry is a miss, rebuilt -----------------------------------------------


def test_corrupt_cache_entries_are_rebuilt_not_loaded(tiny_model, tiny_data, tmp_path):
    cache = tmp_path / "cache"
    env = {"PLANNER_CACHE_DIR": str(cache)}
    first = planner(*plan_args(tiny_model, tiny_data, tmp_path / "a", "--trials", "2", "--json"), env=env)
    assert first.returncode in PLANNED, first.stderr
    accuracy = json.loads(first.stdout)["metrics"]["accuracy"]["after"]
    for lib in cache.glob("steps/*/train_step.so"):
        _truncate(lib)  # loading one would SIGBUS the process
    for obj in cache.glob("kernels/*/*.o"):
        _truncate(obj)
    for entry in cache.glob("accuracy/*.json"):  # only the value: the entry stays well-formed
        edited = re.sub(r'"after": [0-9.e-]+', '"after": 0.99', entry.read_text())
        assert edited != entry.read_text()
        entry.write_text(edited)
    again = planner(*plan_args(tiny_model, tiny_data, tmp_path / "b", "--trials", "2", "--json"), env=env)
    assert again.returncode in PLANNED, again.stderr
    assert json.loads(again.stdout)["metrics"]["accuracy"]["after"] == accuracy
    run = planner("run", str(tmp_path / "b"), "--steps", "5", "--out", str(tmp_path / "ft"))
    assert run.returncode == 0, run.stderr


# --- stale and concurrent state -------------------------------------------------------------------


def test_a_second_plan_on_the_same_out_is_refused_while_the_first_runs(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    out.mkdir()
    (out / MARKER).write_text('{"kind": "plan", "written_by": "planner"}\n')
    with open(out / MARKER) as held:  # the lock a running `planner plan` holds
        fcntl.flock(held, fcntl.LOCK_EX)
        res = planner(*plan_args(tiny_model, tiny_data, out, "--trials", "1"))
    one_error_line(res, 2, f"another planner process is writing into {out}")
    assert not (out / "study.db").exists()


def test_two_plans_started_together_on_one_new_out_never_race(tiny_model, tiny_data, tmp_path):
    """Both create the directory, its marker and (the winner) the study database; the loser is
    refused with one line, never "UNIQUE constraint failed: alembic_version" or a traceback."""
    out = tmp_path / "p"
    args = [sys.executable, "-m", "planner", *plan_args(tiny_model, tiny_data, out, "--trials", "1")]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert all("Traceback" not in err and "UNIQUE" not in err for _, err in results), results
    planned = [code for code, _ in results if code in PLANNED]
    assert planned, results
    if len(planned) == 1:  # (both succeed only when the first finished before the second began)
        code, loser = next((code, err) for code, err in results if code not in PLANNED)
        assert code == 2 and f"another planner process is writing into {out}" in loser, results
    assert read_plan(out).study.n_trials == 1


def test_a_dead_trial_in_a_journal_file_is_recovered_too(tiny_model, tiny_data, tmp_path):
    """A journal file has no heartbeats: the dead process's pid is what tells."""
    out, journal = tmp_path / "p", tmp_path / "study.journal"
    args = plan_args(tiny_model, tiny_data, out, "--trials", "2", "--storage", str(journal))
    assert planner(*args, env={"PLANNER_KILL_AT": "trial-accuracy@2"}).returncode == -signal.SIGKILL
    rerun = planner(*args)
    assert rerun.returncode in PLANNED, rerun.stderr
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    trials = optuna.load_study(study_name="planner", storage=storage).get_trials()
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert counted(trials) == 2 and [t.state for t in trials].count(optuna.trial.TrialState.PRUNED) == 1


def test_a_resume_with_another_seed_records_each_trials_own_seed(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    assert planner(*plan_args(tiny_model, tiny_data, out, "--trials", "2", "--seed", "0")).returncode in PLANNED
    res = planner(*plan_args(tiny_model, tiny_data, out, "--trials", "3", "--seed", "7"))
    assert res.returncode in PLANNED, res.stderr
    assert "warning: resuming study 'planner' (begun with seed 0): its 2 finished trials keep their seeds" in res.stderr
    trials = json.loads((out / "trials.json").read_text())
    assert [t["seed"] for t in trials] == [0, 0, 7]
    # a study that already holds its trials runs none: the seed would change nothing, and it says so
    again = planner(*plan_args(tiny_model, tiny_data, out, "--trials", "3", "--seed", "9"))
    assert again.returncode in PLANNED, again.stderr
    assert "seed 9 changes nothing; raise --trials to run more with it" in again.stderr
    plan = read_plan(out)
    assert f"(seed {trials[plan.selection.trial]['seed']})" in plan.measurement.accuracy


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "planner", *args, "-v"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for(proc: subprocess.Popen, words: str, times: int = 1) -> list[str]:
    """stderr lines (planner's -v log) up to the `times`-th holding `words`."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if sum(words in s for s in seen) >= times:
            return seen
    raise AssertionError(f"the process ended before {words!r} x{times}: {''.join(seen)}")


def test_sigterm_stops_like_ctrl_c_with_a_plan_and_no_trial_left_running(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    proc = _start(plan_args(tiny_model, tiny_data, out, "--trials", "40", "--accuracy-steps", "200"))
    _wait_for(proc, "trial ")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "SIGTERM: stopping after the trials in flight" in err
    trials = study_trials(out)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert read_plan(out).study.n_trials == counted(trials) < 40


@pytest.mark.parametrize("overlap", [False, True], ids=["one-trial", "overlap"])
def test_ctrl_c_twice_cuts_the_trial_short_and_the_rerun_measures_it(tiny_model, tiny_data, tmp_path, overlap):
    out = tmp_path / "p"
    # no screening: every fine-tune is the full one (about 3 s here) the two signals must land in
    args = plan_args(
        tiny_model,
        tiny_data,
        out,
        "--trials",
        "3",
        "--accuracy-steps",
        "6000",
        "--screen-steps",
        "0",
        # another seed with --overlap: candidates the other case (in the same cache) fine-tuned
        # fully on its rerun would be accuracy cache hits, done before the signals land
        *(["--overlap", "--seed", "1"] if overlap else ["--no-overlap"]),
    )
    proc = _start(args)
    _wait_for(proc, "ms median on", times=2)  # trial 1 is measured: its long fine-tune begins (seconds)
    proc.send_signal(signal.SIGINT)
    _wait_for(proc, "stopping after the trials in flight")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    # with overlap, trial 2 is cut too: mid-trial (compiled on the second core, waiting to be
    # timed), or before it began (still waiting its turn to be drawn: no candidate to measure again)
    pruned = [t for t in study_trials(out) if t.state == optuna.trial.TrialState.PRUNED]
    cut = [t for t in pruned if t.params]
    states = [(t.number, t.state.name, t.user_attrs.get("fail_reason")) for t in study_trials(out)]
    assert 1 in [t.number for t in cut] and {t.number for t in pruned} <= ({1, 2} if overlap else {1}), states
    assert all("interrupted mid-trial" in t.user_attrs["fail_reason"] for t in cut)
    assert all(t.user_attrs["fail_reason"] == NOT_BEGUN for t in pruned if not t.params)
    rerun = planner(*args)
    assert rerun.returncode in PLANNED, rerun.stderr
    trials = study_trials(out)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert not [t for t in trials if t.state == optuna.trial.TrialState.FAIL and not t.user_attrs.get("fail_reason")]
    assert counted(trials) == 3
    for t in cut:  # every candidate cut short was measured by the rerun
        assert any(u.user_attrs.get("requeued_from") == t.number and u.state.is_finished() for u in trials)


def test_a_reader_holds_off_a_writer_until_it_has_loaded(tmp_path):
    """`run` verifies the files and then loads them: no `plan --out` may replace them between."""
    out = tmp_path / "d"
    out.mkdir()
    (out / MARKER).write_text('{"kind": "plan", "written_by": "planner"}\n')
    (out / "a.txt").write_text("old")
    done = threading.Event()
    writer = threading.Thread(target=lambda: (replace_files(out, lambda d: (d / "a.txt").write_text("new")), done.set()))
    with reading(out):
        writer.start()
        assert not done.wait(1.0), "the writer replaced files under a reader"
        assert (out / "a.txt").read_text() == "old"
    writer.join(30)
    assert done.is_set() and (out / "a.txt").read_text() == "new"


@pytest.mark.parametrize(
    "record",
    [
        {"staged": ".staged-x", "files": ["../victim.txt"], "remove": []},
        {"staged": ".staged-x", "files": [], "remove": ["../victim.txt"]},
        {"staged": ".staged-x/../..", "files": ["victim.txt"], "remove": []},
        {"staged": ".staged-x", "files": [], "remove": ["study.db"]},
        {"staged": ".staged-x", "files": [], "remove": ["/tmp/victim.txt"]},
    ],
)
def test_a_hostile_commit_record_in_a_plan_directory_touches_nothing(record, a_plan, tmp_path):
    """A plan directory someone sent you may hold a commit record naming paths outside it."""
    plan = _copy(a_plan, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (plan / ".staged-x").mkdir()
    (plan / ".staged-x" / "victim.txt").write_text("planted")
    record = {
        k: [str(victim) if v == "/tmp/victim.txt" else v for v in vs] if isinstance(vs, list) else vs for k, vs in record.items()
    }
    (plan / COMMIT).write_text(json.dumps(record))
    study = (plan / "study.db").read_bytes()
    read_plan(plan)
    assert victim.read_text() == "mine" and (plan / "study.db").read_bytes() == study
    assert not (plan / COMMIT).exists() and leftovers(plan) == []


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://user:{'S3CR' + 'ET'}@db.example/planner",
        "postgresql://user@db.example/planner?password=S3CRET",
        "postgresql:///planner?host=db.example&user=user&password=S3CRET&sslmode=require",
    ],
)
def test_redaction_hides_the_password_wherever_the_url_puts_it(url):
    assert "S3CRET" not in redact(url) and "***" in redact(url)
    assert "S3CRET" not in scrubbed(RuntimeError("driver said: S3CRET rejected"), url)


# --- the local environment: the toolchain vanishes mid-study ---------------------------------------


def test_a_vanished_toolchain_stops_the_study_exit_2_and_costs_no_trial(tiny_model, tiny_data, tmp_path):
    """The first link works; then the compiler is gone (an upgrade, an unmounted volume). The
    trial that needed it is queued again and the run stops; once it is back, the rerun measures
    exactly the missing trials."""
    cxx = tmp_path / "bin" / "g++-planner"
    cxx.parent.mkdir()
    # gone after it links the first step (the stand-in OpenBLAS it builds before that is no step)
    script = '#!/bin/sh\ncase "$*" in *train_step.so*) rm -f "$0";; esac\nexec g++ "$@"\n'
    cxx.write_text(script)
    cxx.chmod(0o755)
    target = tmp_path / "host.yaml"
    target.write_text(f"tvm_target: {{kind: llvm}}\nram_budget_bytes: 512MiB\ntoolchain: {cxx}\n")
    out = tmp_path / "p"
    env = {"PLANNER_CACHE_DIR": str(tmp_path / "cache")}  # cold: every trial links
    args = plan_args(tiny_model, tiny_data, out, "--trials", str(TRIALS), "--target", str(target))
    res = planner(*args, env=env)
    one_error_line(res, 2, str(cxx))
    trials = study_trials(out)
    assert counted(trials) == 1 and not [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    cxx.write_text(script.replace('rm -f "$0"', ":"))
    cxx.chmod(0o755)
    rerun = planner(*args, env=env)
    assert rerun.returncode in PLANNED, rerun.stderr
    assert counted(study_trials(out)) == TRIALS


# --- secrets: a storage password is never printed or written --------------------------------------

SECRET = "Pw-7fq2-secret"


@pytest.fixture
def secret_url(postgres_url):
    import sqlalchemy

    admin = sqlalchemy.create_engine(postgres_url, isolation_level="AUTOCOMMIT", poolclass=sqlalchemy.pool.NullPool)
    role = f"leak{os.getpid()}"
    with admin.connect() as conn:
        conn.execute(sqlalchemy.text(f"CREATE ROLE {role} LOGIN PASSWORD '{SECRET}'"))
        conn.execute(sqlalchemy.text(f"CREATE DATABASE {role} OWNER {role}"))
    host = postgres_url.rsplit("@", 1)[1].rsplit("/", 1)[0]
    yield f"postgresql://{role}:{SECRET}@{host}/{role}"
    with admin.connect() as conn:
        conn.execute(sqlalchemy.text(f"DROP DATABASE IF EXISTS {role} WITH (FORCE)"))
        conn.execute(sqlalchemy.text(f"DROP ROLE IF EXISTS {role}"))


def test_no_output_holds_the_storage_password(secret_url, tiny_model, tiny_data, tmp_path):
    out = tmp_path / "p"
    outputs = []
    res = planner(*plan_args(tiny_model, tiny_data, out, "--trials", "1", "--storage", secret_url, "-v", "--json"))
    assert res.returncode in PLANNED, res.stderr
    outputs.append(res)
    outputs.append(planner("worker", "--storage", secret_url, "--study", "planner", "--trials", "1", "--json", "-v"))
    for fmt in ("md", "json", "html"):
        outputs.append(planner("report", "--storage", secret_url, "--study", "planner", "--format", fmt))
        outputs.append(planner("report", str(out), "--format", fmt))
    assert all(r.returncode in PLANNED for r in outputs), [r.stderr for r in outputs]
    wrong = secret_url.replace(SECRET, SECRET + "-wrong")
    errors = [
        planner("report", "--storage", secret_url, "--study", "no-such-study"),
        planner("report", "--storage", wrong, "--study", "planner"),
        planner("worker", "--storage", wrong, "--study", "planner", "--json"),
        planner(*plan_args(tiny_model, tiny_data, tmp_path / "q", "--trials", "1", "--storage", wrong)),
    ]
    for res in errors:
        one_error_line(res, 2, "***")
    for res in outputs + errors:
        assert SECRET not in res.stdout + res.stderr
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"plan.json", "report.md", "report.html", "trials.json"} <= {p.name for p in files}
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), path
    assert json.loads((out / "plan.json").read_text())["study"]["storage"].startswith("postgresql://leak")
