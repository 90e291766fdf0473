"""Measure a compiled step where its target runs it: this machine, or a board behind a TVM RPC tracker.

Only this package knows one place from another; the pipeline asks `runner_for(target)` and gets a
`Runner` (`_base.py`), whichever it is. A runner is one module, registered in `RUNNERS` by the name
a target's `runner:` gives; modules load on first use (the RPC runner needs TVM, and a board with
only TVM's runtime imports this package).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from planner.errors import BadInput
from planner.measurement._base import Measurement, Runner, Session

if TYPE_CHECKING:
    from planner.inputs.targets import HardwareTarget

__all__ = ["RUNNERS", "Measurement", "Runner", "Session", "runner_for"]

# a target's `runner:` -> "module:class" of its implementation
RUNNERS: dict[str, str] = {
    "local": "planner.measurement.local:LocalRunner",
    "rpc": "planner.measurement.rpc:TrackerRunner",
    "qemu": "planner.measurement.qemu:QemuRunner",
}


def runner_for(target: HardwareTarget) -> Runner:
    """The runner `target` names, ready to use (nothing is contacted yet); a target whose back end
    builds what its runner cannot execute is refused here, before anything is built."""
    from planner.backend import backend_class

    where = RUNNERS.get(target.runner)
    if where is None:
        raise BadInput(f"target {target.name}: unknown runner {target.runner!r} (known: {', '.join(sorted(RUNNERS))})")
    module, name = where.split(":")
    cls: type[Runner] = getattr(importlib.import_module(module), name)
    try:
        kind = backend_class(target.backend).kind
    except BadInput as exc:
        raise BadInput(f"target {target.name}: {exc}") from None
    if kind not in cls.kinds:
        raise BadInput(
            f"target {target.name}: the {cls.name} runner cannot execute what the {target.backend} back end builds ({kind})"
        )
    return cls(target)
