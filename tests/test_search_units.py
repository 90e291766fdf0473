"""The logic of search/'s modules on their own, with Optuna's in-memory storage or a SQLite file
and fake objectives: the storage wrapper, dead-process recovery, the two-trial pipeline, the
samplers and the objective. No compile: the slow tests (test_faults.py, test_workers.py) kill real
processes around real trials."""

from __future__ import annotations

import multiprocessing
import random
import subprocess
import threading
import time
from types import SimpleNamespace

import optuna
import pytest
from optuna.storages import InMemoryStorage
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import TrialState as State

from planner.errors import BadInput, CandidateFailed, EnvironmentFailure
from planner.search._attrs import record_of, result_of
from planner.search._objective import NOT_BEGUN, _Halt, _objective
from planner.search._pipeline import _Pipeline
from planner.search._recovery import ENV_RETRIES, _alive, process, recover_dead_trials, worker
from planner.search._samplers import AnchoredSampler, make_sampler, takes_anchors
from planner.search._storage import ProcessStorage, storage_of, trial_id
from planner.search.study import open_study
from planner.tasks import CLASSIFICATION
from planner.types import AccuracyResult, Candidate, Latency, MemoryBreakdown, TrialResult

STAMP = {"process": process(), "worker": worker()}


def _study(backend=None, stamp=STAMP, **kw) -> optuna.Study:
    storage = ProcessStorage(backend or InMemoryStorage(), stamp, **kw)
    return optuna.create_study(storage=storage, directions=["maximize", "minimize", "minimize"])


