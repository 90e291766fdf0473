"""What a candidate is: its per-layer update modes, precision, optimizer, batch and update style."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from enum import StrEnum

from planner import modes


@dataclass(frozen=True, eq=False)
class Mode:
    """A layer's update mode (`planner.modes`: `frozen`, `bias`, `weight`, `full`, `ratio`, `lora`)
    and the number it carries, if any (`ratio`: the share of output channels updated, `lora`:
    the adapter's rank).

    Written as the mode says (`full`, `ratio:0.25`, `lora:4`) in plans, trial records and cache
    keys, and, like the enumerations here, equal to that string (`Mode.parse("ratio:0.25") ==
    "ratio:0.25"`)."""

    kind: str
    value: float | None = None

    def __post_init__(self) -> None:
        spec = modes.get(self.kind)
        object.__setattr__(self, "kind", spec.name)
        if spec.argument is None:
            if self.value is not None:
                raise ValueError(f"mode {spec.name} carries no number (not {self.value!r})")
        elif self.value is None:
            raise ValueError(f"mode {spec.name} carries its {spec.argument.name}: {spec.name}:R, R {spec.argument.bounds}")
        else:
            object.__setattr__(self, "value", spec.argument.parse(self.value))

    @property
    def spec(self) -> modes.UpdateMode:
        return modes.MODES[self.kind]

    @classmethod
    def parse(cls, text: str | Mode) -> Mode:
        """`full`, `bias`, `weight`, `frozen`, `ratio:R` or `lora:R` (any registered mode)."""
        if isinstance(text, Mode):
            return text
        kind, _, value = str(text).partition(":")
        return cls(kind, value or None)  # type: ignore[arg-type]  # the mode's argument parses the text

    @property
    def label(self) -> str:
        """How a report reads it (`ratio 0.25`, `lora rank 4`)."""
        return self.spec.label(self.value)

    def __str__(self) -> str:
        return self.spec.text(self.value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Mode, str)):
            return str(self) == str(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))


class Precision(StrEnum):
    """What a step computes in. fp16/bf16: convolutions and products (parameters stay fp32
    masters). int8: the model quantized as TFLite and TinyEngine quantize it, activations per
    tensor at scales calibrated on the training data (`planner.inputs.calibration`), frozen
    weights int8 per output channel; it trains the fake-quantized graph, straight through."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"


class Kernels(StrEnum):
    """Who computes a step's dense convolutions and matrix products: OpenBLAS's sgemm
    (`planner.backend.sgemm.gemm`; the board needs scipy-openblas32), TVM's own schedules (nothing to
    install), or planner's portable C sgemm under the same im2col kernels sized for a
    microcontroller's kilobytes (the `c` back end: the step carries it)."""

    OPENBLAS = "openblas"
    TVM = "tvm"
    PORTABLE = "portable"

    @property
    def sgemm(self) -> bool:
        """Whether dense convolutions and products become im2col kernels calling an sgemm."""
        return self is not Kernels.TVM


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
    """Which activations the backward pass recomputes instead of keeping (`planner.backend.graph.recompute`):
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
        if any(mode.kind == modes.FROZEN for _, mode in self.trainable):
            raise ValueError("a frozen layer is left out of `trainable`, not listed as frozen")
        convert(self, "optimizer", Optimizer(self.optimizer))
        convert(self, "precision", Precision(self.precision))
        convert(self, "frozen_weights", FrozenWeights(self.frozen_weights))
        if self.precision is Precision.INT8:  # an int8 model's weights are int8 too
            convert(self, "frozen_weights", FrozenWeights.INT8)
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
