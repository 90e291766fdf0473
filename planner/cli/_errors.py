"""The one place planner's errors become what a command prints: one line on stderr, an exit code.

Library errors name parameters as the Python API does, in backticks (`` `out` ``, `` `trials` ``);
here they become the flags a command user typed (`--out`, `--trials`). Exit codes: 1 no feasible
plan or a failed measurement, 2 bad input or an environment failure, 3 boards unreachable or
lost, 130 interrupted.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TypeVar

import typer

from planner.cli._output import stderr

T = TypeVar("T")

# API parameter -> the flag that sets it, for what is not a setting (`flags`)
_FLAGS = {
    "tracker": "--tracker",
    "key": "--key",
    "storage": "--storage",
    "study": "--study",
    "out": "--out",
    "steps": "--steps",
    "target": "--target",
    "host": "--host",
    "allow_remote": "--allow-remote",
    "tokenizer": "--tokenizer",
}


@functools.cache
def flags() -> dict[str, str]:
    """API parameter -> the flag that sets it: the commands' own and every setting's
    (`Settings.flag`; none on a board's install, which has no settings)."""
    try:
        from planner.inputs.settings import Settings
    except ImportError:
        return _FLAGS
    return {n: flag for n in Settings.model_fields if (flag := Settings.flag(n)) is not None} | _FLAGS


_PARAM = re.compile(r"`([a-z_]+)`")
INTERRUPTED = 130
LEARNED_NOTHING = 4  # a plan was written, but its fine-tune did not beat the model's start


def as_flags(message: str) -> str:
    """`message` with the API's parameter names replaced by the command's flags."""
    return _PARAM.sub(lambda m: flags().get(m.group(1), m.group(0)), message)


def fail(exc: Exception | str, code: int) -> typer.Exit:
    stderr.print(f"error: {as_flags(str(exc))}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def guard(fn: Callable[[], T]) -> T:
    """Run a command body, turning planner's errors into one line + exit code."""
    from planner.errors import PlannerError

    try:
        return fn()
    except PlannerError as exc:
        raise fail(exc, exc.exit_code) from None
    except MemoryError:
        # the data or a step needs more memory than this process may have (RAM or `ulimit -v`)
        raise fail("out of memory: the dataset or the training step does not fit in the memory this process may use", 2) from None
    except KeyboardInterrupt:
        stderr.print("interrupted: finished trials are kept; rerun the same command to resume")
        raise typer.Exit(INTERRUPTED) from None