def _dead_process() -> dict:
    """The record of a process of this host that has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return {**process(), "pid": proc.pid, "start": None}


# The storage wrapper


def test_the_storage_stamps_and_announces_every_trial_this_process_starts():
    """Created by `ask` or popped from the queue, a trial carries the process from the instant it
    runs, and listeners hear of it; a queued copy is neither until it is popped."""
    study = _study()
    heard: list[int] = []
    with storage_of(study).listen(heard.append):
        created = study.ask()
        study.enqueue_trial({"x": 0.5})
        (waiting,) = study.get_trials(states=(State.WAITING,))
        assert "process" not in waiting.user_attrs and heard == [created._trial_id]
        popped = study.ask()
    assert popped.number == waiting.number
    study.ask()  # no listener any more
    assert heard == [created._trial_id, popped._trial_id]
    for t in study.get_trials():
        assert t.user_attrs["process"] == process() and t.user_attrs["worker"] == worker()


class _SlowToReturn(InMemoryStorage):
    """Returns from creating a trial after a random pause: threads leave in any order."""

    def create_new_trial(self, study_id, template_trial=None):
        trial_id = super().create_new_trial(study_id, template_trial)
        time.sleep(random.uniform(0, 0.005))
        return trial_id


def test_listeners_hear_trials_in_trial_number_order_whatever_the_threads():
    study = _study(_SlowToReturn())
    heard: list[int] = []
    with storage_of(study).listen(heard.append):
        threads = [threading.Thread(target=lambda: [study.ask() for _ in range(5)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    numbers = {t._trial_id: t.number for t in study.get_trials()}
    assert [numbers[i] for i in heard] == list(range(20))


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_heartbeats_and_stale_trials_work_through_the_wrapper(tmp_path, monkeypatch):
    """On an RDB storage Optuna sees the wrapper's heartbeats (`isinstance(BaseHeartbeat)`, the
    interval), fails a silent trial and hands it to the wrapper's `on_stale`; a beating one stays.
    A trial beats once as it starts, created or popped: its process killed before Optuna's first
    heartbeat (while its sampler runs) leaves no trial RUNNING for good, nor one killed between
    creating the trial and that beat."""
    rdb = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=1, grace_period=1)
    stale: list[int] = []
    study = _study(optuna.storages.get_storage(rdb), on_stale=lambda s, t: stale.append(t.number))
    storage = storage_of(study)
    assert is_heartbeat_enabled(storage) and storage.get_heartbeat_interval() == 1
    silent, beating = study.ask(), study.ask()
    study.enqueue_trial({})
    popped = study.ask()
    with monkeypatch.context() as m:  # its process killed between creating it and its first beat
        m.setattr(storage, "_heard", lambda trial_id: None)
        unheard = study.ask()
    time.sleep(2.1)  # SQLite's clock counts whole seconds
    storage.record_heartbeat(beating._trial_id)
    optuna.storages.fail_stale_trials(study)
    states = {t.number: t.state for t in study.get_trials() if t.number <= unheard.number}
    assert states == {
        silent.number: State.FAIL,
        beating.number: State.RUNNING,
        popped.number: State.FAIL,
        unheard.number: State.FAIL,
    }
    assert stale == [silent.number, popped.number, unheard.number]


def test_without_heartbeats_in_the_backend_the_wrapper_has_none():
    study = _study()
    assert not is_heartbeat_enabled(storage_of(study))
    study.ask()
    optuna.storages.fail_stale_trials(study)  # nothing to fail
    assert [t.state for t in study.get_trials()] == [State.RUNNING]


def test_a_study_optuna_opened_has_no_process_storage():
    with pytest.raises(TypeError, match="open_study"):
        storage_of(optuna.create_study())


# Dead processes


def test_alive_tells_this_process_from_a_dead_one_and_cannot_tell_elsewhere():
    dead = _dead_process()
    assert _alive(process())
    assert not _alive(dead)
    assert not _alive({**process(), "start": (process()["start"] or 0) + 1})  # a later process with this pid
    assert _alive({**dead, "host": "elsewhere"})  # another host: only its heartbeat can tell
    assert _alive({**dead, "boot": "another boot"})  # the same name, another machine (or boot)


def _identity_pipe(out) -> None:
    out.send((process(), worker()))


def test_a_forked_child_is_its_own_process_in_the_trials_it_stamps():
    """A script's `multiprocessing` (fork on Linux) runs planner in children of a process that has
    imported it: each child's trials must name the child, or its death would pass unnoticed
    while the parent lives."""
    parent = process()
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_identity_pipe, args=(there,))
    child.start()
    theirs, their_worker = here.recv()
    child.join()
    assert theirs["pid"] == child.pid != parent["pid"] and their_worker.endswith(f":{child.pid}")
    assert not _alive(theirs)  # it has exited


def _drawn(study: optuna.Study) -> optuna.Trial:
    trial = study.ask()
    trial.suggest_float("x", 0, 1)
    trial.set_user_attr("candidate", {"x": trial.params["x"]})
    return trial


def test_a_dead_processs_drawn_trial_is_queued_again_and_an_undrawn_one_ended():
    study = _study(stamp={"process": _dead_process()})
    drawn, undrawn = _drawn(study), study.ask()
    assert sorted(recover_dead_trials(study)) == [drawn.number, undrawn.number]
    trials = study.get_trials()
    assert (
        trials[drawn.number].state == State.PRUNED
        and "died mid-trial; queued again" in trials[drawn.number].user_attrs["fail_reason"]
    )
    assert trials[undrawn.number].state == State.PRUNED
    assert "before drawing a candidate" in trials[undrawn.number].user_attrs["fail_reason"]
    (copy,) = study.get_trials(states=(State.WAITING,))
    assert copy.user_attrs["requeued_from"] == drawn.number and copy.user_attrs["retries"] == 1
    assert not copy.user_attrs["alone"]
    assert copy.system_attrs["fixed_params"] == {"x": drawn.params["x"]}
    assert recover_dead_trials(study) == []  # nothing left running


def test_a_candidate_whose_process_died_twice_is_a_fail():
    study = _study(stamp={"process": _dead_process()})
    _drawn(study)
    recover_dead_trials(study)
    again = _drawn(study)  # the copy, popped by a process that dies too
    assert again.user_attrs["retries"] == 1
    assert recover_dead_trials(study) == [again.number]
    ended = study.get_trials()[again.number]
    assert ended.state == State.FAIL and "again: the candidate may crash planner" in ended.user_attrs["fail_reason"]
    assert not study.get_trials(states=(State.WAITING,))


def test_two_candidates_in_flight_when_their_process_died_are_both_queued_to_run_alone():
    study = _study(stamp={"process": _dead_process()})
    first, second = _drawn(study), _drawn(study)
    recover_dead_trials(study)
    copies = study.get_trials(states=(State.WAITING,))
    assert sorted(c.user_attrs["requeued_from"] for c in copies) == [first.number, second.number]
    assert all(c.user_attrs["alone"] and c.user_attrs["retries"] == 0 for c in copies)  # neither blamed


def test_a_live_process_trials_are_left_alone():
    study = _study()
    _drawn(study)
    assert recover_dead_trials(study) == []
    assert [t.state for t in study.get_trials()] == [State.RUNNING]


# The two-trial pipeline


def _in_thread(call) -> threading.Event:
    """Runs `call` in a thread; the event is set once it returns."""
    done = threading.Event()
    threading.Thread(target=lambda: (call(), done.set()), daemon=True).start()
    return done


@pytest.fixture
def pipeline_trials():
    """A pipeline attached to a study's storage, and the ids of the 4 trials it started."""
    study, pipeline = _study(), _Pipeline()
    with pipeline.attach(storage_of(study)):
        yield pipeline, [study.ask()._trial_id for _ in range(4)]


