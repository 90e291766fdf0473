"""The `local` runner: a step run in this process, on this machine's CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

from planner.backend._base import Artifact
from planner.backend.vm import VM_LIBRARY
from planner.errors import StepNotLoadable, last_line
from planner.measurement._base import Measurement, Runner, Session
from planner.measurement.latency import method, time_step
from planner.runtime.session import TrainingSession
from planner.runtime.threads import use_threads
from planner.types import Latency

T = TypeVar("T")


def local_session(artifact: Artifact, weights: dict[str, np.ndarray]) -> TrainingSession:
    """`artifact` loaded in this process with `weights` (a VM library: the only kind run here)."""
    LocalRunner.check_kind(artifact)
    return TrainingSession(artifact.entry, artifact.signature, weights)


class LocalRunner(Runner):
    name = "local"
    kinds = frozenset({VM_LIBRARY})
    runs_here = True

    @property
    def device(self) -> str:
        return "local"

    def measure(self, artifact: Artifact, weights: dict[str, np.ndarray], repeats: int) -> Measurement:
        latency = time_step(local_session(artifact, weights), repeats, device=self.device, set_threads=use_threads)
        return Measurement(latency=latency, board=self.device)

    def train(self, artifact: Artifact, weights: dict[str, np.ndarray], work: Callable[[Session], T], *, threads: int = 0) -> T:
        self.check_kind(artifact)
        try:
            session = local_session(artifact, weights)
        except Exception as exc:  # noqa: BLE001 - TVM raises TVMError, OSError, ... for a library it cannot load
            raise StepNotLoadable(f"cannot load {artifact.entry.name} on this machine ({last_line(exc)})") from None
        use_threads(threads)
        try:
            return work(session)
        finally:
            use_threads(0)

    def latency_method(self, latency: Latency) -> str:
        return method("in-process on this machine", latency)
