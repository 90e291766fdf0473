"""Scheme files: one explicit training configuration, e.g. a paper's, to measure without a search.

trainable:
  - layer: b2.dw          # ONNX node name
    mode: ratio           # full | bias | weight | ratio | lora
    ratio: 0.25           # ratio: the first quarter of the output channels train
  - {layer: q, mode: lora, rank: 4}   # a rank-4 adapter beside the frozen weight, merged into it by `run`
  - params: [classifier.weight, classifier.bias]
precision: fp32                    # fp32 | fp16 | bf16 | int8 (int8: frozen weights int8 too)
frozen_weights: int8               # fp32 | int8 (frozen Conv/Gemm/MatMul weights stored int8)
updates: in-place                  # in-place (default) | copy (new weights in new buffers)
recompute: auto                    # none (default) | auto | [layer, …]: activations kept, the rest recomputed
batch_size: 8
grad_accum: 1
optimizer: {name: sgd, lr: 0.05}   # sgd (plain) | momentum | adam
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.errors import BadInput
from planner.inputs.model import Model
from planner.inputs.spaces import FIXED_BATCH_HINT
from planner.inputs.specs import load_spec
from planner.modes import FROZEN, MODES, plain
from planner.types import Candidate, FrozenWeights, Mode, Optimizer, Precision, Recompute, Updates


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Entry(_Strict):
    """A layer with a mode (and the number a mode carries, under its argument's name: `ratio: R`,
    `rank: R`), or a list of parameters (ONNX initializer names)."""

    layer: str | None = None
    mode: Mode = Mode("full")
    params: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _mode_with_its_number(cls, data: object) -> object:
        """`{mode: ratio, ratio: 0.25}` as the mode `ratio:0.25`; a number without its mode refused."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        kind = str(data.get("mode", "full"))
        spec = MODES.get(kind)
        if spec is None:
            raise ValueError(f"no update mode '{kind}': the modes are {', '.join(m for m in MODES if m != FROZEN)}")
        if kind == FROZEN:
            raise ValueError("a frozen layer is left out of `trainable`")
        for other in MODES.values():
            arg = other.argument
            if arg is not None and (arg.name in data) != (other is spec):
                raise ValueError(f"`mode: {other.name}` goes with `{arg.name}: R` ({other.description}), and only with it")
        value = data.pop(spec.argument.name) if spec.argument is not None else None
        data["mode"] = Mode(kind, value)
        return data

    @model_validator(mode="after")
    def _one_kind(self) -> Entry:
        if (self.layer is None) == (self.params is None):
            raise ValueError("each trainable entry names either a `layer` or `params`")
        return self


class OptimizerEntry(_Strict):
    name: Optimizer = Optimizer.SGD
    lr: float = Field(gt=0)


class Scheme(_Strict):
    name: str
    trainable: list[Entry] = Field(min_length=1)
    precision: Precision = Precision.FP32
    frozen_weights: FrozenWeights = FrozenWeights.FP32
    updates: Updates = Updates.IN_PLACE
    recompute: Recompute | list[str] = Recompute.NONE
    batch_size: int = Field(gt=0)
    grad_accum: int = Field(default=1, ge=1)
    optimizer: OptimizerEntry

    def candidate(self, model: Model) -> Candidate:
        """The candidate, with every layer and parameter checked against the model."""
        modes: dict[str, Mode] = {}
        owners = {p: layer.name for layer in model.layers for p in layer.param_shapes}
        for entry in self.trainable:
            if entry.layer is not None:
                layer = model.layer(entry.layer)
                problem = entry.mode.spec.refuses(layer, entry.mode.value)
                if problem:
                    raise BadInput(f"scheme {self.name}: {problem}")
                modes[layer.name] = entry.mode
                continue
            params = entry.params
            assert params is not None, "an entry names a layer or params (`Entry._one_kind`)"
            for p in params:
                if p not in owners:
                    raise BadInput(f"scheme {self.name}: the model has no parameter '{p}'")
            for layer in map(model.layer, dict.fromkeys(owners[p] for p in params)):
                wanted = {p for p in params if owners[p] == layer.name}
                kind = next((m.name for m in plain() if set(m.params(layer)) == wanted), None)
                if kind is None:
                    raise BadInput(
                        f"scheme {self.name}: {', '.join(sorted(wanted))} of layer '{layer.name}' is not an update planner "
                        f"supports ({' or '.join(m.name for m in plain())})"
                    )
                modes[layer.name] = Mode(kind)
        if model.fixed_batch not in (None, self.batch_size):
            raise BadInput(
                f"scheme {self.name}: {model.path.name} was exported for batch {model.fixed_batch} only, "
                f"the scheme asks for {self.batch_size}: {FIXED_BATCH_HINT}"
            )
        for name in modes:
            problem = model.layer(name).problem
            if problem:
                raise BadInput(f"scheme {self.name}: cannot train layer '{name}': {problem}")
        order = [layer.name for layer in model.layers]
        recompute: Recompute | tuple[str, ...] = Recompute(self.recompute) if isinstance(self.recompute, str) else ()
        if isinstance(self.recompute, list):
            if not self.recompute:
                raise BadInput(f"scheme {self.name}: `recompute` lists the layers whose inputs are kept; say `none` to keep all")
            recompute = tuple(model.layer(name).name for name in self.recompute)
        return Candidate(
            trainable=tuple(sorted(modes.items(), key=lambda kv: order.index(kv[0]))),
            batch_size=self.batch_size,
            optimizer=self.optimizer.name,
            lr=self.optimizer.lr,
            precision=self.precision,
            grad_accum=self.grad_accum,
            frozen_weights=self.frozen_weights,
            updates=self.updates,
            recompute=recompute,
        )


def load_scheme(path: str | Path) -> Scheme:
    path = Path(path)
    if not path.suffix:
        raise BadInput(f"a scheme is a YAML file path, got {str(path)!r}")
    return load_spec(str(path), path.parent, "scheme", Scheme)
