"""Search spaces (YAML) and the candidates they produce.

A candidate is everything that decides a training step: which layers update (and how), the
precision, the batch size and the optimizer. A search space says which values each may take;
`SearchSpace.sample` turns any object with Optuna's `suggest_*` methods into a candidate, so this
module never imports Optuna.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from planner.errors import BadInput, UnsupportedOp
from planner.inputs.model import Layer, Model
from planner.inputs.resources import shipped
from planner.inputs.specs import load_spec
from planner.modes import FROZEN, MODES, plain
from planner.modes import get as get_mode
from planner.types import Candidate, FrozenWeights, Mode, Optimizer, Precision, Recompute, Updates

SPACES_DIR = shipped("search_spaces")
FIXED_BATCH_HINT = (
    "export it with a dynamic batch (torch.onnx.export(..., dynamic_shapes={'x': {0: torch.export.Dim('batch')}}), "
    "or dynamic_axes={'x': {0: 'batch'}} with dynamo=False), or plan at that batch"
)
DEFAULT_SPACE = "per-layer"


class Suggester(Protocol):
    """The part of `optuna.Trial` a search space needs."""

    def suggest_categorical(self, name: str, choices: list) -> Any: ...  # one of `choices`
    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float: ...
    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False) -> int: ...


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LrRange(_Strict):
    low: float = Field(gt=0)
    high: float = Field(gt=0)
    log: bool = True

    @model_validator(mode="after")
    def _ordered(self) -> LrRange:
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) is above high ({self.high:g})")
        return self


class SearchSpace(_Strict):
    """What the study may vary. Layers default to every layer with parameters, in model order.

    `strategy` says how the trainable set is drawn:
    - `depths` (`sparse-update`'s): TinyEngine's sparse update as a fixed set of numbers (Lin
      et al. 2022): the last `bias_depth` layers update their biases and the last `weight_depth`
      their weights, all in one `weight_mode` (`full`, `ratio:0.25`, …; the classifier whole
      under a ratio, which would leave classes untrained) — the network's
      structure in three parameters a sampler models jointly, where per-layer choices give it one
      unrelated categorical per layer (3^53 sets for MobileNetV2) that 20-100 trials cannot learn;
    - `per-layer` (a YAML's without `strategy`): each layer gets its own mode from `modes`;
    - `sparse`: a depth k is drawn (log-uniform), the k-th layer from the end trains, and each
      layer after it gets its own mode — the sparse-update search (updates concentrate where
      backpropagation is cheap);
    - `last-k`: the last k layers train, k from 1 to all, in one mode drawn from `modes`;
    - `all`: every layer trains, in one mode drawn from `modes` (`bias`: TinyTL-style bias-only).
    """

    name: str
    description: str = ""
    strategy: Literal["depths", "per-layer", "sparse", "last-k", "all"] = "per-layer"
    layers: list[str] | None = None
    modes: list[str] = ["frozen", "bias", "full"]  # `planner.modes`
    # for each mode that carries a number, the values a layer's may take; YAML names each list
    # after the mode's argument (`ratios: [0.125, 0.25]` for `ratio`, `ranks: [4, 8]` for `lora`)
    arguments: dict[str, list[int | float]] = {}
    batch_size: list[int] = [8, 16, 32]
    grad_accum: list[int] = [1]
    optimizer: list[Optimizer] = [Optimizer.SGD]
    # one range for every optimizer, or one per optimizer: Adam's steps are normalised, so the
    # rates that train with it (1e-4..1e-2) are a decade or two below plain SGD's
    lr: LrRange | dict[Optimizer, LrRange] = LrRange(low=0.01, high=0.1)
    precision: list[Precision] = [Precision.FP32]
    frozen_weights: list[FrozenWeights] = [FrozenWeights.FP32]
    updates: list[Updates] = [Updates.IN_PLACE]
    recompute: list[Recompute] = [Recompute.NONE]

    @field_validator("precision", "frozen_weights", "updates", "recompute")
    @classmethod
    def _nonempty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must list at least one value")
        return v

    def for_target(self, precisions: Sequence[str]) -> SearchSpace:
        """This space restricted to the precisions a target lists: others are never proposed."""
        allowed = [p for p in self.precision if p in precisions]
        if not allowed:
            raise BadInput(
                f"search space '{self.name}' proposes precision {', '.join(self.precision)}; "
                f"the target supports only {', '.join(precisions)}"
            )
        return self.model_copy(update={"precision": allowed})

    def for_model(self, model: Model) -> SearchSpace:
        """This space restricted to the batch size a model was exported with, when its batch is
        not symbolic: a graph exported for batch N computes shapes for N and runs at no other."""
        if model.fixed_batch is None:
            return self
        if model.fixed_batch not in self.batch_size:
            raise BadInput(
                f"{model.path.name} was exported for batch {model.fixed_batch} only, and search space '{self.name}' "
                f"proposes batch {', '.join(map(str, self.batch_size))}: {FIXED_BATCH_HINT}"
            )
        return self.model_copy(update={"batch_size": [model.fixed_batch]})

    @model_validator(mode="after")
    def _a_range_per_optimizer(self) -> SearchSpace:
        if not self.optimizer:
            raise ValueError("optimizer: must list at least one value")
        if isinstance(self.lr, dict) and (missing := [str(o) for o in self.optimizer if o not in self.lr]):
            raise ValueError(f"lr: no range for optimizer {', '.join(missing)} (give one per optimizer listed)")
        return self

    def lr_range(self, optimizer: Optimizer) -> LrRange:
        """The learning rates `optimizer` is tried at."""
        return self.lr[optimizer] if isinstance(self.lr, dict) else self.lr

    def _lr(self, trial: Suggester, optimizer: Optimizer) -> float:
        """The learning rate: drawn in the optimizer's own range. With a range per optimizer, the
        parameter is the rate's place in its range (`lr_position`, 0 the low end, 1 the high), not
        the rate: the same parameter whatever optimizer a trial draws, so a sampler models the
        space jointly (a parameter per optimizer would make it conditional, and multivariate
        TPE, GP and NSGA-II fall back to independent draws)."""
        lr = self.lr_range(optimizer)
        if not isinstance(self.lr, dict):
            return float(trial.suggest_float("lr", lr.low, lr.high, log=lr.log))
        u = float(trial.suggest_float("lr_position", 0.0, 1.0))
        return float(lr.low * (lr.high / lr.low) ** u if lr.log else lr.low + (lr.high - lr.low) * u)

    def for_data(self, n_train: int, source: str) -> SearchSpace:
        """This space restricted to the batch sizes the train split can fill: a larger batch
        cannot be drawn from it (see `Dataset.check_batch`)."""
        fits = [b for b in self.batch_size if b * max(self.grad_accum) <= n_train]  # an update's whole batch
        if not fits:
            raise BadInput(
                f"the train split of {source} holds {n_train} samples, fewer than every batch size search space "
                f"'{self.name}' proposes ({', '.join(str(b * max(self.grad_accum)) for b in self.batch_size)} per update): add data, or a "
                "space with a smaller batch_size"
            )
        return self.model_copy(update={"batch_size": fits})

    @field_validator("batch_size", "grad_accum")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(b < 1 for b in v):
            raise ValueError("must be a non-empty list of positive integers")
        return v

    def layer_names(self, model: Model) -> list[str]:
        """The layers the study decides about, checked against the model: those the space lists
        (each must be trainable), else every layer planner can train (see `excluded_layers`)."""
        if self.layers is None:
            names = [layer.name for layer in model.layers if (layer.weight or layer.bias) and layer.trainable]
            blocked = [layer.problem for layer in model.layers if layer.weight or layer.bias]
            if not names and blocked:
                raise UnsupportedOp(f"no layer of {model.path.name} can be trained: {blocked[-1]}")
        else:  # a layer named twice (by its name and an ONNX node's) is one layer
            names = list(dict.fromkeys(model.layer(n).name for n in self.layers))
        for name in names:
            problem = model.layer(name).problem
            if problem:
                raise UnsupportedOp(f"cannot train layer '{name}': {problem} (leave it out of the space's `layers`)")
        if not names:
            raise BadInput(f"search space '{self.name}' leaves no layer to train")
        return names

    def excluded_layers(self, model: Model) -> dict[str, str]:
        """Layers with parameters the study leaves frozen because planner cannot train them, and why."""
        searched = set(self.layer_names(model))
        return {
            layer.name: layer.problem
            for layer in model.layers
            if layer.problem and layer.name not in searched and (layer.weight or layer.bias)
        }

    @model_validator(mode="before")
    @classmethod
    def _argument_lists(cls, data: object) -> object:
        """Each mode's list of values, from the key its argument names (`ratios`, `ranks`)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        given = dict(data.pop("arguments", None) or {})
        for mode in MODES.values():
            if mode.argument is not None and mode.argument.plural in data:
                given[mode.name] = data.pop(mode.argument.plural)
        return {**data, "arguments": given}

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, given: dict[str, list[int | float]]) -> dict[str, list[int | float]]:
        lists = {}
        for mode in MODES.values():
            arg = mode.argument
            if arg is None:
                continue
            values = given.get(mode.name, list(arg.defaults))
            if not values:
                raise ValueError(f"{arg.plural} must list at least one {arg.name}, {arg.bounds}")
            lists[mode.name] = [arg.parse(v) for v in values]
        if set(given) - set(lists):
            raise ValueError(f"no mode '{next(iter(set(given) - set(lists)))}' carries a number")
        return lists

    @field_validator("modes")
    @classmethod
    def _some_mode(cls, v: list[str]) -> list[str]:
        for m in v:
            get_mode(m)
        if not [m for m in v if m != FROZEN]:
            raise ValueError(f"modes must include {' or '.join(m for m in MODES if m != FROZEN)}")
        return v

    @model_validator(mode="after")
    def _uniform_mode(self) -> SearchSpace:
        uniform = [m.name for m in plain()]
        if self.strategy in ("last-k", "all") and not set(self.modes) & set(uniform):
            raise ValueError(f"strategy {self.strategy} trains its layers in one mode: {' or '.join(uniform)}")
        return self

    def _allowed(self, model: Model, name: str) -> list[str]:
        """The space's modes a layer can take (no bias-only for a bias-free layer, a rank its
        weight takes, …)."""
        layer = model.layer(name)
        return [
            m
            for m in self.modes
            if get_mode(m).refuses(layer, None) is None and (get_mode(m).argument is None or self._values(layer, m))
        ]

    def _values(self, layer: Layer, mode: str) -> list[int | float]:
        """The numbers a layer in `mode` may carry: those of the space's list it takes."""
        return get_mode(mode).choices(layer, self.arguments[mode])

    def anchors(self, model: Model, *, lean: bool = False) -> list[dict[str, object]]:
        """The hand-made schemes this space contains, as Optuna parameters a study starts from.

        Why: the classic recipes — the last layer or two, every bias (TinyTL), every bias plus the
        last layer, every layer — sit along the accuracy/latency/memory front, where blind
        sampling of per-layer modes rarely lands (head-only is 1 draw in 3^(layers-1)). Starting
        there means a plan is never worse than the recipe a user would otherwise copy, and TPE
        refines between them. They run at the smallest batch size, the cheap end of the front;
        optimizer, lr, … stay to the sampler.

        `lean` (a microcontroller, where SRAM decides whether any plan exists) puts them at the
        cheap end of every setting that sizes a step's memory, as TinyEngine's recipe is: the
        optimizer with the least state it lists (plain SGD: none), its narrowest precision, int8
        frozen weights, updates in place, no micro-batches. Left to the sampler, 21 trials of
        `sparse-update` on MobileNetV2-w0.35 at 128x128 found no plan within 141 KiB: TPE kept
        momentum, whose state alone is 50 KiB.
        """
        names = self.layer_names(model)
        L = len(names)
        recipes = [("frozen", "full", 1), ("frozen", "full", 2), ("bias", "bias", 0), ("bias", "full", 1), ("full", "full", L)]
        found: list[dict[str, object]] = []
        for rest, head, k in recipes:
            wanted = [head if i >= L - k else rest for i in range(L)]
            params = self._anchor_params(model, names, wanted)
            if params is not None and params not in found:
                found.append(params)
        leanest = self._leanest() if lean else {}
        return [{**p, "batch_size": min(self.batch_size), **leanest} for p in found]

    def _leanest(self) -> dict[str, object]:
        """The parameters of the least memory a step's settings take in this space (`anchors`)."""
        bits = {Precision.INT8: 8, Precision.FP16: 16, Precision.BF16: 16, Precision.FP32: 32}
        params: dict[str, object] = {"precision": str(min(self.precision, key=bits.__getitem__))}
        # `Optimizer` lists them by state: none (SGD), one buffer a weight (momentum), two (Adam)
        params["optimizer"] = str(min(self.optimizer, key=list(Optimizer).index))
        if FrozenWeights.INT8 in self.frozen_weights:
            params["frozen_weights"] = str(FrozenWeights.INT8)
        if Updates.IN_PLACE in self.updates:
            params["updates"] = str(Updates.IN_PLACE)
        params["grad_accum"] = min(self.grad_accum)  # a micro-batch more holds a running sum per weight
        return params

    def _anchor_params(self, model: Model, names: list[str], wanted: list[str]) -> dict[str, object] | None:
        """Optuna parameters drawing `wanted` (a mode per layer) from this space, or None when it
        cannot (a mode it lacks, a mix its strategy cannot express)."""
        if any(m not in self.modes for m in set(wanted) - {"frozen"}):
            return None
        if self.strategy == "depths":
            return self._depth_params(wanted)
        modes = [m if m in self._allowed(model, n) else "frozen" for n, m in zip(names, wanted)]
        if "frozen" in modes and "frozen" not in self.modes and self.strategy != "last-k":
            return None
        if set(modes) == {"frozen"}:
            return None
        if self.strategy == "per-layer":
            return {f"mode:{n}": m for n, m in zip(names, modes)}
        first = next(i for i, m in enumerate(modes) if m != "frozen")
        if self.strategy == "sparse":
            return {"depth": len(names) - first, f"deepest_mode:{names[first]}": modes[first]} | {
                f"mode:{n}": m for n, m in zip(names[first + 1 :], modes[first + 1 :])
            }
        # last-k / all: one mode for the last k layers
        uniform = set(wanted[first:]) == {wanted[-1]} and set(wanted[:first]) <= {"frozen"}
        if not uniform or (self.strategy == "all" and first > 0):
            return None
        return {"mode": wanted[-1]} | ({"last_k": len(names) - first} if self.strategy == "last-k" else {})

    def _weight_modes(self) -> list[str]:
        """The modes a `depths` weight window may train in, each number its own choice (`full`,
        `ratio:0.25`, `lora:4`): one categorical, so the parameters never change with a draw."""
        return [
            str(Mode(m, v))
            for m in self.modes
            if m not in (FROZEN, "bias")
            for v in (self.arguments[m] if get_mode(m).argument is not None else [None])
        ]

    def _depth_params(self, wanted: list[str]) -> dict[str, object] | None:
        """`wanted` as `depths` parameters (biases anywhere, then full layers at the end), or None."""
        full = len(list(itertools.takewhile(lambda m: m == "full", reversed(wanted))))
        rest = set(wanted[: len(wanted) - full])
        weights = self._weight_modes()
        if rest - {"frozen", "bias"} or (weights and not full) or (full and "full" not in weights):
            return None
        params: dict[str, object] = {"weight_depth": full, "weight_mode": "full"} if weights else {}
        if "bias" in self.modes:
            params["bias_depth"] = len(wanted) - wanted.index("bias") if "bias" in rest else full
        return params

    def _depths(self, trial: Suggester, model: Model, names: list[str]) -> dict[str, str]:
        """A `depths` draw: each layer's mode from how far back biases and weights update.

        Both depths are drawn log-uniformly from 1 to every layer: most draws stay near the head,
        where backpropagation is cheap, and a sampler resolves the last few layers finely. The
        last layer always trains (a new task needs its classifier), so there is no depth 0, and in
        full when the weight mode would freeze some of its outputs (classes). The
        bias depth is how far back backpropagation reaches, and weights update within it (a
        weight depth beyond it counts as the bias depth): what a step costs follows one depth,
        as in TinyEngine's scheme, not the larger of two."""
        L, choices = len(names), self._weight_modes()
        bias = int(trial.suggest_int("bias_depth", 1, L, log=True)) if "bias" in self.modes else L
        weights = min(int(trial.suggest_int("weight_depth", 1, L, log=True)), bias) if choices else 0
        mode = Mode.parse(str(trial.suggest_categorical("weight_mode", choices))) if choices else None
        modes = {}
        for i, n in enumerate(names):
            allowed = self._allowed(model, n)
            if i == L - 1 and mode is not None and get_mode(mode.kind).freezes_outputs and "full" in allowed:
                # the classifier in full: a share of its output channels is a share of the classes
                # (TinyEngine's sparse update, too, always trains its classifier whole)
                modes[n] = "full"
            elif (
                mode is not None
                and i >= L - weights
                and mode.kind in allowed
                and (mode.value is None or mode.value in self._values(model.layer(n), mode.kind))
            ):
                modes[n] = str(mode)
            elif i >= L - bias and "bias" in allowed and "bias" in self.modes:
                # a layer in the weight window that cannot take its mode still updates its bias:
                # backpropagation reaches it anyway
                modes[n] = "bias"
        return modes

    def sample(self, trial: Suggester, model: Model) -> Candidate:
        """Draw one candidate: the trainable set by `strategy`, then batch, optimizer, lr, precision."""
        names = self.layer_names(model)
        if self.strategy == "depths":
            modes = self._depths(trial, model, names)
        elif self.strategy in ("per-layer", "sparse"):
            if self.strategy == "sparse":
                # log-uniform: most trials update few layers, where backpropagation is cheap
                names = names[len(names) - int(trial.suggest_int("depth", 1, len(names), log=True)) :]
            modes = {}
            for i, n in enumerate(names):
                allowed = self._allowed(model, n)
                if self.strategy == "sparse" and i == 0:
                    # the depth is how far back the update reaches: the deepest layer of the window
                    # trains (its own parameter name, so every name keeps one set of choices)
                    modes[n] = str(trial.suggest_categorical(f"deepest_mode:{n}", [m for m in allowed if m != "frozen"]))
                else:
                    modes[n] = str(trial.suggest_categorical(f"mode:{n}", allowed))
                arg = get_mode(modes[n]).argument
                if arg is not None:  # its number: a parameter of its own (`ratio:conv1`, `rank:fc`)
                    value = trial.suggest_categorical(f"{arg.name}:{n}", self._values(model.layer(n), modes[n]))
                    modes[n] = str(Mode(modes[n], value))
        else:
            k = int(trial.suggest_int("last_k", 1, len(names))) if self.strategy == "last-k" else len(names)
            # one mode for every layer: those that need no per-layer parameter (a ratio, a rank)
            mode = str(trial.suggest_categorical("mode", [m for m in self.modes if m in {p.name for p in plain()}]))
            modes = {n: mode for n in names[len(names) - k :]}
        # a layer without the parameters of its mode (bias-only of a bias-free conv) stays frozen
        trainable = tuple((n, Mode.parse(m)) for n, m in modes.items() if m != FROZEN and model.layer(n).params_for(m))
        batch_size = int(trial.suggest_categorical("batch_size", list(self.batch_size)))
        optimizer = Optimizer(trial.suggest_categorical("optimizer", [str(v) for v in self.optimizer]))
        return Candidate(
            trainable=trainable,
            batch_size=batch_size,
            optimizer=optimizer,
            lr=self._lr(trial, optimizer),
            precision=Precision(trial.suggest_categorical("precision", [str(v) for v in self.precision])),
            grad_accum=int(trial.suggest_categorical("grad_accum", list(self.grad_accum))),
            # drawn every trial (a fixed set of parameters), though an int8 candidate's are int8 (`Candidate`)
            frozen_weights=FrozenWeights(trial.suggest_categorical("frozen_weights", [str(v) for v in self.frozen_weights])),
            updates=Updates(trial.suggest_categorical("updates", [str(v) for v in self.updates])),
            recompute=Recompute(trial.suggest_categorical("recompute", [str(v) for v in self.recompute])),
        )


def load_space(name_or_path: str | None) -> SearchSpace:
    """A shipped space by name (`search_spaces/NAME.yaml`) or a user's YAML file."""
    return load_spec(name_or_path or DEFAULT_SPACE, SPACES_DIR, "search space", SearchSpace)