def test_the_next_trial_is_sampled_once_this_one_is_timed_and_timed_once_this_one_ended(pipeline_trials):
    pipeline, (t0, t1, *_) = pipeline_trials
    pipeline.before_sampling(t0)  # the first waits for nothing
    pipeline.before_timing(t0)
    sampled = _in_thread(lambda: pipeline.before_sampling(t1))
    assert not sampled.wait(0.2)
    pipeline.timed(t0)
    assert sampled.wait(5)
    timed = _in_thread(lambda: pipeline.before_timing(t1))
    assert not timed.wait(0.2)  # t0 is fine-tuning: t1 compiles meanwhile, but is not timed
    pipeline.ended(t0)
    assert timed.wait(5)


def test_a_trial_that_fails_early_does_not_let_the_next_be_timed_before_every_earlier_one_ended(pipeline_trials):
    """Trial 1 fails to compile while trial 0 fine-tunes: trial 2 may be sampled and compile, but
    is timed (and screened against the finished trials) only once trial 0 has ended too."""
    pipeline, (t0, t1, t2, _) = pipeline_trials
    pipeline.timed(t0)  # t0 fine-tunes
    pipeline.exited(t1)
    pipeline.ended(t1)  # t1 failed and was told
    pipeline.before_sampling(t2)  # returns: both before it were timed
    timed = _in_thread(lambda: pipeline.before_timing(t2))
    assert not timed.wait(0.3)
    pipeline.ended(t0)
    assert timed.wait(5)


def test_after_a_trial_that_runs_alone_the_next_waits_for_its_end(pipeline_trials):
    pipeline, (t0, t1, t2, _) = pipeline_trials
    pipeline.ended(t0)
    pipeline.run_alone(t1)  # returns at once: t0 has ended
    sampled = _in_thread(lambda: pipeline.before_sampling(t2))
    pipeline.timed(t1)
    assert not sampled.wait(0.3)
    pipeline.ended(t1)
    assert sampled.wait(5)


def test_a_trial_that_left_its_objective_but_was_never_told_holds_the_next_only_so_long(pipeline_trials):
    pipeline, (t0, t1, *_) = pipeline_trials
    pipeline.TELL_S = 0.1
    pipeline.exited(t0)  # its tell failed: `ended` never comes
    timed = _in_thread(lambda: pipeline.before_timing(t1))
    assert timed.wait(5)


def test_an_aborted_pipeline_holds_nobody():
    study, pipeline = _study(), _Pipeline()
    with pipeline.attach(storage_of(study)):
        t0, t1 = study.ask()._trial_id, study.ask()._trial_id
        timed = _in_thread(lambda: pipeline.before_timing(t1))
        assert not timed.wait(0.2)
    assert timed.wait(5)  # leaving `attach` aborts it
    pipeline.before_sampling(t0)


# Samplers


def test_make_sampler_takes_names_and_optuna_samplers():
    assert isinstance(make_sampler("tpe", 0), optuna.samplers.TPESampler)
    assert isinstance(make_sampler("random", 0), optuna.samplers.RandomSampler)
    own = optuna.samplers.QMCSampler(seed=1)
    assert make_sampler(own, 0) is own
    for bad in ("cmaes", 3):
        with pytest.raises(BadInput, match="unknown sampler.*tpe, random"):
            make_sampler(bad, 0)  # type: ignore[arg-type]


