"""What a compiled step takes and gives: its inputs, its signature, a run's result and a profile."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from planner.modes import Layout


@dataclass(frozen=True)
class Encoding:
    """How a step's 8-bit input stands for the model's float input: the value is `q * scale[c] +
    offset[c]` along the first axis after the batch (one pair: for every value), computed in
    float32 as the step's first operation.

    Why: on a microcontroller the input batch is the widest tensor alive at the start of a step
    (MobileNetV2 at 128x128: 192 KiB in fp32 beside a 320 KB board), and a camera gives 8-bit
    pixels anyway. For images it is exact: `ToTensor` then `Normalize` is this affine map of the
    decoded pixel (`Preprocess.pixel_encoding`), so a batch encodes back to its very pixels; for
    float arrays it is a per-tensor scale calibrated on the training data (`calibrated`), and the
    accuracy a candidate measures is the encoded data's."""

    scale: tuple[float, ...]
    offset: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.scale) != len(self.offset) or not self.scale:
            raise ValueError("an input encoding has one scale and one offset per channel (or one of each)")
        if not all(np.isfinite(s) and s != 0 for s in self.scale) or not all(np.isfinite(o) for o in self.offset):
            raise ValueError(f"an input encoding's scales must be finite and not 0, its offsets finite: {self}")

    def factors(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Scale and offset as float32 arrays broadcasting over a sample of `rank` dimensions."""
        shape = (len(self.scale), *[1] * (rank - 1)) if len(self.scale) > 1 else ()
        return (np.asarray(self.scale, np.float32).reshape(shape), np.asarray(self.offset, np.float32).reshape(shape))

    def encode(self, x: np.ndarray) -> np.ndarray:
        """A batch of float samples as the step's 8-bit input: the nearest code, clipped to
        [0, 255]; an 8-bit batch is taken as it is (already the step's)."""
        if x.dtype == np.uint8:
            return x
        scale, offset = self.factors(x.ndim - 1)
        return np.clip(np.rint((x.astype(np.float64) - offset) / scale), 0, 255).astype(np.uint8)

    def decode(self, q: np.ndarray) -> np.ndarray:
        """The float32 values a batch of codes stands for, as the step computes them."""
        scale, offset = self.factors(q.ndim - 1)
        return q.astype(np.float32) * scale + offset

    @classmethod
    def calibrated(cls, lo: float, hi: float, integral: bool = False) -> Encoding:
        """The per-tensor encoding spanning values from `lo` to `hi` (the training samples') with
        256 codes; `integral` values (8-bit data saved as floats) spanning at most 256 integers
        are coded as they are, exactly."""
        if integral and hi - lo <= 255:
            return cls((1.0,), (lo,))
        return cls(((hi - lo) / 255 if hi > lo else 1.0,), (lo,))

    def to_json(self) -> dict:
        return {"scale": list(self.scale), "offset": list(self.offset)}

    @classmethod
    def from_json(cls, d: dict) -> Encoding:
        return cls(tuple(float(v) for v in d["scale"]), tuple(float(v) for v in d["offset"]))


@dataclass(frozen=True)
class Int8Scale:
    """How an activation is quantized under `precision: int8`: per tensor, asymmetric, the value
    `(q - zero) * scale` for q in [-128, 127] (ONNX's `QuantizeLinear` to int8), the scale and
    zero point spanning the range calibration saw, zero included (`spanning`).

    Why per tensor and asymmetric: it is what TFLite, TinyEngine and ONNX Runtime's static
    quantization give activations (a ReLU6 output, [0, 6], gets all 256 codes), so an int8 kernel
    requantizes a whole tensor with one multiplier, and 0 (padding, a ReLU's floor) is a code."""

    scale: float
    zero: int

    def __post_init__(self) -> None:
        if not (np.isfinite(self.scale) and self.scale > 0) or not -128 <= self.zero <= 127:
            raise ValueError(f"an int8 activation scale must be finite and positive, its zero point in [-128, 127]: {self}")

    @classmethod
    def spanning(cls, lo: float, hi: float) -> Int8Scale:
        """The scale and zero point whose 256 codes span [min(lo, 0), max(hi, 0)] (a tensor never
        seen to vary: scale 1), the scale a float32 so the graph's constant is the recorded value."""
        lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
        scale = float(np.float32((hi - lo) / 255)) if hi > lo else 1.0
        return cls(scale, int(np.clip(np.rint(-128 - lo / scale), -128, 127)))

    def to_json(self) -> list:
        return [self.scale, self.zero]

    @classmethod
    def from_json(cls, d) -> Int8Scale:
        scale, zero = d
        return cls(float(scale), int(zero))


@dataclass(frozen=True)
class ModelInput:
    """One input of a model: its ONNX name, its shape after the batch dimension and its numpy
    dtype. Token ids and attention masks stay integers end to end: a float32 cast would be a
    different model (and TVM refuses it). A float input the step takes in 8 bits carries its
    `encoding` (its dtype is then uint8)."""

    name: str
    shape: tuple[int | str, ...]  # without the batch dimension; a str is a dynamic length (`sequence`)
    dtype: str = "float32"
    # False: no batch dimension at all — an output that is the batch's scalar loss (`loss-in-model`)
    batched: bool = True
    encoding: Encoding | None = None

    @property
    def integer(self) -> bool:
        """Whether the model takes integers here (ids, masks): an input coded in 8 bits is a float one."""
        return self.encoding is None and (self.dtype.startswith(("int", "uint")) or self.dtype == "bool")

    @property
    def static(self) -> tuple[int, ...]:
        """The shape, every length bound (see `Model.bind`)."""
        if not all(isinstance(d, int) for d in self.shape):
            raise ValueError(f"input '{self.name}' has unbound lengths {self.shape}")
        return tuple(int(d) for d in self.shape)

    def to_json(self) -> dict:
        d: dict = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if not self.batched:
            d["batched"] = False
        if self.encoding is not None:
            d["encoding"] = self.encoding.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> ModelInput:
        shape = tuple(n if isinstance(n, str) else int(n) for n in d["shape"])
        code = Encoding.from_json(d["encoding"]) if "encoding" in d else None
        return cls(str(d["name"]), shape, str(d["dtype"]), bool(d.get("batched", True)), code)

    def encoded(self, encoding: Encoding) -> ModelInput:
        """This float input taken by the step in 8 bits."""
        if self.dtype != "float32" or not self.batched:
            raise ValueError(f"input '{self.name}' ({self.dtype}) is not a batch of floats: it is taken as it is")
        if len(encoding.scale) not in (1, self.shape[0] if self.shape else 1):
            raise ValueError(f"input '{self.name}' {self.shape}: {len(encoding.scale)} channel scales")
        return replace(self, dtype="uint8", encoding=encoding)


@dataclass(frozen=True)
class StepSignature:
    """How to call a compiled step: argument order by ONNX name, shapes and dtypes."""

    inputs: tuple[ModelInput, ...]  # the model's inputs, in the order the step takes them
    batch_size: int  # the effective batch of one update: every input's first dimension
    micro_batch: int  # samples per forward/backward (and per `backbone` call)
    frozen: tuple[str, ...]
    trainable: tuple[str, ...]
    layouts: dict[str, Layout]  # weight its layer's mode reshapes -> how (`planner.modes`)
    quantized: dict[str, int]  # weight (or part) stored int8 -> its output-channel axis: frozen, or trained by an int8 candidate
    loss_scale: float  # the step returns loss * loss_scale (fp16 loss scaling)
    # (shape, dtype, initial fill value); the last is the learning rate the update multiplies by
    optim_states: tuple[tuple[tuple[int, ...], str, float], ...]
    n_classes: int
    # layers whose input activation the backward pass keeps, when it recomputes the others
    # (what `recompute: auto` chose); empty when the step keeps every activation it needs
    kept: tuple[str, ...] = ()
    task: str = "classification"  # whose loss the step computes (`planner.tasks`)
    # one sample's output shape (None: a signature from before tasks, a classifier's `(n_classes,)`);
    # `()` and not `batched_output`: the model's output is the batch's scalar loss
    output: tuple[int, ...] | None = None
    target: ModelInput = ModelInput("labels", (), "int64")  # one sample's target, the step's last argument
    batched_output: bool = True
    # `precision: int8`: each fake-quantized activation (an ONNX tensor name) -> its scale
    activations: dict[str, Int8Scale] = field(default_factory=dict)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.output if self.output is not None else (self.n_classes,)

    def with_lr(self, lr: float) -> StepSignature:
        """The signature of the same step run with learning rate `lr` (its last optimizer state)."""
        shape, dtype, _ = self.optim_states[-1]
        return replace(self, optim_states=(*self.optim_states[:-1], (shape, dtype, lr)))

    def to_json(self) -> dict:
        d = asdict(self)
        d["inputs"] = [i.to_json() for i in self.inputs]
        d["layouts"] = {w: [lay.mode, lay.axis, lay.size] for w, lay in self.layouts.items()}
        d["optim_states"] = [{"shape": list(s), "dtype": t, "fill": f} for s, t, f in self.optim_states]
        d["output"] = list(self.output_shape)
        d["target"] = self.target.to_json()
        d["activations"] = {name: a.to_json() for name, a in self.activations.items()}
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
            layouts=_layouts(d),
            quantized={k: int(a) for k, a in d.get("quantized", {}).items()},
            loss_scale=float(d.get("loss_scale", 1.0)),
            optim_states=tuple((tuple(s["shape"]), s["dtype"], float(s["fill"])) for s in d["optim_states"]),
            n_classes=int(d["n_classes"]),
            kept=tuple(map(str, d.get("kept", ()))),
            task=str(d.get("task", "classification")),  # written before tasks: a classifier's
            output=tuple(int(n) for n in d.get("output", (d["n_classes"],))),
            batched_output=bool(d.get("batched_output", True)),
            target=ModelInput.from_json(d["target"]) if "target" in d else ModelInput("labels", (), "int64"),
            activations={str(k): Int8Scale.from_json(v) for k, v in d.get("activations", {}).items()},
        )


def _layouts(d: dict) -> dict[str, Layout]:
    """A signature's reshaped weights; one written before modes were registered (plan schema 5
    and earlier) keeps ratio splits and LoRA adapters apart, as (axis, size)."""
    if "layouts" in d:
        return {w: Layout(str(m), int(a), int(n)) for w, (m, a, n) in d["layouts"].items()}
    old = {w: Layout("ratio", int(a), int(n)) for w, (a, n) in d.get("splits", {}).items()}
    return old | {w: Layout("lora", int(a), int(r)) for w, (a, r) in d.get("adapters", {}).items()}


@dataclass(frozen=True)
class RunCheck:
    """A run's own measure of its step beside the plan's figures (`planner.measurement.selfcheck`).
    A figure the run could not measure where it ran is None."""

    step_ms: float | None  # median over the run's timed steps
    step_ms_p10: float | None
    step_ms_p90: float | None
    steps_timed: int
    planned_step_ms: float
    memory_bytes: int | None
    planned_memory_bytes: int
    how: str  # how each figure was measured, in words
    warnings: tuple[str, ...]  # one line each: a figure more than `TOLERANCE` off the plan's

    def to_json(self) -> dict:
        return {**asdict(self), "warnings": list(self.warnings)}


@dataclass(frozen=True)
class RunResult:
    """What `planner.run` did: val loss and metric before and after, where the weights went, and
    its step time and memory measured against the plan's."""

    before: dict[str, float]  # {loss, <the task's metric>} on the val split
    after: dict[str, float]
    steps: int
    out: Path
    device: str
    check: RunCheck | None = None
    metric: str = "accuracy"  # the task's metric: the key of `before` and `after` beside the loss

    def to_json(self) -> dict:
        return {
            "metric": self.metric,
            "before": self.before,
            "after": self.after,
            "steps": self.steps,
            "out": str(self.out),
            "device": self.device,
            "check": self.check.to_json() if self.check else None,
        }


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
