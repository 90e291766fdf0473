"""What a long command shows on stderr while it runs, and what Ctrl-C does to it.

On a terminal: a live bar (trials done/total counting every worker's, best feasible so far, ETA)
with one line per finished trial above it. Not on a terminal, or with --quiet: nothing, so logs and
pipes hold only results. -v: one plain line per trial and planner's debug log, terminal or not.

Ctrl-C once: the trials in flight finish (or fail) cleanly, no new one starts, and the plan is
written from the finished trials. Ctrl-C twice: stop at once; finished trials are still kept.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from planner.cli._errors import as_flags
from planner.types import AccuracyResult, Measured, TrialRecord, TrialState


class _ConsoleHandler(logging.Handler):
    """Log lines through the rich console, so they print above a live progress bar, unwrapped."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        self.console.print(self.format(record), markup=False, highlight=False, soft_wrap=True)


class _NoteHandler(logging.Handler):
    """planner's warnings without -v: a line each, as `note` prints them (`warning: ...`)."""

    def __init__(self, console: Console) -> None:
        super().__init__(logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        self.console.print(f"warning: {as_flags(record.getMessage())}", markup=False, highlight=False, soft_wrap=True)


def configure_logging(console: Console, verbose: bool) -> None:
    """-v: planner's debug log on stderr (TVM and Optuna stay at warnings); without, its warnings
    alone, one line each."""
    logger = logging.getLogger("planner")
    if verbose:
        logger.addHandler(_ConsoleHandler(console))
        logger.setLevel(logging.DEBUG)
    else:
        logger.addHandler(_NoteHandler(console))


def trial_line(rec: TrialRecord, done: int, total: int) -> str:
    if rec.state is TrialState.PRUNED:
        return f"trial {rec.number:>3} ({done}/{total}) cut short: {rec.fail_reason or 'interrupted; queued again'}"
    if rec.ended_over_budget and rec.memory is not None:
        kib = rec.memory.total / 1024
        if rec.memory_estimated:
            return f"trial {rec.number:>3} ({done}/{total}) over estimated {kib:>10,.1f} KiB, beyond the RAM budget: not compiled"
        over = " and ".join({"ram_budget": "RAM", "flash_budget": "flash"}.get(b, b) for b in rec.over_budget)
        return f"trial {rec.number:>3} ({done}/{total}) over linked {kib:>10,.1f} KiB, beyond the board's {over}: not run"
    if not rec.complete:
        return f"trial {rec.number:>3} ({done}/{total}) FAIL {rec.fail_reason}"
    # screened out: within budget, only beaten at its short fine-tune ("over" would read as over budget)
    flag = "ok  " if rec.feasible else "screened" if rec.screened_out else "over"
    measured = rec.measured()
    cand = measured.candidate
    trainable = ",".join(f"{n}:{m}" for n, m in cand.trainable)
    return (
        f"trial {rec.number:>3} ({done}/{total}) {flag} {_metric(measured.accuracy)}  "
        f"{measured.latency.median:7.2f} ms  {measured.memory.total / 1024:>10,.1f} KiB  batch {cand.batch_size:<3} {trainable}"
    )


def _metric(acc: AccuracyResult) -> str:
    """`acc 0.946`, `mse 0.0123`: a fine-tune's result as a trial's line shows it."""
    return f"{acc.measure.short} {acc.measure.text(acc.after)}"


class TrialProgress:
    """Progress of a study, fed by `run_study`'s `on_start` and `on_trial`."""

    def __init__(self, console: Console, quiet: bool, verbose: bool) -> None:
        self.console = console
        self.lines = verbose or (console.is_terminal and not quiet)
        self.bar: Progress | None = None
        if console.is_terminal and not quiet:
            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[note]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
                transient=True,
            )
        self._task: TaskID | None = None
        self._data: TaskID | None = None
        self._best: Measured | None = None

    def __enter__(self) -> TrialProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def data(self, done: int, total: int) -> None:
        """The data being read and checked, before the first trial (images decoded once)."""
        if self.bar is None:
            return
        if self._data is None:
            self._data = self.bar.add_task("reading data", total=total, note="")
        self.bar.update(self._data, completed=done)
        if done >= total:
            self.bar.remove_task(self._data)

    def start(self, done: int, total: int) -> None:
        if self.bar is not None:
            self._task = self.bar.add_task("trials", total=total, completed=min(done, total), note="best feasible —")

    def trial(self, rec: TrialRecord, done: int, total: int) -> None:
        if rec.feasible:  # a feasible trial is complete
            measured = rec.measured()
            if self._best is None or measured.accuracy.quality > self._best.accuracy.quality:
                self._best = measured
        if self.lines:
            self.console.print(trial_line(rec, done, total), markup=False, highlight=False, soft_wrap=True)
        if self.bar is not None and self._task is not None:
            best = self._best
            summary = (
                f"{_metric(best.accuracy)}, {best.latency.median:.2f} ms, {best.memory.total / 1024:,.0f} KiB" if best else "—"
            )
            self.bar.update(self._task, completed=min(done, total), note=f"best feasible {summary}")


@contextmanager
def graceful_interrupt(console: Console) -> Iterator[threading.Event]:
    """The first Ctrl-C or SIGTERM sets the event (the study stops after its trials in flight);
    the second raises KeyboardInterrupt, which ends the trial in flight at once and queues its
    candidate again. A service manager's SIGTERM (systemd, docker stop, a CI timeout) thus
    stops a study as gently as Ctrl-C does, instead of killing it mid-trial."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        console.print(f"{what}: stopping after the trials in flight (Ctrl-C again to stop now)", markup=False, highlight=False)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
