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


class NoFeasiblePlan(PlannerError):
    """The study finished, but no candidate met the target's budgets."""

    exit_code = 1


class MeasureFailed(PlannerError):
    """`planner measure`: the scheme could not be built or run (the reason says why)."""

    exit_code = 1


class CandidateFailed(Exception):
    """One candidate could not be built, compiled or run: a failed trial, never a dead study."""


class BoardUnreachable(PlannerError):
    """The RPC tracker cannot be reached, or it has no board under the requested key."""

    exit_code = 3


class BoardLost(Exception):
    """A board disconnected, crashed or overran its session while measuring (retried once)."""
