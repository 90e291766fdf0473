"""plan.json as typed models: what a plan records, validated whenever one is read.

Every number in a plan says how it was measured (`Measurement`), and every file a run loads is
named with its sha256 (`Plan.files`). `docs/plan.schema.json` is this module's JSON Schema
(`python -m planner.plans.schema` writes it; a test keeps the two in step). No TVM here: reading
a plan, reporting it or scripting over it loads no compiler.
"""

from __future__ import annotations

import hashlib
import json
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from planner.errors import BadInput
from planner.inputs.data import FORMATS
from planner.inputs.targets import HardwareTarget
from planner.modes import FROZEN, MODES
from planner.tasks import TASKS
from planner.types import (
    LEGACY_UPDATES,
    METRICS,
    Candidate,
    FrozenWeights,
    Mode,
    Optimizer,
    Precision,
    Recompute,
    StepSignature,
    Updates,
)

# 2: `files`, the sha256 of every file a run loads; 3: the dataset's format, classes, preprocessing; 4: text data's
# tokenizer; 5: the step as an artifact of a back end (`step.kind`, `step.files`, `target.backend`); 6: a layer's mode
# as one text (`ratio:0.25`, `lora:4`), as every mode writes itself (`planner.modes`); 8: the task (`dataset.task`) and
# the metric a fine-tune is judged by (`metrics.accuracy.metric`); 9: a step may take an input as 8-bit codes
# (`step.signature.inputs[].encoding`), which a reader that does not know them would cast; 10: `precision: int8`, its
# activations' scales (`step.signature.activations`), which a reader that does not know them would train in float
SCHEMA_VERSION: Final = 10
# a version-2 plan is a version-3 plan of a .npz, a version-3 plan one of data without a tokenizer, a version-4 plan one
# whose step is the VM back end's library (`Step._migrate`); a plan before version 6 is migrated by `Plan._migrate`
READS: Final = (2, 3, 4, 5, 6, 7, 8, 9, 10)
MODE_TEXTS: Final = ", ".join(
    m.text(None) if m.argument is None else f"{m.name}:R (R {m.argument.bounds}: {m.argument.name})"
    for m in MODES.values()
    if m.name != FROZEN
)
# the form of every mode's text; which modes there are is the registry's to say (`LayerUpdate._a_mode`)
MODE_PATTERN: Final = "^[a-z][a-z0-9_-]*(:[0-9][0-9.e+-]*)?$"
FORMAT_NAMES: Final = sorted(f.name for f in FORMATS)
Policy = Literal["memory", "latency", "accuracy"]


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelInput(_Part):
    name: str
    shape: list[int | str]  # "batch" for the batch dimension
    dtype: str


class ModelInfo(_Part):
    path: str
    sha256: str = Field(description="of the model file and its external data files")
    inputs: list[ModelInput]
    data_files: list[str] = Field(default=[], description="external data files, beside model.onnx in the plan directory")


class TokenizerInfo(_Part):
    """Text: how every text became the model's token ids, as Hugging Face tokenizers makes them."""

    file: str = Field(description="the tokenizer.json, copied into the plan directory; `planner run` tokenises with this copy")
    source: str = Field(description="where it was read from when the plan was made")
    sha256: str
    max_length: int = Field(ge=1, description="ids per text, the model's sequence length: longer texts truncated, shorter padded")
    padding: Literal["left", "right"] = Field(description="the side pad ids go on")
    truncation: Literal["left", "right"] = Field(description="the side a long text loses tokens from")
    pad_id: int = Field(ge=0)
    pad_token: str


