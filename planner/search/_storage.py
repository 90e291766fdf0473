"""Study storages: which Optuna storage a URL names, and the storage a planner study writes through.

`ProcessStorage` wraps any Optuna storage (as Optuna's own `_CachedStorage` wraps an RDB one):
every method is the wrapped storage's, and on top of them it knows which trials this process
starts — it stamps them with the process from the instant they exist and tells listeners (the
two-trial pipeline) in trial-number order. A wrapper rather than replaced methods, so the
storage Optuna holds is the one planner built, whatever kind the URL named.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable, Container, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import optuna.storages.journal
from optuna.storages import BaseStorage
from optuna.storages._cached_storage import _CachedStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages._rdb import models
from optuna.storages._rdb.storage import _create_scoped_session
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy
from optuna.trial import FrozenTrial, TrialState

from planner.errors import BadInput, OutputUnwritable, disk_problem
from planner.search.urls import redact

HEARTBEAT_ENV, GRACE_ENV = "PLANNER_HEARTBEAT_S", "PLANNER_HEARTBEAT_GRACE_S"
HEARTBEAT_S, GRACE_S = 10, 30  # their defaults
STARTED = "planner:started"  # a trial's system attribute: when this process created it, seconds since the epoch


def experimental() -> warnings.catch_warnings:
    """Optuna's ExperimentalWarning silenced around a call that raises it: heartbeats and metric
    names are "experimental" in Optuna, and planner relies on them knowingly. Around the call, not
    a filter set on import: a program that imports planner keeps its own warning filters."""
    return warnings.catch_warnings(action="ignore", category=optuna.exceptions.ExperimentalWarning)


def _env_seconds(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise BadInput(f"{name} must be a whole number of seconds, at least 1 (not {raw!r})")
    return int(raw)


def grace_seconds() -> int:
    """How long a trial may stay silent before its process counts as dead (PLANNER_HEARTBEAT_GRACE_S)."""
    return _env_seconds(GRACE_ENV, GRACE_S)


def open_storage(url: str | None) -> BaseStorage:
    """An Optuna storage from planner's URL: an RDB URL (sqlite/postgresql/mysql), else a journal
    file path (Optuna's `JournalFileBackend`, safe for many processes on one disk); None keeps the
    study in this process's memory (a script's one-off search: nothing to resume).

    An RDB storage keeps heartbeats: a running trial records one every PLANNER_HEARTBEAT_S seconds
    (default 10). When a trial has been silent for PLANNER_HEARTBEAT_GRACE_S seconds (default 30),
    its process was killed or its machine lost. The next process to start a trial on the study
    (a `planner plan` or `planner worker`) then marks it FAIL and, through the study's
    `ProcessStorage` (its `on_stale`: `_retry_stale`), queues a copy with the same parameters,
    which Optuna runs before sampling anything new (once per candidate, so a candidate that kills
    its process cannot kill every worker in turn).

    A journal file has no heartbeats in Optuna 5: a killed process's trial stays RUNNING there
    and is not retried (the study goes on without it).
    """
    if url is None:
        return optuna.storages.InMemoryStorage()
    if _sqlite_file(url):  # `--storage plan/study.db`: the path of an SQLite database, not a journal
        url = f"sqlite:///{Path(url).resolve()}"
    if url.startswith(("sqlite:", "postgresql", "mysql")):
        interval, grace = _env_seconds(HEARTBEAT_ENV, HEARTBEAT_S), grace_seconds()
        if grace <= interval:
            raise BadInput(f"{GRACE_ENV} ({grace} s) must be longer than {HEARTBEAT_ENV} ({interval} s)")
        with experimental():
            return optuna.storages.RDBStorage(url, heartbeat_interval=interval, grace_period=grace)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))


SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


def _sqlite_file(path: str) -> bool:
    """Whether a storage given as a path names an SQLite database: a file that is one (its magic
    header), or a new file with an SQLite suffix. Read as a journal, its bytes would not decode."""
    if "://" in path:
        return False
    file = Path(path)
    if file.is_file():
        with open(file, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    return file.suffix in SQLITE_SUFFIXES


Listener = Callable[[int], None]
StaleCallback = Callable[[optuna.Study, FrozenTrial], None]


class ProcessStorage(BaseStorage, BaseHeartbeat):
    """`backend` as this process writes to it: each trial the process starts running — created
    by `ask`, or a queued one popped — carries `stamp` (user attributes: which process runs it)
    from the instant it runs, and each listener hears its trial id, in trial-number order.

    Stamped at creation (one write) rather than later in the objective: a kill in between would
    leave a RUNNING trial nobody can tell is dead (until it is a grace period old). A trial
    queued by `enqueue_trial` is created WAITING: it is stamped and heard of when it is popped.

    Heartbeats are the backend's (Optuna checks `isinstance(storage, BaseHeartbeat)` and the
    interval): on a backend without them the interval is None, so Optuna never asks for one. A
    trial whose heartbeat went stale goes to `on_stale` in place of the backend's callback.
    """

    def __init__(self, backend: BaseStorage, stamp: dict[str, Any], on_stale: StaleCallback | None = None) -> None:
        self.backend, self._stamp, self._on_stale = backend, stamp, on_stale
        self._listeners: list[Listener] = []
        # held from a trial's start until its listeners are told, so they hear trial-number order
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def listen(self, listener: Listener) -> Iterator[None]:
        """`listener(trial_id)` for each trial this process starts, while the context lasts."""
        with self._lock:
            self._listeners.append(listener)
        try:
            yield
        finally:
            with self._lock:
                self._listeners.remove(listener)

    def _started(self, trial_id: int) -> None:
        for listener in self._listeners:
            listener(trial_id)

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        if template_trial is not None:  # a copy (enqueue_trial, add_trial): not started here
            return self.backend.create_new_trial(study_id, template_trial)
        template = FrozenTrial(
            number=-1,
            state=TrialState.RUNNING,
            value=None,
            datetime_start=datetime.now(),
            datetime_complete=None,
            params={},
            distributions={},
            user_attrs=dict(self._stamp),
            system_attrs={STARTED: time.time()},
            intermediate_values={},
            trial_id=-1,
        )
        with self._lock:
            trial_id = self.backend.create_new_trial(study_id, template)
            self._heard(trial_id)
            self._started(trial_id)
        return trial_id

    def _heard(self, trial_id: int) -> None:
        """A first heartbeat as the trial starts: Optuna's own comes only once its sampler has run,
        and Optuna never calls a trial without one stale, so a process killed in between (on
        another host, where no pid can tell) would leave it RUNNING for good. A kill between the
        trial's creation and this beat is `_unheard`'s to find."""
        if self.get_heartbeat_interval() is not None:
            self.record_heartbeat(trial_id)

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        if state != TrialState.RUNNING:
            return self.backend.set_trial_state_values(trial_id, state, values)
        with self._lock:
            # beats before it is popped, so no kill leaves it RUNNING without a heartbeat (a pop
            # another process wins leaves a beat on a trial that process beats over at once)
            self._heard(trial_id)
            popped = self.backend.set_trial_state_values(trial_id, state, values)
            if popped:  # a queued trial, this process's now
                for key, value in self._stamp.items():
                    self.backend.set_trial_user_attr(trial_id, key, value)
                self._started(trial_id)
        return popped

    # Heartbeats: the backend's, if it has them.

    def get_heartbeat_interval(self) -> int | None:
        return self.backend.get_heartbeat_interval() if isinstance(self.backend, BaseHeartbeat) else None

    def record_heartbeat(self, trial_id: int) -> None:
        if isinstance(self.backend, BaseHeartbeat):
            self.backend.record_heartbeat(trial_id)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        if not isinstance(self.backend, BaseHeartbeat):
            return []
        stale = self.backend._get_stale_trial_ids(study_id)
        return stale + [t for t in self._unheard(study_id) if t not in stale]

    def _unheard(self, study_id: int) -> list[int]:
        """RUNNING trials with no heartbeat at all, created by planner more than a grace period
        ago: their process died between creating them and their first beat (one statement
        apart). A live trial goes unheard for a millisecond, so only a clock more than a grace
        period off between two hosts could take one for dead. Trials without `STARTED` (made by
        other tools) are left alone, as Optuna leaves them."""
        rdb = self.backend._backend if isinstance(self.backend, _CachedStorage) else self.backend
        if not isinstance(rdb, optuna.storages.RDBStorage) or rdb.heartbeat_interval is None:
            return []
        grace = rdb.grace_period or 2 * rdb.heartbeat_interval
        with _create_scoped_session(rdb.scoped_session) as session:
            silent = (
                session.query(models.TrialModel.trial_id)
                .outerjoin(models.TrialHeartbeatModel)
                .filter(models.TrialModel.study_id == study_id, models.TrialModel.state == TrialState.RUNNING)
                .filter(models.TrialHeartbeatModel.trial_heartbeat_id.is_(None))
                .all()
            )
        now = time.time()
        return [tid for (tid,) in silent if now - float(rdb.get_trial_system_attrs(tid).get(STARTED, now)) > grace]

    def get_heartbeat_stale_trial_callback(self) -> StaleCallback | None:
        if self._on_stale is not None:
            return self._on_stale
        return self.backend.get_heartbeat_stale_trial_callback() if isinstance(self.backend, BaseHeartbeat) else None

    # Everything else is the backend's, its own optimisations included (an RDB's, a cache's).

    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self.backend.create_new_study(directions, study_name)

    def delete_study(self, study_id: int) -> None:
        self.backend.delete_study(study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self.backend.set_study_user_attr(study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self.backend.set_study_system_attr(study_id, key, value)

    def get_study_id_from_name(self, study_name: str) -> int:
        return self.backend.get_study_id_from_name(study_name)

    def get_study_name_from_id(self, study_id: int) -> str:
        return self.backend.get_study_name_from_id(study_id)

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self.backend.get_study_directions(study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self.backend.get_study_user_attrs(study_id)

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self.backend.get_study_system_attrs(study_id)

    def get_all_studies(self) -> list[FrozenStudy]:
        return self.backend.get_all_studies()

    def set_trial_param(
        self, trial_id: int, param_name: str, param_value_internal: float, distribution: optuna.distributions.BaseDistribution
    ) -> None:
        self.backend.set_trial_param(trial_id, param_name, param_value_internal, distribution)

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self.backend.get_trial_id_from_study_id_trial_number(study_id, trial_number)

    def get_trial_number_from_id(self, trial_id: int) -> int:
        return self.backend.get_trial_number_from_id(trial_id)

    def get_trial_param(self, trial_id: int, param_name: str) -> float:
        return self.backend.get_trial_param(trial_id, param_name)

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        self.backend.set_trial_intermediate_value(trial_id, step, intermediate_value)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.backend.set_trial_user_attr(trial_id, key, value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self.backend.set_trial_system_attr(trial_id, key, value)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self.backend.get_trial(trial_id)

    def get_all_trials(
        self, study_id: int, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        return self.backend.get_all_trials(study_id, deepcopy=deepcopy, states=states)

    def get_n_trials(self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None) -> int:
        return self.backend.get_n_trials(study_id, state)

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self.backend.get_best_trial(study_id)

    def get_trial_params(self, trial_id: int) -> dict[str, Any]:
        return self.backend.get_trial_params(trial_id)

    def get_trial_user_attrs(self, trial_id: int) -> dict[str, Any]:
        return self.backend.get_trial_user_attrs(trial_id)

    def get_trial_system_attrs(self, trial_id: int) -> dict[str, Any]:
        return self.backend.get_trial_system_attrs(trial_id)

    def remove_session(self) -> None:
        self.backend.remove_session()

    def check_trial_is_updatable(self, trial_id: int, trial_state: TrialState) -> None:
        self.backend.check_trial_is_updatable(trial_id, trial_state)


def storage_of(study: optuna.Study) -> ProcessStorage:
    """The `ProcessStorage` a study writes through (`open_study` gives it one). Optuna has no
    public way from a study to its storage: this is planner's one use of `Study._storage`."""
    storage = study._storage
    if not isinstance(storage, ProcessStorage):
        raise TypeError(
            f"study '{study.study_name}' was not opened by planner (open_study): its storage is a {type(storage).__name__}"
        )
    return storage


