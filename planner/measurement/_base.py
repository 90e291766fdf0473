"""What a runner is: it executes a back end's artifact where the target's step runs.

A runner times a step, trains with it (`planner run`) and says how many steps it can measure at
once; the back end (`planner.backend`) says nothing about where a step runs. `local` runs here,
`rpc` on boards behind a TVM RPC tracker; a target names its runner (`runner:`), and a runner
lists the artifact kinds it can execute, so a target pairing a back end with a runner that cannot
run its artifacts is refused before anything is built.

No TVM is imported here: a board with only TVM's runtime imports this package too.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

import numpy as np

from planner.errors import BadInput
from planner.types import Latency, StepSignature

if TYPE_CHECKING:
    from planner.backend._base import Artifact, ArtifactKind
    from planner.inputs.targets import HardwareTarget

T = TypeVar("T")


@dataclass(frozen=True)
class Measurement:
    latency: Latency
    board: str  # "local" or the board's address
    board_memory: dict | None = None  # {peak_rss_growth_bytes, method}, where the board reports it

    def to_json(self) -> dict:
        return asdict(self)


class Session(Protocol):
    """A step loaded on its device with a full set of weights: what `Runner.train`'s work gets."""

    sig: StepSignature

    def step(self, x, y: np.ndarray) -> float: ...

    def evaluate_chunks(self, chunks) -> tuple[float, float]: ...

    def weights(self) -> dict[str, np.ndarray]: ...


class Runner(abc.ABC):
    """Where one target's steps run: measured, trained, counted."""

    name: ClassVar[str]  # as a target's `runner:` names it
    kinds: ClassVar[frozenset[ArtifactKind]]  # the artifacts it can execute
    runs_here: ClassVar[bool]  # in this process: a build for the target runs the fine-tune as is
    # its milliseconds are computed from a count (instructions at a clock), not timed: reports say so
    latency_estimated: ClassVar[bool] = False

    def __init__(self, target: HardwareTarget) -> None:
        self.target = target

    @property
    @abc.abstractmethod
    def device(self) -> str:
        """Where a measurement was taken, as plans and reports name it (`local`, `rpc:KEY`)."""

    @classmethod
    def check_kind(cls, artifact: Artifact) -> None:
        """Refuses an artifact this runner cannot execute (a target pairing the wrong back end)."""
        if artifact.kind not in cls.kinds:
            known = ", ".join(sorted(cls.kinds))
            raise BadInput(f"the {cls.name} runner cannot execute a {artifact.kind} step (it runs: {known})")

    def capacity(self) -> int:
        """How many steps can be measured at once; also fails fast (`BoardUnreachable`, exit 3)
        when the place the steps run is unreachable."""
        return 1

    def status(self) -> dict[str, str]:
        """What `planner targets --check` shows of the runner beyond the device (boards free, ...)."""
        return {}

    @abc.abstractmethod
    def measure(self, artifact: Artifact, weights: dict[str, np.ndarray], repeats: int) -> Measurement:
        """The step's latency (and, where the device reports it, its memory) over `repeats` repeats."""

    @abc.abstractmethod
    def train(self, artifact: Artifact, weights: dict[str, np.ndarray], work: Callable[[Session], T], *, threads: int = 0) -> T:
        """`work(session)`, the session holding the step and `weights` on the device; its result.
        `threads`: the step's threads where the runner runs it in this process (0: all); the
        caller's thread has its whole pool back afterwards. A step this machine cannot load
        (built for another) is `StepNotLoadable`."""

    @abc.abstractmethod
    def latency_method(self, latency: Latency) -> str:
        """How a latency it measured was timed, for plan.json's `measurement.latency`."""