class DatasetInfo(_Part):
    source: str
    sha256: str = Field(description="of the data, its labels and its preprocessing or tokenization")
    n_train: int
    n_val: int
    n_classes: int
    format: str = Field(
        default="npz",
        description="how the data is kept (planner.inputs.data.FORMATS)",
        json_schema_extra={"enum": list[JsonValue](FORMAT_NAMES)},
    )
    classes: list[str] | None = Field(default=None, description="class names by index, when the data names its classes")
    preprocess: list[dict] | None = Field(
        default=None,
        description="images: the steps from a decoded RGB image to the model's input, as torchvision "
        "transforms by name and parameters; `planner run` applies exactly these",
    )
    split: str = Field(default="", description="how train and val were drawn")
    tokenizer: TokenizerInfo | None = None
    task: str = Field(
        default="classification",
        description="what the model is trained for (planner.tasks.TASKS); a plan before version 8: classification",
        json_schema_extra={"enum": list[JsonValue](TASKS)},
    )

    @field_validator("task")
    @classmethod
    def _a_task(cls, v: str) -> str:
        if v not in TASKS:
            raise ValueError(f"unknown task {v!r} (one of {', '.join(TASKS)})")
        return v

    @field_validator("format")
    @classmethod
    def _a_format(cls, v: str) -> str:
        if v not in FORMAT_NAMES:
            raise ValueError(f"unknown dataset format {v!r} (one of {', '.join(FORMAT_NAMES)})")
        return v


class TargetInfo(_Part):
    name: str
    tvm_target: dict
    backend: str = Field(default="vm", description="the back end that built the step (planner.backend.BACKENDS)")
    device: str
    toolchain: str | None = None


class LayerUpdate(_Part):
    """One trained layer: its parameters and how they train."""

    layer: str
    params: list[str]
    mode: str = Field(description=f"how it trains (planner.modes): {MODE_TEXTS}", pattern=MODE_PATTERN)

    @field_validator("mode")
    @classmethod
    def _a_mode(cls, v: str) -> str:
        return str(Mode.parse(v))

    @property
    def update_mode(self) -> Mode:
        return Mode.parse(self.mode)


class OptimizerChoice(_Part):
    name: Optimizer
    lr: float = Field(gt=0)


class Choice(_Part):
    """The chosen training configuration, as people read it (and `candidate()` as planner does)."""

    trainable: list[LayerUpdate]
    precision: Precision
    batch_size: int = Field(ge=1, description="micro-batch: samples per forward/backward")
    grad_accum: int = Field(default=1, ge=1, description="micro-batches per update")
    frozen_weights: FrozenWeights = FrozenWeights.FP32
    updates: Updates = Field(description="in-place or copy (a plan of schema version 2-4 without it updated by copy)")
    recompute: Recompute | list[str] = Field(
        default=Recompute.NONE, description="none, auto, or the layers whose input activations the backward pass keeps"
    )
    optimizer: OptimizerChoice

    @classmethod
    def of(cls, candidate: Candidate, params: dict[str, tuple[str, ...]]) -> Choice:
        """`candidate` with each trained layer's parameters (`params`: layer -> names)."""
        return cls(
            trainable=[LayerUpdate(layer=name, params=list(params[name]), mode=str(mode)) for name, mode in candidate.trainable],
            precision=candidate.precision,
            batch_size=candidate.batch_size,
            grad_accum=candidate.grad_accum,
            frozen_weights=candidate.frozen_weights,
            updates=candidate.updates,
            recompute=list(candidate.recompute) if isinstance(candidate.recompute, tuple) else candidate.recompute,
            optimizer=OptimizerChoice(name=candidate.optimizer, lr=candidate.lr),
        )

    def candidate(self) -> Candidate:
        """The search's view of this choice (what compiles it and keys its caches)."""
        return Candidate(
            trainable=tuple((t.layer, t.update_mode) for t in self.trainable),
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            optimizer=self.optimizer.name,
            lr=self.optimizer.lr,
            precision=self.precision,
            frozen_weights=self.frozen_weights,
            updates=self.updates,
            recompute=self.recompute if isinstance(self.recompute, str) else tuple(self.recompute),
        )


class LatencyMetric(_Part):
    """Milliseconds per whole step: median and p90 over `repeats`, each the mean of `number` steps."""

    median: float
    p90: float
    min: float
    max: float
    repeats: int
    number: int
    device: str
    threads: int = Field(
        default=0, ge=0, description="how many of the pool's threads the step ran on (0: all); `planner run` uses as many"
    )


