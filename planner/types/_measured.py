"""What was measured about a candidate: latency, memory, accuracy, its screen, and a trial's record of all of it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum

from planner.types._candidate import Candidate
from planner.types._metric import METRICS, Metric, metric_named


class TrialState(StrEnum):
    """A trial's state, as Optuna names it (`optuna.trial.TrialState.name`)."""

    COMPLETE = "COMPLETE"
    FAIL = "FAIL"
    PRUNED = "PRUNED"  # not counted: queued again after an environment failure, or a dead worker's
    RUNNING = "RUNNING"
    WAITING = "WAITING"

    @property
    def finished(self) -> bool:
        """Counted towards a study's trials: measured, or failed as a candidate."""
        return self in (TrialState.COMPLETE, TrialState.FAIL)


@dataclass(frozen=True)
class Latency:
    """Per-step latency over `repeats` timed repeats, each the mean of `number` back-to-back steps."""

    median: float  # ms
    p90: float  # ms
    min: float  # ms
    max: float  # ms
    repeats: int
    number: int
    device: str
    # how many of the pool's threads the step ran on (0: all): `planner run` runs it on as many
    threads: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes at the step's peak. `total` is their sum."""

    total: int
    activations: int  # everything else the step holds at its peak: batch, activations, new weights
    trainable_params: int
    gradients: int  # gradient buffers alive at the peak (fused updates never materialise theirs)
    optimizer_state: int
    frozen_params: int
    scratch: int = 0  # kernels' own workspace (TVM's workspace pool), held from first use on
    # not a part of `total`: how many more bytes of activations and gradients the same step
    # would hold at its peak without recomputation (negative: recomputation cost memory)
    recompute_saved: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AccuracyResult:
    """A fine-tune's val metric before and after it (accuracy for a classifier; the task's metric,
    `metric`, for another task: `Metric` says which way is better)."""

    before: float
    after: float
    loss_before: float
    loss_after: float | None  # None: the fine-tune diverged, its loss is not a number
    steps: int
    seconds: float
    diverged_at: int | None = None  # the step whose loss was NaN or Inf; the run stopped there
    metric: str = "accuracy"

    @property
    def measure(self) -> Metric:
        return metric_named(self.metric)

    @property
    def quality(self) -> float:
        """`after` where higher is better: how results of any metric are ranked."""
        return self.measure.quality(self.after)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> AccuracyResult | None:
        """The result `to_json` wrote, or None when a field is missing, extra, of the wrong type or
        out of range (a share in [0, 1], step counts whole and not negative)."""
        raw = {"metric": "accuracy", **raw}  # written before tasks: a classifier's accuracy
        if set(raw) != {f.name for f in fields(cls)} or raw["metric"] not in METRICS:
            return None
        r = cls(**raw)
        valid = (
            all(_number(v) and r.measure.valid(v) for v in (r.before, r.after))
            and _number(r.loss_before)
            and _number(r.seconds)
            and (r.loss_after is None or _number(r.loss_after))
            and _count(r.steps)
            and (r.diverged_at is None or _count(r.diverged_at))
        )
        return r if valid else None


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True)
class Fidelity:
    """How a trial's accuracy was measured in a multi-fidelity search (`planner.search.fidelity`):
    its short screening fine-tune, and whether it was then trained on to the full step count."""

    screen: AccuracyResult
    promoted: bool
    reason: str  # why it was (not) promoted, naming the trial that beat it
    against: tuple[int, ...] = ()  # the finished trials its screen was compared with

    def to_json(self) -> dict:
        return {"screen": self.screen.to_json(), "promoted": self.promoted, "reason": self.reason, "against": list(self.against)}

    @classmethod
    def from_json(cls, raw: object) -> Fidelity | None:
        """What `to_json` wrote, or None when any part is missing or malformed."""
        if not isinstance(raw, dict) or set(raw) != {"screen", "promoted", "reason", "against"}:
            return None
        screen = AccuracyResult.from_json(raw["screen"]) if isinstance(raw["screen"], dict) else None
        against = raw["against"]
        if (
            screen is None
            or not isinstance(raw["promoted"], bool)
            or not isinstance(raw["reason"], str)
            or not (isinstance(against, list) and all(_count(n) for n in against))
        ):
            return None
        return cls(screen, raw["promoted"], raw["reason"], tuple(against))


