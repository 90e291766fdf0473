"""The `rpc` runner: a step measured and trained on a board behind a TVM RPC tracker.

A measurement requests a board of the key from the tracker (waiting while all are busy), uploads
the library, loads it into a Relax VM on the board, uploads the weights, times the step there with
the VM's time evaluator and reads the board process's peak memory through planner's probes (when
the board runs `planner board serve`). A board that disconnects, crashes or overruns its session
costs one retry on another board; after the second, `BoardLost` when no board is left (the search
queues the trial again and stops, exit 3), else the candidate failed on the board.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from planner.backend._base import Artifact
from planner.backend.vm import VM_LIBRARY
from planner.errors import BoardLost, BoardUnreachable, CandidateFailed, EnvironmentFailure, PlannerError, first_line, last_line
from planner.measurement._base import Measurement, Runner, Session
from planner.measurement.board import BOARD_ID, HEAP, PEAK_RSS, RESET_PEAK, TIMED_INVOKE, KeyStatus, key_status
from planner.measurement.latency import method, time_step
from planner.runtime.convention import STEP_FUNC
from planner.runtime.libraries import INSTALL_HINT, missing_library
from planner.runtime.session import TrainingSession
from planner.types import Latency

T = TypeVar("T")


@dataclass
class BoardPool:
    """The boards registered with one tracker under one key."""

    tracker: tuple[str, int]
    key: str
    priority: int = 1
    session_timeout_s: float = 600

    @classmethod
    def for_target(cls, target) -> BoardPool:
        r = target.boards
        if r is None:
            raise ValueError(f"target {target.name} has no boards behind a tracker")
        return cls(r.address, r.key, r.priority, r.session_timeout_s)

    @property
    def device(self) -> str:
        return f"rpc:{self.key}"

    def status(self) -> KeyStatus:
        return key_status(self.tracker, self.key)

    def check(self) -> KeyStatus:
        """Fail fast (exit 3) when the tracker is down or knows no board of the key."""
        status = self.status()
        if status.total == 0:
            raise BoardUnreachable(
                f"the tracker at {self.tracker[0]}:{self.tracker[1]} has no board under key '{self.key}' "
                f"(start one with `planner board serve --tracker {self.tracker[0]}:{self.tracker[1]} --key {self.key}`)"
            )
        return status

    def session(self):
        """A session on a free board of the key (blocks while every board is busy)."""
        from tvm import rpc

        try:
            if self.status().total == 0:  # the tracker would queue the request forever
                raise BoardLost(f"no '{self.key}' board is left at the tracker")
            tracker = rpc.connect_tracker(*self.tracker)
            return tracker.request(self.key, priority=self.priority, session_timeout=self.session_timeout_s, max_retry=2)
        except (OSError, RuntimeError, BoardUnreachable) as exc:
            raise BoardLost(f"no session on a '{self.key}' board: {last_line(exc)}") from None

    def run(self, library: Path, fn: Callable):
        """`fn(remote, lib, device)` with `library` loaded on a free board of the key.

        A board that disconnects, crashes or overruns its session is retried once, on whichever
        board is free then. After a second loss the tracker is asked who is to blame: with no
        board of the key left (or no tracker), the boards are gone — `BoardLost`, an environment
        failure that costs no trial; with boards still registered, their session died running
        this candidate twice (a crash or a timeout of its code on the board) — `CandidateFailed`.
        """
        for attempt in range(2):
            try:
                remote = self.session()
                try:
                    remote.upload(str(library), _remote_name(library))
                    try:
                        lib = remote.load_module(_remote_name(library))
                    except Exception as exc:
                        if missing_library(str(exc)):  # the board's, not the candidate's: no retry
                            raise EnvironmentFailure(f"a '{self.key}' board lacks OpenBLAS: {INSTALL_HINT}") from None
                        raise
                    return fn(remote, lib, remote.cpu())
                finally:
                    del remote
            except PlannerError:  # the work itself failed (e.g. training diverged): no retry
                raise
            except Exception as exc:  # a dropped connection or a timeout surfaces as TVM errors
                if attempt:
                    lost = last_line(exc)
                    try:
                        left = self.status().total
                    except BoardUnreachable as gone:
                        raise BoardLost(f"board lost ({lost}), and {first_line(gone)}") from None
                    if left == 0:
                        raise BoardLost(f"board lost: no '{self.key}' board is left at the tracker ({lost})") from None
                    raise CandidateFailed(f"the board's session died running this candidate, twice: {lost}") from None
        raise AssertionError("unreachable")

    def measure(self, artifact: Artifact, weights: dict[str, np.ndarray], repeats: int) -> Measurement:
        def on_board(remote, lib, dev) -> Measurement:
            reset, peak = _probe(remote, RESET_PEAK), _probe(remote, PEAK_RSS)
            rss0 = reset() if reset else None
            session = TrainingSession(lib, artifact.signature, weights, device=dev)
            latency = time_step(session, repeats, device=self.device)
            memory = None
            if rss0 is not None and peak is not None:
                memory = {
                    "peak_rss_growth_bytes": int(peak()) - int(rss0),
                    "method": "board process VmHWM during weight upload and timed steps, minus VmRSS before",
                }
            return Measurement(latency=latency, board=_address(remote, self.key), board_memory=memory)

        return self.run(artifact.entry, on_board)


class TrackerRunner(Runner):
    """A target's boards behind its tracker (`rpc:` section), one candidate in flight per board."""

    name = "rpc"
    kinds = frozenset({VM_LIBRARY})
    runs_here = False

    def __init__(self, target) -> None:
        super().__init__(target)
        self.pool = BoardPool.for_target(target)

    @property
    def device(self) -> str:
        return self.pool.device

    def capacity(self) -> int:
        return max(1, self.pool.check().total)

    def status(self) -> dict[str, str]:
        status, (host, port) = self.pool.check(), self.pool.tracker
        return {
            "boards": f"{status.total} under key '{self.pool.key}' at {host}:{port}, {status.free} free, "
            f"{status.pending} pending requests"
        }

    def measure(self, artifact: Artifact, weights: dict[str, np.ndarray], repeats: int) -> Measurement:
        self.check_kind(artifact)
        return self.pool.measure(artifact, weights, repeats)

    def train(self, artifact: Artifact, weights: dict[str, np.ndarray], work: Callable[[Session], T], *, threads: int = 0) -> T:
        self.check_kind(artifact)
        self.pool.check()

        def on_board(remote, lib, dev) -> T:
            session = TrainingSession(lib, artifact.signature, weights, device=dev)
            timed, heap = _probe(remote, TIMED_INVOKE), _probe(remote, HEAP)
            if timed is not None:  # the board times its own steps (a stock TVM server: the round trip)
                module = session.vm.module  # not `session`: a cycle would hold the board until a GC
                session.timed_invoke = lambda: float(timed(module, STEP_FUNC))
            if heap is not None:
                session.heap = lambda: None if (held := int(heap())) < 0 else held
            return work(session)

        return self.pool.run(artifact.entry, on_board)

    def latency_method(self, latency: Latency) -> str:
        return method(f"on a '{self.pool.key}' board over TVM RPC", latency)


def _remote_name(library: Path) -> str:
    """Each upload gets its own name in the session's work directory."""
    return f"{library.parent.name}-{library.name}"


def _probe(remote, name: str):
    try:
        return remote.get_function(name)
    except Exception:  # a stock TVM server has no planner probes
        return None


def _address(remote, key: str) -> str:
    """Which board: planner's probe names its host and server process; a stock server stays anonymous."""
    board_id = _probe(remote, BOARD_ID)
    return str(board_id()) if board_id else f"rpc:{key}"