@contextlib.contextmanager
def storage_writes(storage_url: str | None) -> Iterator[None]:
    """Around opening and running a study: running out of disk (or a read-only file system)
    under its storage is one `OutputUnwritable` line naming the directory, not Optuna's
    traceback. An SQLite file this run created and that holds no finished trial is removed again;
    finished trials are kept, so the same command resumes the study once there is room.
    """
    db = _sqlite_path(storage_url)
    db_existed = db is not None and db.exists()
    try:
        yield
    except Exception as exc:
        found = disk_problem(exc)
        if found is None:
            raise
        reason, filename = found
        where = db if db is not None else (Path(storage_url) if storage_url and "://" not in storage_url else None)
        if filename is not None and (where is None or Path(filename).parent != where.parent):
            raise OutputUnwritable(f"cannot write {filename}: {reason}") from None  # not the storage
        tail = ""
        if db is not None and db.exists():
            if not db_existed and _finished_trials(db) == 0:
                for path in (db, db.with_name(db.name + "-journal")):
                    path.unlink(missing_ok=True)
            else:
                tail = f"; the trials finished so far stay in {db.name}: make room and rerun the same command to resume"
        place = f"into {where.parent}: {reason} ({where.name})" if where is not None else f"{redact(storage_url)}: {reason}"
        raise OutputUnwritable(f"cannot write the study storage {place}{tail}") from None


def _sqlite_path(storage_url: str | None) -> Path | None:
    """The file behind a `sqlite:///PATH` storage URL (None for any other storage)."""
    prefix = "sqlite:///"
    path = storage_url[len(prefix) :].split("?", 1)[0] if storage_url and storage_url.startswith(prefix) else ""
    return Path(path) if path and path != ":memory:" else None


def _finished_trials(db: Path) -> int | None:
    """Finished trials in an Optuna SQLite file, read read-only (None: unreadable, so keep it)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "trials" not in tables:
                return 0
            return conn.execute("SELECT COUNT(*) FROM trials WHERE state IN ('COMPLETE', 'FAIL')").fetchone()[0]
    except sqlite3.Error:
        return None


def trial_id(trial: optuna.Trial | FrozenTrial) -> int:
    """A trial's id in its storage, which the storage's own calls take. Optuna keeps it private
    (`_trial_id`) and offers no public way to it: this is planner's one use of it."""
    return trial._trial_id
