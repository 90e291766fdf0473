"""Two trials in flight on this machine, in an order that does not depend on thread timing."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from planner.search._storage import ProcessStorage


class _Pipeline:
    """Two trials in flight on this machine, in a fixed order: trial k is sampled once trial k-1
    has been timed, compiles while k-1 fine-tunes, and is timed once k-1 has ended, so a compile
    overlaps the previous fine-tune but never a latency measurement (which always runs alone).

    Trials are ordered by when this process started them (`attach`: the storage tells in
    trial-number order), never by which thread gets where first, so a seeded study proposes the
    same candidates every run: each is sampled knowing every earlier trial's result but its
    predecessor's, and screened against every earlier trial."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._tickets: dict[int, int] = {}  # trial id -> its place in this process's order
        self._timed: set[int] = set()
        self._ended: set[int] = set()
        self._exited: dict[int, float] = {}  # ticket -> when its objective ended
        self._alone: set[int] = set()  # tickets that run with no other trial in flight
        self._broken = False

    @contextlib.contextmanager
    def attach(self, storage: ProcessStorage) -> Iterator[_Pipeline]:
        """Give each trial this process starts (created, or popped from the queue) its ticket;
        on leaving, nobody waits any more."""
        try:
            with storage.listen(self.started):
                yield self
        finally:
            self.abort()

    def started(self, trial_id: int) -> None:
        """Trial `trial_id` is this process's next (the storage calls it in trial-number order)."""
        with self._cond:
            self._tickets[trial_id] = len(self._tickets)

    TELL_S = 60.0  # a trial left its objective this long ago and is still not told: its tell failed

    def _after(self, trial_id: int, done: Callable[[int], bool]) -> None:
        """Wait until `done(t)` (under the lock) for every earlier ticket t, or the pipeline is broken.

        Every earlier one, not just the one before: a trial that fails to compile ends while the
        one before it still fine-tunes, and the trial after it would be screened without that one."""
        with self._cond:
            ticket = self._tickets.get(trial_id, 0)

            def told(t: int) -> bool:
                if done(t):
                    return True
                left = self._exited.get(t)  # (so its callbacks never ran: do not wait for ever)
                return left is not None and time.monotonic() - left > self.TELL_S

            def ready() -> bool:
                return self._broken or all(told(t) for t in range(ticket))

            while not self._cond.wait_for(ready, timeout=1.0):
                pass

    def before_sampling(self, trial_id: int) -> None:
        # after a trial that runs alone, the next waits for its end, not its timing; a trial says
        # so (run_alone) before it can be timed, so the test is made when it is timed or ended
        self._after(trial_id, lambda t: t in self._ended or (t in self._timed and t not in self._alone))

    def run_alone(self, trial_id: int) -> None:
        """Returns once the trial before has ended; the next waits for this one's end (a candidate
        suspected of crashing the process must not take another trial down with it)."""
        with self._cond:
            if trial_id in self._tickets:
                self._alone.add(self._tickets[trial_id])
        self.before_timing(trial_id)

    def before_timing(self, trial_id: int) -> None:
        self._after(trial_id, self._ended.__contains__)

    def exited(self, trial_id: int) -> None:
        """The trial's objective returned or raised: Optuna tells it next."""
        with self._cond:
            if trial_id in self._tickets:
                self._exited[self._tickets[trial_id]] = time.monotonic()
        self.timed(trial_id)

    def timed(self, trial_id: int) -> None:
        """The trial's latency is measured, or it will not be (it failed first, or it ended)."""
        with self._cond:
            if trial_id in self._tickets:
                self._timed.add(self._tickets[trial_id])
            self._cond.notify_all()

    def ended(self, trial_id: int) -> None:
        """The trial is told: the next may be timed and screened against it."""
        with self._cond:
            if trial_id in self._tickets:
                self._timed.add(self._tickets[trial_id])
                self._ended.add(self._tickets[trial_id])
            self._cond.notify_all()

    def abort(self) -> None:
        """Nobody waits any more (the study stopped on an error)."""
        with self._cond:
            self._broken = True
            self._cond.notify_all()
