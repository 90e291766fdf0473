"""Typed errors. The CLI turns each into one line on stderr and its exit code; nothing else does."""

from __future__ import annotations

import errno
import sqlite3


class PlannerError(Exception):
    """Base of every error planner reports to a user (never a traceback)."""

    exit_code = 1


class BadInput(PlannerError):
    """The user's model, dataset, target, space or flags cannot be used as given."""

    exit_code = 2


class UnsupportedOp(BadInput):
    """A layer the search space wants to train depends on an op planner cannot differentiate."""


class OutputUnwritable(BadInput):
    """The output directory cannot be used: not a directory, read-only, or out of disk space
    (for the plan files or the study storage kept in it). Exit 2: the user's --out, as given,
    cannot hold the result; nothing half-written is left in it."""


class StepNotLoadable(BadInput):
    """A compiled step this machine cannot load: built for another one (`planner run` of a plan
    made for a board, without the board's target)."""


class NoFeasiblePlan(PlannerError):
    """The study finished, but no candidate met the target's budgets."""

    exit_code = 1


class MeasureFailed(PlannerError):
    """`planner measure`: the scheme could not be built or run (the reason says why)."""

    exit_code = 1


class CandidateFailed(Exception):
    """One candidate could not be built, compiled or run: a failed trial, never a dead study."""


class NotTheCandidates(PlannerError):
    """A failure that is not the candidate's: a trial hit by it is never a finished trial. The
    search queues its candidate again, stops, and the run ends with this one line and its exit
    code; rerunning once the cause is fixed measures exactly the missing trials."""


class EnvironmentFailure(NotTheCandidates):
    """The machine planner runs on (its cache, disk, toolchain) failed (exit 2)."""

    exit_code = 2


class PlannerBug(NotTheCandidates):
    """planner failed at what its operator table promises: building the gradient of a model whose
    operators all train or run frozen there, or compiling such a step. A bug in planner, never a
    trial failure the user has to read a TVM message about (exit 70, EX_SOFTWARE)."""

    exit_code = 70

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"planner bug: {what} ({detail}); please report it with the model")


class BoardUnreachable(EnvironmentFailure):
    """The RPC tracker cannot be reached, or it has no board under the requested key."""

    exit_code = 3


class BoardLost(BoardUnreachable):
    """Every board of the key is gone, or the tracker is, while a trial measured on one (after
    one retry): the boards' failure, not the candidate's (exit 3). A board whose session died
    while it stays registered ran the candidate and crashed on it: that is `CandidateFailed`."""


def first_line(exc: BaseException) -> str:
    """An exception's first line (its headline), or its type when it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def last_line(exc: BaseException) -> str:
    """An exception's last line (where TVM puts the actual check that failed), or its type."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


DISK_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (over the file size limit, see `ulimit -f`)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def reason(exc: OSError) -> str:
    known = DISK_REASONS.get(exc.errno) if exc.errno is not None else None
    return known or (exc.strerror or str(exc)).lower()


def disk_problem(exc: BaseException | None) -> tuple[str, str | None] | None:
    """(reason, file or None) when a write failed for want of room or write access, found
    anywhere along `exc`'s chain (Optuna and SQLAlchemy wrap SQLite's own error); else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_REASONS:
            return DISK_REASONS[exc.errno], exc.filename if isinstance(exc.filename, str) else None
        if isinstance(exc, sqlite3.Error):
            message = str(exc)
            if "database or disk is full" in message:
                return DISK_REASONS[errno.ENOSPC], None
            if "readonly database" in message:
                return DISK_REASONS[errno.EROFS], None
        exc = exc.__cause__ or exc.__context__
    return None
