"""Build a candidate's training step for its target, by job: the training graph (`graph`), its
lowering for a target (`lower`, with the sgemm kernels in `sgemm`), and the back ends that generate
code from it (`vm`, `mcu`), whose artifacts one build cache keeps (`cache`). With `planner.runtime`
and `planner.measurement`, the only packages that import TVM.

A back end is one subpackage implementing `Backend` (`_base.py`), registered in `BACKENDS` by the
name a target's `backend:` gives; it loads on first use, so `import planner.backend` loads no TVM.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from planner.backend._base import ARTIFACT_STEM, Artifact, ArtifactKind, Backend, BuiltArtifact, DoesNotFit, Provenance
from planner.errors import BadInput

if TYPE_CHECKING:
    from planner.inputs.targets import HardwareTarget

__all__ = [
    "ARTIFACT_STEM",
    "BACKENDS",
    "Artifact",
    "ArtifactKind",
    "Backend",
    "BuiltArtifact",
    "DoesNotFit",
    "Provenance",
    "backend_class",
    "backend_for",
]

# a target's `backend:` -> "module:class" of its implementation
BACKENDS: dict[str, str] = {"vm": "planner.backend.vm:VmBackend", "c": "planner.backend.mcu:CBackend"}


def backend_class(name: str) -> type[Backend]:
    where = BACKENDS.get(name)
    if where is None:
        raise BadInput(f"unknown back end {name!r} (known: {', '.join(sorted(BACKENDS))})")
    module, cls = where.split(":")
    return getattr(importlib.import_module(module), cls)


def backend_for(target: HardwareTarget, *, cache_dir: Path, tune_trials: int = 0) -> Backend:
    """The back end `target` names, building into `cache_dir` with `tune_trials` tuning trials per step."""
    return backend_class(target.backend)(target, cache_dir=cache_dir, tune_trials=tune_trials)