def test_anchors_fix_the_first_trials_of_a_sampler_object_too():
    sampler = make_sampler(optuna.samplers.RandomSampler(seed=0), None, [{"x": 0.25}, {"x": 0.75}])
    assert isinstance(sampler, AnchoredSampler)
    study = optuna.create_study(sampler=sampler)
    xs = [study.ask().suggest_float("x", 0, 1) for _ in range(3)]
    assert xs[:2] == [0.25, 0.75] and xs[2] not in (0.25, 0.75)
    assert sampler.fixes(1) and not sampler.fixes(2)


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_resumed_study_draws_new_candidates_and_the_same_ones_each_time(sampler, tmp_path):
    """Seeded as at its start, a resumed study's sampler would replay its first draws (random
    search's all of them, TPE's startup) and measure those candidates again; reseeded from the
    seed and the trials begun, it draws new ones, and a rerun of the same resume the same ones."""

    def draws(url: str, n: int) -> list[float]:
        study = open_study(url, "s", 0, {"space": "x"}, sampler)
        xs = []
        for _ in range(n):
            trial = study.ask()
            xs.append(trial.suggest_float("x", 0, 1))
            study.tell(trial, [xs[-1], 1.0, 1.0])
        return xs

    first = draws(f"sqlite:///{tmp_path / 'a.db'}", 3)
    resumed = draws(f"sqlite:///{tmp_path / 'a.db'}", 3)
    assert not set(resumed) & set(first)
    assert draws(f"sqlite:///{tmp_path / 'b.db'}", 3) == first  # a new study: the seed's own draws
    assert draws(f"sqlite:///{tmp_path / 'b.db'}", 3) == resumed


def test_only_tpe_takes_the_spaces_recipes():
    assert takes_anchors("tpe") and takes_anchors(optuna.samplers.TPESampler(seed=0))
    assert not takes_anchors("random") and not takes_anchors(optuna.samplers.RandomSampler())  # the blind baseline
    assert not takes_anchors(optuna.samplers.GridSampler({"x": [0.1, 0.2]}))  # its own bookkeeping


# The objective


class _Space:
    def sample(self, trial, model):
        return trial.suggest_float("x", 0, 1)


class _Evaluator:
    """Records what a real evaluation records, then does `then` (returns constraints, or raises)."""

    def __init__(self, then=None) -> None:
        self.settings, self.model, self.then = SimpleNamespace(seed=7), SimpleNamespace(task=CLASSIFICATION), then

    def compiling(self) -> bool:
        return False

    def evaluate(self, candidate, result, hooks):
        result.candidate = Candidate(trainable=(("fc", "full"),), batch_size=8, optimizer="sgd", lr=candidate)
        hooks.saved(result)
        hooks.before_timing()
        hooks.after_timing()
        if self.then is not None:
            raise self.then
        result.accuracy = AccuracyResult(before=0.1, after=0.5, loss_before=2.0, loss_after=1.0, steps=5, seconds=0.1)
        result.latency = Latency(median=2.0, p90=2.5, min=1.5, max=3.0, repeats=3, number=1, device="local")
        result.memory = MemoryBreakdown(1000, 600, 100, 100, 0, 200)
        hooks.saved(result)
        return {"ram_budget": -1.0}


def _run(study, evaluator, halt=None, pipeline=None):
    """Runs one trial with the objective; returns it as it ended, and the halt it ran with."""
    halt = halt or _Halt(None)
    objective = _objective(evaluator, _Space(), halt, pipeline, 2 if pipeline else 1)
    ran: list[optuna.trial.FrozenTrial] = []
    callbacks = [lambda s, t: ran.append(t)] + ([] if pipeline is None else [lambda s, t: pipeline.ended(t._trial_id)])
    study.optimize(objective, n_trials=1, catch=(CandidateFailed,), callbacks=callbacks)
    return ran[0], halt


