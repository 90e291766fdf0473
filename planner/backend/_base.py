"""What a back end is: it turns a candidate into an artifact a runner can execute.

After MetaSchedule's split of a `Builder` from a `Runner`: a back end (here) knows how a training
step is compiled and what it costs in memory; a runner (`planner.measurement`) knows where the step
runs and how to time and train it there. A hardware target names one of each (`backend:`,
`runner:`), and the pipeline — search, plans, `run`, `compile` — sees only these interfaces, so a
second back end (a bare-metal C step, say) is one module registered in `planner.backend.BACKENDS`.

No TVM is imported here: the interfaces are plain data and abstract methods.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NewType

from planner.errors import CandidateFailed
from planner.types import MemoryBreakdown, StepSignature

if TYPE_CHECKING:
    from planner.inputs.model import Model
    from planner.inputs.targets import HardwareTarget
    from planner.types import Candidate

# Every file of an artifact is named `train_step.*`: a plan directory holds them beside files of its
# own (plan.json, weights.npz, the model's external data), and this stem is reserved for them.
ARTIFACT_STEM = "train_step"


# What an artifact's files are, named by the back end that makes them (`Backend.kind`, "relax-vm"),
# so a runner can tell whether it can execute them (`Runner.kinds`) and plan.json can record it.
ArtifactKind = NewType("ArtifactKind", str)


@dataclass(frozen=True, kw_only=True)
class Artifact:
    """A training step on disk: its files, what they are, and how to call the step.

    This much is what a plan directory records (`plan.json`'s `step`), so a step read back from a
    plan is an `Artifact` too."""

    kind: ArtifactKind
    files: tuple[Path, ...]  # every one named `ARTIFACT_STEM.*`; the first is the step's entry point
    signature: StepSignature
    requires: tuple[str, ...] = ()  # packages the step needs where it runs (pip install them there)

    @property
    def entry(self) -> Path:
        return self.files[0]

    @property
    def stored_bytes(self) -> int:
        """What the board stores to run the step: the bytes of its files (the flash budget's measure)."""
        return sum(f.stat().st_size for f in self.files)


@dataclass(frozen=True, kw_only=True)
class BuiltArtifact(Artifact):
    """An artifact as a back end built it: with its planned memory and what the build cost."""

    memory: MemoryBreakdown
    compile_seconds: float  # including tuning
    cached: bool  # loaded from the compile cache, not built now
    kernels: int = 0  # compiled kernels in the step
    tuned_kernels: tuple[str, ...] = ()  # those scheduled from a tuning database
    tune_seconds: float = 0.0  # tuning time within compile_seconds
    in_place_updates: int = 0  # updated weights and states written over their old buffers


@dataclass(frozen=True)
class MemoryEstimate:
    """A step's peak memory told from its training graph before it is built
    (`planner.backend.graph.estimate`), and the smallest total the built step could plan by the
    estimate's measured error: a candidate whose `at_least` is over the RAM budget is over it."""

    memory: MemoryBreakdown
    at_least: int


class DoesNotFit(CandidateFailed):
    """A step the board's toolchain refused because it overflows the board's memory: not a
    failure of the candidate but a candidate over budget, which a search ranks as infeasible by
    how far it is over (a memory estimate can miss by more than its error on a board whose own
    regions are the bound). `memory` and `flash_bytes` are what the step would need (None: not
    known), `overflow` the bytes the board lacks ("ram", "flash": a target's budgets by name)."""

    def __init__(self, message: str, *, memory: MemoryBreakdown, flash_bytes: int | None, overflow: dict[str, int]) -> None:
        super().__init__(message)
        self.memory, self.flash_bytes, self.overflow = memory, flash_bytes, overflow


@dataclass(frozen=True)
class Provenance:
    """How a back end's figures in a plan were obtained, in words a reader of plan.json needs."""

    memory: str
    schedules: str


class Backend(abc.ABC):
    """Builds candidates' training steps for one target (its compiler, cache and tuning)."""

    name: ClassVar[str]  # as a target's `backend:` names it
    kind: ClassVar[ArtifactKind]  # what `build` makes

    def __init__(self, target: HardwareTarget, *, cache_dir: Path, tune_trials: int = 0) -> None:
        self.target, self.cache_dir, self.tune_trials = target, cache_dir, tune_trials

    @classmethod
    @abc.abstractmethod
    def check(cls, target: HardwareTarget) -> str:
        """What `target` compiles for with this back end, in words (`planner targets check`);
        `BadInput` when its settings are not ones this back end can build for."""

    @abc.abstractmethod
    def build(self, model: Model, candidate: Candidate) -> BuiltArtifact:
        """The candidate's step for the target, from the cache when it is there. Raises
        `CandidateFailed` when the candidate cannot be built, `EnvironmentFailure` when the
        machine failed (disk, compiler)."""

    def estimate(self, model: Model, candidate: Candidate) -> MemoryEstimate | None:
        """The step's peak memory before building it, or None when this back end cannot tell one
        (or building costs no more: the step is in the cache). A search builds only the candidates
        whose estimate is not over the RAM budget."""
        return None

    @abc.abstractmethod
    def host_build(self, model: Model, candidate: Candidate) -> BuiltArtifact:
        """The same step built to run in this process (the `local` runner): the fine-tune that
        measures accuracy runs on the planning host, whatever the board."""

    @abc.abstractmethod
    def provenance(self, artifact: BuiltArtifact) -> Provenance:
        """How the artifact's memory was planned and its kernels scheduled."""