@dataclass(frozen=True)
class Measured:
    """A complete trial's candidate and its measurements, none of them missing (`TrialRecord.measured`)."""

    candidate: Candidate
    accuracy: AccuracyResult
    latency: Latency
    memory: MemoryBreakdown


SECONDS = ("compile_s", "tune_s", "measure_s", "accuracy_s")  # where a trial's time went, by stage


@dataclass
class TrialResult:
    """What one evaluation of a candidate measured (`Evaluator.evaluate`), filled in stage by
    stage so that a candidate failing late keeps what it measured. Its JSON is what a study
    stores as the trial's user attributes (`planner.search._attrs`, the one adapter) and what
    `trials.json` holds of it."""

    candidate: Candidate | None = None
    memory: MemoryBreakdown | None = None
    # the training graph's estimate put it over the RAM budget: neither compiled, measured nor
    # fine-tuned (`planner.backend.graph.estimate`)
    memory_estimated: bool = False
    library_bytes: int | None = None  # what the board stores to run the step
    tuned_kernels: int | None = None
    latency: Latency | None = None
    board: str | None = None
    board_memory: dict | None = None
    fidelity: Fidelity | None = None  # its screening fine-tune, in a multi-fidelity search
    accuracy: AccuracyResult | None = None
    fail_reason: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # by stage (`SECONDS`)

    def to_json(self) -> dict:
        """One key per measurement, none for what was not measured."""
        parts: dict[str, object] = {
            "candidate": self.candidate.to_json() if self.candidate else None,
            "memory": self.memory.to_json() if self.memory else None,
            "memory_estimated": True if self.memory_estimated else None,
            "library_bytes": self.library_bytes,
            "tuned_kernels": self.tuned_kernels,
            "latency": self.latency.to_json() if self.latency else None,
            "board": self.board,
            "board_memory": self.board_memory,
            "fidelity": self.fidelity.to_json() if self.fidelity else None,
            "accuracy": self.accuracy.to_json() if self.accuracy else None,
            "fail_reason": self.fail_reason,
            **self.seconds,
        }
        return {k: v for k, v in parts.items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> TrialResult:
        """The result `to_json` wrote (other keys ignored: a trial has attributes of its own)."""
        cand = d.get("candidate")
        return cls(
            candidate=Candidate.from_json(cand) if cand else None,
            memory=MemoryBreakdown(**d["memory"]) if d.get("memory") else None,
            memory_estimated=bool(d.get("memory_estimated", False)),
            library_bytes=d.get("library_bytes"),
            tuned_kernels=d.get("tuned_kernels"),
            latency=Latency(**d["latency"]) if d.get("latency") else None,
            board=d.get("board"),
            board_memory=d.get("board_memory"),
            fidelity=Fidelity.from_json(d["fidelity"]) if d.get("fidelity") else None,
            accuracy=AccuracyResult(**d["accuracy"]) if d.get("accuracy") else None,
            fail_reason=d.get("fail_reason"),
            seconds={k: float(d[k]) for k in SECONDS if d.get(k) is not None},
        )


@dataclass
class TrialRecord:
    """One evaluated candidate as plain data: what was tried, what was measured, or why it failed."""

    number: int
    state: TrialState
    candidate: Candidate | None
    accuracy: AccuracyResult | None = None
    latency: Latency | None = None
    memory: MemoryBreakdown | None = None
    feasible: bool = False
    fail_reason: str | None = None
    board: str | None = None
    board_memory: dict | None = None
    library_bytes: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    over_budget: dict[str, float] = field(default_factory=dict)  # budget -> how far over (its unit)
    worker: str | None = None  # host:pid of the process that ran it
    seed: int | None = None  # its fine-tune's seed (a resumed study may mix seeds)
    fidelity: Fidelity | None = None  # its screening fine-tune, in a multi-fidelity search
    # its memory is the estimate from the training graph, which put it over the RAM budget: it was
    # neither compiled, measured nor fine-tuned (`planner.backend.graph.estimate`)
    memory_estimated: bool = False

    def __post_init__(self) -> None:
        self.state = TrialState(self.state)

    @property
    def complete(self) -> bool:
        return self.state is TrialState.COMPLETE and self.accuracy is not None

    @property
    def ended_over_budget(self) -> bool:
        """Ended by its memory before it was measured: its estimate put it over the RAM budget
        (`memory_estimated`: nothing was built) or the board's linker refused its image."""
        return self.state is TrialState.COMPLETE and self.accuracy is None and self.memory is not None

    @property
    def screened_out(self) -> bool:
        """Complete, within every budget, but its accuracy only measured by a short screening
        fine-tune: another trial was better by then (`fidelity.reason` says which)."""
        return (
            self.complete and self.fidelity is not None and not self.fidelity.promoted and set(self.over_budget) == {"screened"}
        )

    def measured(self) -> Measured:
        """The candidate and its accuracy, latency and memory, for a complete trial: it has all four
        (the objective returns, and the trial completes, only once they are recorded)."""
        cand, acc, lat, mem = self.candidate, self.accuracy, self.latency, self.memory
        assert cand is not None and acc is not None and lat is not None and mem is not None, (
            f"trial {self.number} lacks a measurement: it is not complete"
        )
        return Measured(cand, acc, lat, mem)

    @classmethod
    def of(
        cls,
        number: int,
        state: TrialState | str,
        result: TrialResult,
        constraints: dict[str, float],
        *,
        worker: str | None = None,
        seed: int | None = None,
    ) -> TrialRecord:
        """The record of a trial in `state` (a name Optuna or trials.json wrote) that measured
        `result` and met or broke `constraints` (feasible: all <= 0)."""
        rec = cls(
            number=number,
            state=TrialState(state),
            candidate=result.candidate,
            accuracy=result.accuracy,
            latency=result.latency,
            memory=result.memory,
            fail_reason=result.fail_reason,
            board=result.board,
            board_memory=result.board_memory,
            library_bytes=result.library_bytes,
            seconds=dict(result.seconds),
            over_budget={k: v for k, v in constraints.items() if v > 0},
            worker=worker,
            seed=seed,
            fidelity=result.fidelity,
            memory_estimated=result.memory_estimated,
        )
        rec.feasible = rec.complete and all(c <= 0 for c in constraints.values())
        return rec

    def to_json(self) -> dict:
        """Everything measured about the trial, as `trials.json` in a plan directory keeps it."""
        parts = {
            "candidate": self.candidate.to_json() if self.candidate else None,
            "accuracy": self.accuracy.to_json() if self.accuracy else None,
            "latency": self.latency.to_json() if self.latency else None,
            "memory": self.memory.to_json() if self.memory else None,
        }
        return {
            "number": self.number,
            "state": self.state.value,
            "feasible": self.feasible,
            **parts,
            "over_budget": self.over_budget,
            "fail_reason": self.fail_reason,
            "board": self.board,
            "board_memory": self.board_memory,
            "library_bytes": self.library_bytes,
            "seconds": self.seconds,
            "worker": self.worker,
            "seed": self.seed,
            "fidelity": self.fidelity.to_json() if self.fidelity else None,
            "memory_estimated": self.memory_estimated,
        }

    @classmethod
    def from_json(cls, d: dict) -> TrialRecord:
        result = TrialResult.from_json({**d, **d.get("seconds", {})})
        rec = cls.of(d["number"], d["state"], result, d.get("over_budget", {}), worker=d.get("worker"), seed=d.get("seed"))
        rec.feasible = bool(d["feasible"])
        return rec