def test_the_objective_returns_the_three_objectives_and_sets_the_budgets():
    trial, _ = _run(_study(), _Evaluator())
    assert trial.state == State.COMPLETE and trial.values == [0.5, 2.0, 1000.0]
    assert trial.constraints == {"ram_budget": -1.0} and trial.user_attrs["seed"] == 7


def test_an_environment_failure_queues_the_candidate_and_stops_the_study_until_it_failed_each_time():
    study = _study()
    trial, halt = _run(study, _Evaluator(EnvironmentFailure("disk full")))
    assert trial.state == State.PRUNED and "environment: disk full" in halt.error.args[0] + trial.user_attrs["fail_reason"]
    (copy,) = study.get_trials(states=(State.WAITING,))
    assert copy.user_attrs["env_failures"] == 1 and copy.user_attrs["requeued_from"] == trial.number
    for _ in range(ENV_RETRIES - 1):
        trial, _ = _run(study, _Evaluator(EnvironmentFailure("disk full")))
    assert trial.state == State.FAIL and f"each of the {ENV_RETRIES} times" in trial.user_attrs["fail_reason"]
    assert not study.get_trials(states=(State.WAITING,))


def test_a_second_ctrl_c_mid_trial_queues_the_candidate_again():
    study = _study()
    trial, halt = _run(study, _Evaluator(KeyboardInterrupt()))
    assert halt.hard and trial.state == State.PRUNED
    assert [c.user_attrs["requeue_reason"] for c in study.get_trials(states=(State.WAITING,))] == ["interrupted mid-trial"]


def test_a_trial_stopped_while_waiting_its_turn_has_not_begun():
    study, pipeline = _study(), _Pipeline()
    halt = _Halt(threading.Event())
    halt.stop.set()
    with pipeline.attach(storage_of(study)):
        trial, _ = _run(study, _Evaluator(), halt, pipeline)
    assert trial.state == State.PRUNED and trial.user_attrs["fail_reason"] == NOT_BEGUN and not trial.params
    assert not study.get_trials(states=(State.WAITING,))


def test_what_a_trial_measured_is_stored_and_read_back_as_one_typed_result():
    """The evaluator fills a `TrialResult`; the study stores it through the one adapter and a
    record read back from the study holds every field as measured."""
    trial, _ = _run(_study(), _Evaluator())
    result = result_of(trial)
    assert result.accuracy == AccuracyResult(before=0.1, after=0.5, loss_before=2.0, loss_after=1.0, steps=5, seconds=0.1)
    assert result.latency is not None and result.latency.median == 2.0 and result.memory.total == 1000
    assert result.candidate is not None and result.candidate.lr == trial.params["x"]
    assert TrialResult.from_json(result.to_json()) == result
    record = record_of(trial)
    assert record.feasible and record.measured().accuracy.after == 0.5 and record.seed == 7


def test_the_optuna_internals_planner_relies_on_are_where_it_reads_them(tmp_path):
    """`search/_storage.py` is planner's one module on Optuna's private API (there is no public
    way to them); when an Optuna release moves any of them, this fails by name, not a study."""
    from optuna.storages._cached_storage import _CachedStorage
    from optuna.storages._heartbeat import BaseHeartbeat
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session  # noqa: F401

    for name in ("get_heartbeat_interval", "record_heartbeat", "_get_stale_trial_ids", "get_heartbeat_stale_trial_callback"):
        assert callable(getattr(BaseHeartbeat, name, None)), name
    for table, column in (
        (models.TrialModel, "trial_id"),
        (models.TrialModel, "state"),
        (models.TrialHeartbeatModel, "trial_heartbeat_id"),
    ):
        assert hasattr(table, column), (table, column)
    rdb = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 's.db'}")
    assert isinstance(rdb, BaseHeartbeat) and hasattr(rdb, "scoped_session")
    assert _CachedStorage(rdb)._backend is rdb
    study = open_study(f"sqlite:///{tmp_path / 'p.db'}", "s", 0, {"v": 1}, "random", None, {})
    assert storage_of(study) is study._storage  # (`Study._storage`)
    trial = study.ask()
    assert (
        trial_id(trial)
        == trial_id(study.trials[0])
        == storage_of(study).get_trial_id_from_study_id_trial_number(study._study_id, 0)
    )
