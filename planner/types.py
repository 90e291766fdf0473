"""The types planner's stages pass along: what a candidate is and what was measured about it.

Plain data, no TVM and no Optuna: a report, the progress bar or a script reads trials without
loading a compiler. Enumerations are `StrEnum`s, so each compares equal to the string that plans,
spaces and Optuna storages hold, and serialises as that string.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path


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


class ModeKind(StrEnum):
    """How a layer trains: not at all, its bias, its weight, both, a share of its output
    channels, or through a low-rank adapter beside its frozen weight (LoRA)."""

    FROZEN = "frozen"
    BIAS = "bias"
    WEIGHT = "weight"
    FULL = "full"
    RATIO = "ratio"
    LORA = "lora"


@dataclass(frozen=True, eq=False)
class Mode:
    """A layer's update mode; `ratio` carries the share of output channels (the first ones)
    updated, `lora` the rank of its adapter.

    Written as `full`, `bias`, `weight`, `ratio:R` or `lora:R` in plans, trial records and cache
    keys, and, like the enumerations here, equal to that string (`Mode.parse("ratio:0.25") ==
    "ratio:0.25"`)."""

    kind: ModeKind
    ratio: float | None = None
    rank: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ModeKind(self.kind))
        if (self.kind is ModeKind.RATIO) != (self.ratio is not None):
            raise ValueError("a ratio goes with mode `ratio`, and only with it")
        if self.ratio is not None and not 0 < self.ratio <= 1:
            raise ValueError(f"ratio must lie in (0, 1] (not {self.ratio:g})")
        if (self.kind is ModeKind.LORA) != (self.rank is not None):
            raise ValueError("a rank goes with mode `lora`, and only with it")
        if self.rank is not None and (isinstance(self.rank, bool) or int(self.rank) != self.rank or self.rank < 1):
            raise ValueError(f"a LoRA rank is a whole number from 1 (not {self.rank})")

    @classmethod
    def parse(cls, text: str | Mode) -> Mode:
        """`full`, `bias`, `weight`, `frozen`, `ratio:R` or `lora:R`."""
        if isinstance(text, Mode):
            return text
        kind, _, value = str(text).partition(":")
        if kind == ModeKind.LORA:
            return cls(ModeKind.LORA, rank=int(value) if value else None)
        return cls(ModeKind(kind), float(value) if value else None)

    def __str__(self) -> str:
        if self.kind is ModeKind.RATIO:
            return f"ratio:{self.ratio:g}"
        return f"lora:{self.rank}" if self.kind is ModeKind.LORA else self.kind.value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Mode, str)):
            return str(self) == str(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))


class Precision(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


class Kernels(StrEnum):
    """Who computes a step's dense convolutions: OpenBLAS's sgemm (`planner.backend.gemm`; the
    board needs scipy-openblas32) or TVM's own schedules (nothing to install)."""

    OPENBLAS = "openblas"
    TVM = "tvm"


class Optimizer(StrEnum):
    SGD = "sgd"
    MOMENTUM = "momentum"
    ADAM = "adam"


class FrozenWeights(StrEnum):
    """How frozen Conv/Gemm/MatMul weights are stored: as they are, or int8 per output channel."""

    FP32 = "fp32"
    INT8 = "int8"


class Updates(StrEnum):
    """Where an update goes: over the old weight right after its gradient, or into new buffers."""

    IN_PLACE = "in-place"
    COPY = "copy"


class Recompute(StrEnum):
    """Which activations the backward pass recomputes instead of keeping (`planner.backend.recompute`):
    none, or those `auto` chooses to minimise the step's peak. A scheme may also list layers
    whose inputs are kept (`Candidate.recompute` is then a tuple of layer names)."""

    NONE = "none"
    AUTO = "auto"


# What candidates were before `updates` existed: a stored candidate without it updated by copy.
LEGACY_UPDATES = Updates.COPY