class MemoryMetric(_Part):
    """Bytes at the step's peak, by what holds them; `total` is their sum."""

    total: int
    activations: int
    trainable_params: int
    gradients: int
    optimizer_state: int
    frozen_params: int
    scratch: int = 0
    recompute_saved: int = Field(
        default=0, description="not part of total: the bytes the same step would hold more at its peak without recomputation"
    )


class AccuracyMetric(_Part):
    """The fine-tune's val metric before and after: accuracy, or the task's metric (`metric`)."""

    before: float
    after: float
    steps: int = Field(ge=0)
    metric: str = Field(
        default="accuracy",
        description="what before and after measure (planner.types.METRICS); a plan before version 8: accuracy",
        json_schema_extra={"enum": list[JsonValue](METRICS)},
    )

    @model_validator(mode="after")
    def _in_range(self) -> AccuracyMetric:
        if self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r} (one of {', '.join(METRICS)})")
        for value in (self.before, self.after):
            if not METRICS[self.metric].valid(value):
                raise ValueError(f"{self.metric} {value} is out of its range")
        return self


class BoardMemory(_Part):
    """The step's memory as the board's kernel counted it (`planner board serve` reports it)."""

    peak_rss_growth_bytes: int
    method: str


class Metrics(_Part):
    step_latency_ms: LatencyMetric
    peak_memory_bytes: MemoryMetric
    accuracy: AccuracyMetric
    library_bytes: int | None = None
    board: str | None = None
    board_memory: BoardMemory | None = None


class Measurement(_Part):
    """How each metric was measured, in words, and the budgets it was held to."""

    latency: str
    memory: str
    schedules: str
    accuracy: str
    latency_estimated: bool = Field(
        default=False, description="the step's milliseconds are computed from an instruction count, not timed"
    )
    ram_budget_bytes: int | None = None
    latency_budget_ms: float | None = None
    flash_budget_bytes: int | None = None
    retargeted_from: str | None = Field(
        default=None, description="set by `planner compile`: where latency and accuracy were measured"
    )


class ParetoEntry(_Part):
    trial: int
    choice: Choice
    metrics: Metrics


class ExcludedLayer(_Part):
    layer: str
    reason: str


class BudgetPlan(_Part):
    """One memory budget of a `planner plan --budgets` family and the plan chosen for it."""

    budget_bytes: int = Field(gt=0)
    directory: str = Field(description="the budget's plan directory, relative to this one")
    trial: int | None = Field(description="the trial chosen within the budget; None: no feasible trial fits")


class Selection(_Part):
    """Why this trial: the policy (or `scheme`, for `planner measure`) and what it chose from."""

    policy: Literal["memory", "latency", "accuracy", "scheme"]
    trial: int
    n_feasible: int
    accuracy_tolerance: float | None = None
    layers_searched: list[str] = []
    layers_excluded: list[ExcludedLayer] = []
    scheme: str | None = Field(default=None, description="policy scheme: the scheme file measured")
    feasible: bool | None = Field(default=None, description="policy scheme: whether it fits the budgets")
    over_budget: dict[str, float] = Field(default={}, description="policy scheme: budget -> how far over")
    budgets: list[BudgetPlan] = Field(default=[], description="a plan per RAM budget, chosen from the same trials")
    learned: bool | None = Field(
        default=None,
        description="whether the fine-tune beat the model's starting val accuracy by more than `accuracy_noise` "
        "(None: a plan from before planner judged it)",
    )
    accuracy_noise: float | None = Field(
        default=None, description="two standard errors of a val accuracy on the val split (at 0.5, the widest)"
    )


class Step(_Part):
    """The compiled training step: the back end's artifact (its kind and files) and how to call it."""

    kind: str = Field(description="what the files are: relax-vm, a shared library the Relax VM runs")
    files: list[str] = Field(min_length=1, description="the artifact's files in the plan directory, the entry point first")
    signature: dict
    kernels: int
    tuned_kernels: list[str] = []
    tune_trials: int = 0
    in_place_updates: int = 0
    requires: list[str] = Field(default=[], description="packages the step library needs where it runs (pip install them there)")

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: object) -> object:
        """A plan before version 5 names one `library`: the VM back end's only file."""
        if isinstance(data, dict) and "library" in data and "files" not in data:
            rest = {k: v for k, v in data.items() if k != "library"}
            return {**rest, "kind": "relax-vm", "files": [data["library"]]}
        return data


