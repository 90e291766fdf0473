"""Trials whose process died, found and run again: which process runs a trial, whether it still
does, and the re-queueing that makes a killed run cost the study no candidate.

A trial carries its process (`process()`, stamped by `ProcessStorage`): on this host a dead pid
tells at once (`recover_dead_trials`), elsewhere a silent heartbeat does (`_retry_stale`, the
study storage's stale-trial callback). Both queue the candidate again, once: a candidate whose
process died twice likely crashes planner, and is a FAIL.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import socket
from datetime import datetime
from pathlib import Path

import optuna

from planner.search._attrs import drawn, explain, explained
from planner.search._storage import grace_seconds, storage_of, trial_id

RETRIES = 1  # a trial whose process died is run once more; dying again, it stays FAIL
ENV_RETRIES = 3  # a candidate the environment failed this often is a FAIL: it may be what breaks it


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, Linux), to tell it from a later
    process that got the same pid; None where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name may hold spaces


def _machine() -> dict:
    """What tells this machine and PID namespace from another with the same hostname (cloned
    images, containers on the host's network): the kernel's boot id and the PID namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return {}
    return {"boot": boot, "pidns": pidns}


def process() -> dict:
    """This process as its trials record it (`ProcessStorage`'s stamp): host, pid, start time,
    machine. Asked each time, not fixed at import: a child forked by a script (multiprocessing's
    default on Linux) is another process, whose trials must not pass for its parent's."""
    return dict(_process(os.getpid()))


@functools.cache
def _process(pid: int) -> dict:
    return {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid), **_machine()}


def worker() -> str:
    """`HOST:PID` of this process: which process ran a trial, as reports show it."""
    me = _process(os.getpid())
    return f"{me['host']}:{me['pid']}"


