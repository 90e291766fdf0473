"""Typed errors. The CLI turns each into one line on stderr and its exit code; nothing else does."""

from __future__ import annotations


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


class NoFeasiblePlan(PlannerError):
    """The study finished, but no candidate met the target's budgets."""

    exit_code = 1


class MeasureFailed(PlannerError):
    """`planner measure`: the scheme could not be built or run (the reason says why)."""

    exit_code = 1


class Interrupted(PlannerError):
    """Ctrl-C: the trials in flight finished, no new one started; `result` is the plan written
    from the finished trials, if any was feasible."""

    exit_code = 130

    def __init__(self, message: str, result: object | None = None) -> None:
        super().__init__(message)
        self.result = result


class CandidateFailed(Exception):
    """One candidate could not be built, compiled or run: a failed trial, never a dead study."""


class BoardUnreachable(PlannerError):
    """The RPC tracker cannot be reached, or it has no board under the requested key."""

    exit_code = 3


class BoardLost(Exception):
    """A board disconnected, crashed or overran its session while measuring (retried once)."""


def first_line(exc: BaseException) -> str:
    """An exception's first line (its headline), or its type when it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def last_line(exc: BaseException) -> str:
    """An exception's last line (where TVM puts the actual check that failed), or its type."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else type(exc).__name__