@dataclass(frozen=True)
class Candidate:
    """One training configuration; hashable and JSON-serialisable (it keys the compile cache).

    Strings are accepted where the types are enumerations (`("conv1", "full")`, `precision="fp32"`)
    and converted, so a script can write a candidate the way a scheme file does:

        Candidate(trainable=(("fc", "full"), ("conv3", "ratio:0.25")), batch_size=16, optimizer="sgd", lr=0.05)
    """

    trainable: tuple[tuple[str, Mode], ...]  # (layer name, mode) in model order; frozen omitted
    batch_size: int
    optimizer: Optimizer
    lr: float
    precision: Precision = Precision.FP32
    grad_accum: int = 1  # micro-batches of `batch_size` per update: effective batch = product
    frozen_weights: FrozenWeights = FrozenWeights.FP32  # int8: frozen Conv/Gemm/MatMul weights quantized per channel
    updates: Updates = Updates.IN_PLACE  # in-place: each update right after its gradient, over the old weight
    # none, auto, or the layers whose input activations are kept (every other one is recomputed)
    recompute: Recompute | tuple[str, ...] = Recompute.NONE

    def __post_init__(self) -> None:
        convert = object.__setattr__
        convert(self, "trainable", tuple((str(name), Mode.parse(mode)) for name, mode in self.trainable))
        if any(mode.kind is ModeKind.FROZEN for _, mode in self.trainable):
            raise ValueError("a frozen layer is left out of `trainable`, not listed as frozen")
        convert(self, "optimizer", Optimizer(self.optimizer))
        convert(self, "precision", Precision(self.precision))
        convert(self, "frozen_weights", FrozenWeights(self.frozen_weights))
        convert(self, "updates", Updates(self.updates))
        if isinstance(self.recompute, str):
            convert(self, "recompute", Recompute(self.recompute))
        else:
            convert(self, "recompute", tuple(map(str, self.recompute)))
            if not self.recompute:
                raise ValueError("recompute lists the layers whose inputs are kept (at least one), or is none or auto")

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["trainable"] = [[name, str(mode)] for name, mode in self.trainable]
        if isinstance(self.recompute, tuple):
            d["recompute"] = list(self.recompute)
        return {k: v.value if isinstance(v, StrEnum) else v for k, v in d.items()}

    @classmethod
    def from_json(cls, d: dict) -> Candidate:
        return cls(
            trainable=tuple((str(a), Mode.parse(str(b))) for a, b in d["trainable"]),
            batch_size=int(d["batch_size"]),
            optimizer=Optimizer(d["optimizer"]),
            lr=float(d["lr"]),
            precision=Precision(d.get("precision", Precision.FP32)),
            grad_accum=int(d.get("grad_accum", 1)),
            frozen_weights=FrozenWeights(d.get("frozen_weights", FrozenWeights.FP32)),
            updates=Updates(d.get("updates", LEGACY_UPDATES)),
            recompute=d.get("recompute", Recompute.NONE),
        )

    def key(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


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
    before: float
    after: float
    loss_before: float
    loss_after: float | None  # None: the fine-tune diverged, its loss is not a number
    steps: int
    seconds: float
    diverged_at: int | None = None  # the step whose loss was NaN or Inf; the run stopped there

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> AccuracyResult | None:
        """The result `to_json` wrote, or None when a field is missing, extra, of the wrong type or
        out of range (accuracies in [0, 1], step counts whole and not negative)."""
        if set(raw) != {f.name for f in fields(cls)}:
            return None
        r = cls(**raw)
        valid = (
            all(_number(v) and 0.0 <= v <= 1.0 for v in (r.before, r.after))
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

    def __post_init__(self) -> None:
        self.state = TrialState(self.state)

    @property
    def complete(self) -> bool:
        return self.state is TrialState.COMPLETE and self.accuracy is not None

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
    def from_attrs(cls, number: int, state: TrialState | str, attrs: dict, constraints: dict[str, float]) -> TrialRecord:
        """Rebuild a record from what `Evaluator.evaluate` recorded."""
        cand = attrs.get("candidate")
        rec = cls(
            number=number,
            state=TrialState(state),  # a name Optuna or trials.json wrote
            candidate=Candidate.from_json(cand) if cand else None,
            accuracy=AccuracyResult(**attrs["accuracy"]) if "accuracy" in attrs else None,
            latency=Latency(**attrs["latency"]) if "latency" in attrs else None,
            memory=MemoryBreakdown(**attrs["memory"]) if "memory" in attrs else None,
            fail_reason=attrs.get("fail_reason"),
            board=attrs.get("board"),
            board_memory=attrs.get("board_memory"),
            library_bytes=attrs.get("library_bytes"),
            seconds={k: float(attrs[k]) for k in ("compile_s", "tune_s", "measure_s", "accuracy_s") if k in attrs},
            over_budget={k: v for k, v in constraints.items() if v > 0},
            worker=attrs.get("worker"),
            seed=attrs.get("seed"),
            fidelity=Fidelity.from_json(attrs["fidelity"]) if "fidelity" in attrs else None,
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
        }

    @classmethod
    def from_json(cls, d: dict) -> TrialRecord:
        attrs = {
            k: v for k, v in d.items() if v is not None and k not in ("number", "state", "feasible", "over_budget", "seconds")
        }
        attrs.update(d.get("seconds", {}))
        rec = cls.from_attrs(d["number"], d["state"], attrs, d.get("over_budget", {}))
        rec.feasible = bool(d["feasible"])
        return rec


@dataclass(frozen=True)
class ModelInput:
    """One input of a model: its ONNX name, its shape after the batch dimension and its numpy
    dtype. Token ids and attention masks stay integers end to end: a float32 cast would be a
    different model (and TVM refuses it)."""

    name: str
    shape: tuple[int | str, ...]  # without the batch dimension; a str is a dynamic length (`sequence`)
    dtype: str = "float32"

    @property
    def integer(self) -> bool:
        return self.dtype.startswith(("int", "uint")) or self.dtype == "bool"

    @property
    def static(self) -> tuple[int, ...]:
        """The shape, every length bound (see `Model.bind`)."""
        if not all(isinstance(d, int) for d in self.shape):
            raise ValueError(f"input '{self.name}' has unbound lengths {self.shape}")
        return tuple(int(d) for d in self.shape)

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> ModelInput:
        return cls(str(d["name"]), tuple(n if isinstance(n, str) else int(n) for n in d["shape"]), str(d["dtype"]))


@dataclass(frozen=True)
class StepSignature:
    """How to call a compiled step: argument order by ONNX name, shapes and dtypes."""

    inputs: tuple[ModelInput, ...]  # the model's inputs, in the order the step takes them
    batch_size: int  # the effective batch of one update: every input's first dimension
    micro_batch: int  # samples per forward/backward (and per `backbone` call)
    frozen: tuple[str, ...]
    trainable: tuple[str, ...]
    splits: dict[str, tuple[int, int]]  # ratio-updated weight -> (channel axis, channels trained)
    adapters: dict[str, tuple[int, int]]  # LoRA-trained weight -> (output-channel axis, rank)
    quantized: dict[str, int]  # frozen weight stored int8 -> its output-channel axis
    loss_scale: float  # the step returns loss * loss_scale (fp16 loss scaling)
    # (shape, dtype, initial fill value); the last is the learning rate the update multiplies by
    optim_states: tuple[tuple[tuple[int, ...], str, float], ...]
    n_classes: int
    # layers whose input activation the backward pass keeps, when it recomputes the others
    # (what `recompute: auto` chose); empty when the step keeps every activation it needs
    kept: tuple[str, ...] = ()

    def with_lr(self, lr: float) -> StepSignature:
        """The signature of the same step run with learning rate `lr` (its last optimizer state)."""
        shape, dtype, _ = self.optim_states[-1]
        return replace(self, optim_states=(*self.optim_states[:-1], (shape, dtype, lr)))

    def to_json(self) -> dict:
        d = asdict(self)
        d["inputs"] = [i.to_json() for i in self.inputs]
        d["optim_states"] = [{"shape": list(s), "dtype": t, "fill": f} for s, t, f in self.optim_states]
        return d

    @classmethod
    def from_json(cls, d: dict) -> StepSignature:
        if "inputs" in d:
            inputs, batch = tuple(ModelInput.from_json(i) for i in d["inputs"]), int(d["batch_size"])
        else:  # written before models had several inputs: one float32 input, its shape with the batch
            inputs, batch = (ModelInput(d["input_name"], tuple(d["input_shape"][1:])),), int(d["input_shape"][0])
        return cls(
            inputs=inputs,
            batch_size=batch,
            micro_batch=int(d.get("micro_batch", batch)),
            frozen=tuple(d["frozen"]),
            trainable=tuple(d["trainable"]),
            splits={k: (int(a), int(n)) for k, (a, n) in d.get("splits", {}).items()},
            adapters={k: (int(a), int(r)) for k, (a, r) in d.get("adapters", {}).items()},
            quantized={k: int(a) for k, a in d.get("quantized", {}).items()},
            loss_scale=float(d.get("loss_scale", 1.0)),
            optim_states=tuple((tuple(s["shape"]), s["dtype"], float(s["fill"])) for s in d["optim_states"]),
            n_classes=int(d["n_classes"]),
            kept=tuple(map(str, d.get("kept", ()))),
        )


@dataclass(frozen=True)
class RunResult:
    """What `planner.run` did: val loss and accuracy before and after, where the weights went."""

    before: dict[str, float]  # {loss, accuracy} on the val split
    after: dict[str, float]
    steps: int
    out: Path
    device: str

    def to_json(self) -> dict:
        return {"before": self.before, "after": self.after, "steps": self.steps, "out": str(self.out), "device": self.device}


@dataclass(frozen=True)
class KernelTime:
    """One kernel of the step: what it is, how often the step calls it, its time per step."""

    name: str
    symbol: str
    calls: int  # per step
    seconds: float  # per step, all calls
    flops: int  # per step, all calls (0: not known)

    @property
    def gflops(self) -> float | None:
        return self.flops / self.seconds / 1e9 if self.flops and self.seconds > 0 else None


@dataclass(frozen=True)
class StepProfile:
    """The step's kernels, slowest first, averaged over `steps` steps, and the steps' own time."""

    kernels: tuple[KernelTime, ...]
    step_seconds: float
    steps: int

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)