def _alive(process: dict) -> bool:
    """Whether the process that recorded `process` still runs. Only answerable in the same
    boot of the same machine and PID namespace; anything else counts as alive (its heartbeat,
    on an RDB storage, tells when it is not)."""
    here = _machine()
    if process.get("host") != _process(os.getpid())["host"] or not here or any(process.get(k) != v for k, v in here.items()):
        return True
    pid = int(process["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    start = _start_time(pid)
    return process.get("start") is None or start is None or start == process["start"]


def _requeue(
    trial: optuna.Trial | optuna.trial.FrozenTrial,
    study: optuna.Study,
    reason: str,
    crashed: bool = False,
    env_failures: int | None = None,
    alone: bool = False,
) -> None:
    """Queue `trial`'s candidate again: the copy runs before anything new is sampled.

    The trial itself is then ended PRUNED (planner prunes nothing else), which never counts as
    finished, so the study still wants as many trials as before. `crashed` marks a process that
    died mid-trial, which may be the candidate's doing (a crash in its code): such a candidate is
    queued again only RETRIES times, then it is a FAIL. `alone`: the copy runs with no other
    trial in flight (`_Pipeline.run_alone`), so a crash of its process is its own."""
    retries = int(trial.user_attrs.get("retries", 0)) + crashed
    if isinstance(trial, optuna.Trial):  # a live trial, about to end PRUNED: say why
        explain(trial.set_user_attr, f"{reason}; queued again")
    attrs = {"requeued_from": trial.number, "requeue_reason": reason, "retries": retries, "alone": alone}
    attrs["env_failures"] = int(trial.user_attrs.get("env_failures", 0)) if env_failures is None else env_failures
    study.enqueue_trial(trial.params if drawn(trial) else {}, user_attrs=attrs)  # (part of a candidate: none)


STALE = "its process stopped sending heartbeats (killed or lost)"


def _retry_stale(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """The study's heartbeat-stale callback (its `ProcessStorage`'s `on_stale`, in place of Optuna's
    `RetryHeartbeatStaleTrialCallback`; see `open_storage`): `trial`, just failed by Optuna
    because its process went silent on some host, is queued again as `recover_dead_trials`
    queues a dead process's trial on this one. A candidate whose process died RETRIES times
    already stays FAIL; one that died beside another candidate of the same process (two in
    flight) is not blamed, and runs again alone; one killed before it drew a candidate is
    replaced by a fresh trial. Its copy points back at it (`requeued_from`), so `_finished`
    does not count it."""
    if not drawn(trial):  # killed before its candidate was drawn: not the candidate's doing, and a fresh one takes its place
        _requeue(trial, study, f"{STALE} before drawing a candidate")
        return
    shared = any(
        t.number != trial.number and drawn(t) and t.user_attrs.get("process") == trial.user_attrs.get("process") and _silenced(t)
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL))
    )
    if int(trial.user_attrs.get("retries", 0)) >= RETRIES and not shared:
        return  # it stays FAIL (`records` says why)
    _requeue(trial, study, f"{STALE} beside another trial; to run alone" if shared else STALE, crashed=not shared, alone=shared)


def _silenced(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether `trial`'s process is gone without a word from it: running still (about to be
    failed as stale too: its heartbeats stopped with its process), or failed by Optuna for its
    silence (a trial that failed on its own carries a reason)."""
    if trial.state == optuna.trial.TrialState.RUNNING:
        return True
    return not explained(trial)


def _dead(study: optuna.Study, grace_s: float) -> list[tuple[optuna.trial.FrozenTrial, str, str]]:
    """The study's RUNNING trials whose process is dead, each with why it counts as dead and which
    process ran it: one recorded on this host whose pid is gone, or one with no process record
    (a study planner ran before it stamped trials) started more than `grace_s` ago."""
    dead = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        process = t.user_attrs.get("process")
        if isinstance(process, dict):
            if _alive(process):
                continue
            reason = f"its process ({process.get('host')}:{process.get('pid')}) died mid-trial"
        elif t.datetime_start is not None and (datetime.now() - t.datetime_start).total_seconds() > grace_s:
            reason = "its process died mid-trial (a trial with no process record, started long ago)"
        else:
            continue  # another process's trial, a moment old
        dead.append((t, reason, json.dumps(process, sort_keys=True) if isinstance(process, dict) else f"#{t.number}"))
    return dead


def recover_dead_trials(study: optuna.Study) -> list[int]:
    """End the RUNNING trials whose process died on this host (kill -9, a crash, power loss),
    whatever the storage (a journal file has no heartbeats; an RDB's only fire after a grace
    period), and queue their candidates again, so a rerun a second later measures them. A
    candidate whose process died RETRIES times already is a FAIL: it likely crashes planner.

    A process that died with two candidates in flight (`--overlap`) cannot say which one killed
    it: neither is blamed, and both are queued to run alone, where a second crash is the
    candidate's own. A trial that had not drawn its candidate yet is only ended.

    Returns the numbers of the trials ended."""
    ended = []
    queued = {
        t.user_attrs.get("requeued_from") for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    }
    dead = _dead(study, grace_seconds())
    in_flight = collections.Counter(key for t, _, key in dead if drawn(t))
    storage = storage_of(study)
    for t, reason, key in dead:
        tid = trial_id(t)
        crashes = int(t.user_attrs.get("retries", 0))
        shared = in_flight[key] > 1
        try:
            if not drawn(t):  # it was waiting its turn to draw a candidate (or drawing it): nothing to measure again
                explain(functools.partial(storage.set_trial_user_attr, tid), f"{reason} before drawing a candidate")
                storage.set_trial_state_values(tid, optuna.trial.TrialState.PRUNED)
            elif crashes >= RETRIES and not shared:
                explain(functools.partial(storage.set_trial_user_attr, tid), f"{reason}, again: the candidate may crash planner")
                storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL)
            else:
                why = f"{reason} beside another trial; to run alone" if shared else reason
                explain(functools.partial(storage.set_trial_user_attr, tid), f"{why}; queued again")
                storage.set_trial_state_values(tid, optuna.trial.TrialState.PRUNED)
                if t.number not in queued:  # (its own process queued it, then died before ending it)
                    _requeue(t, study, why, crashed=not shared, alone=shared)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another process got there first
        ended.append(t.number)
    return ended