class StudyInfo(_Part):
    storage: str | None = Field(description="the study's storage URL, password redacted")
    name: str | None
    n_trials: int = 0
    n_failed: int = 0


def content_sha256(raw: dict) -> str:
    """The digest plan.json records of itself: of its JSON content without the `sha256` field,
    keys sorted, so a hand edit of any value (a learning rate, a trainable layer) shows, while
    the file's layout (indentation, key order) does not matter."""
    content = {k: v for k, v in raw.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Plan(_Part):
    """A plan: which trial to deploy, what it measured and how, and the files that carry it."""

    schema_version: Literal[2, 3, 4, 5, 6, 7, 8, 9, 10]
    model: ModelInfo
    dataset: DatasetInfo
    target: TargetInfo
    choice: Choice
    metrics: Metrics
    measurement: Measurement
    pareto: list[ParetoEntry]
    selection: Selection
    step: Step
    versions: dict[str, str]
    study: StudyInfo
    files: dict[str, str] = Field(default={}, description="name -> sha256 of each file `run` and `compile` load")
    sha256: str | None = Field(
        default=None,
        description="from version 7: the sha256 of this plan's own content, every field but this one (`content_sha256`)",
    )

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: object) -> object:
        """The choices of a plan before version 6 as version 6 writes them (`_old_choice`)."""
        version = data.get("schema_version") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(version, int) or version >= 6:
            return data
        migrated = dict(data)
        if "choice" in data:
            migrated["choice"] = _old_choice(data["choice"], version)
        if isinstance(data.get("pareto"), list):
            migrated["pareto"] = [
                {**entry, "choice": _old_choice(entry["choice"], version)}
                if isinstance(entry, dict) and "choice" in entry
                else entry
                for entry in data["pareto"]
            ]
        return migrated

    @property
    def signature(self) -> StepSignature:
        return StepSignature.from_json(self.step.signature)

    @property
    def candidate(self) -> Candidate:
        return self.choice.candidate()

    def as_target(self) -> HardwareTarget:
        """The target this plan was built for, as far as the plan records it."""
        t = self.target
        ram = self.measurement.ram_budget_bytes
        if ram is None:  # `planner plan` always records it; a plan edited by hand may not
            raise BadInput("the plan records no RAM budget (measurement.ram_budget_bytes): name a target instead")
        return HardwareTarget(
            name=t.name, tvm_target=t.tvm_target, toolchain=t.toolchain, backend=t.backend, ram_budget_bytes=ram
        )


def _old_choice(choice: object, version: int) -> object:
    """A choice of a plan of schema `version` (before 6) as version 6 writes it (`Plan._migrate`):

    - before version 5 a choice may lack `updates`: a planner whose steps all updated by copy
      wrote it (`LEGACY_UPDATES`); from version 5 every choice says how it updates, so that no
      new plan updates by copy for want of the field;
    - before version 6 a layer's mode kept its number apart (`mode: ratio, ratio: 0.25`).
    """
    if not isinstance(choice, dict):
        return choice
    if version < 5:
        choice = {"updates": LEGACY_UPDATES, **choice}
    if isinstance(choice.get("trainable"), list):
        choice = {**choice, "trainable": [_old_layer_update(t) for t in choice["trainable"]]}
    return choice


def _old_layer_update(entry: object) -> object:
    """`{mode: ratio, ratio: 0.25}` -> `{mode: "ratio:0.25"}`; `{mode: lora, rank: 4}` -> `{mode: "lora:4"}`."""
    if not isinstance(entry, dict):
        return entry
    entry = dict(entry)
    ratio, rank = entry.pop("ratio", None), entry.pop("rank", None)
    number = ratio if ratio is not None else rank
    if number is not None and isinstance(entry.get("mode"), str):
        entry["mode"] = f"{entry['mode']}:{number}"
    return entry


def json_schema() -> str:
    """plan.json's JSON Schema, as `docs/plan.schema.json` holds it."""
    return json.dumps(Plan.model_json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(json_schema(), end="")
