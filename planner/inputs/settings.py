"""How a search runs and a plan is chosen: one validated object shared by `plan`, `work`, `measure` and the CLI.

Every number is checked here, before anything is loaded or written: a NaN tolerance found after
the last trial, or a negative step count burning every trial, would cost the user the whole study.
The checks are the fields' constraints; `_WHY` says each one in the words a user reads (with the
API's parameter names, which the CLI turns into its flags), and nothing else words them.

`StudyRecord` is what a study stores of the run that created it, so a worker joining it (and a
report of it) reads typed settings back, not a loose dict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from planner.errors import BadInput
from planner.inputs.defaults import DEFAULT_ACCURACY_STEPS, DEFAULT_TRIALS

SEED_MAX = 2**32 - 1  # numpy's and Optuna's samplers take seeds in [0, 2**32)
Policy = Literal["memory", "latency", "accuracy"]

# a field's constraint, in the user's words ({v}: the value given); the API's names, the CLI's flags
_WHY = {
    "trials": "`trials` must be at least 1",
    "timeout_s": "`timeout_s` must be a positive number of seconds (not {v:g})",
    "seed": f"`seed` must lie in 0..{SEED_MAX} (not {{v}})",
    "policy": "`policy` must be memory, latency or accuracy (not {v!r})",
    "accuracy_tolerance": "`accuracy_tolerance` must lie in 0..1, an accuracy a plan may give up (not {v:g})",
    "accuracy_steps": "`accuracy_steps` must be at least 1: accuracy is measured by fine-tuning (not {v})",
    "screen_steps": "`screen_steps` must lie in 0..{last}, fewer than `accuracy_steps` (0 fine-tunes every candidate for all "
    "of them; not {v})",
    "latency_repeats": "`latency_repeats` must be at least 1 (not {v})",
    "tune_trials": "`tune_trials` must be 0 (default schedules only) or more",
}


class Settings(BaseModel):
    """A run's settings, checked as they are made: `Settings(trials=40, seed=1)`."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    trials: int = Field(default=DEFAULT_TRIALS, ge=1, description="finished trials the study should hold")
    timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False, description="stop starting trials after this")
    seed: int = Field(default=0, ge=0, le=SEED_MAX, description="sampler and fine-tuning seed")
    policy: Policy = "memory"
    accuracy_tolerance: float = Field(default=0.01, ge=0, le=1, allow_inf_nan=False)
    accuracy_steps: int = Field(default=DEFAULT_ACCURACY_STEPS, ge=1, description="fine-tuning steps per candidate")
    # None: a quarter of accuracy_steps (`screen`); 0: every candidate fine-tuned for all of them
    screen_steps: int | None = Field(default=None, ge=0)
    latency_repeats: int = Field(default=10, ge=1)
    tune_trials: int = Field(default=0, ge=0, description="MetaSchedule trials per candidate build")
    sampler: Any = Field(default="tpe", description="a name (tpe, random) or an Optuna sampler object")
    anchors: bool = Field(default=True, description="start from the space's hand-made recipes (a sampler that takes them)")
    overlap: bool = Field(default=True, description="compile the next candidate during this one's fine-tune (local, 2+ cores)")
    budgets: tuple[int | str, ...] | None = Field(default=None, description="RAM budgets, a plan for each")
    cache_dir: Path | None = None

    @model_validator(mode="after")
    def _screen_below_accuracy(self) -> Settings:
        if self.screen_steps is not None and self.screen_steps >= self.accuracy_steps:
            raise ValueError("screen_steps")
        return self

    @property
    def screen(self) -> int:
        """The screening fine-tune's steps."""
        return self.accuracy_steps // 4 if self.screen_steps is None else self.screen_steps

    def __init__(self, **given: Any) -> None:
        """A value out of range is `BadInput` in `_WHY`'s words, not pydantic's report."""
        try:
            super().__init__(**given)
        except ValidationError as exc:
            raise _bad_input(exc, given) from None


def _bad_input(exc: ValidationError, given: dict[str, Any]) -> BadInput:
    err = exc.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else "screen_steps"  # (the model's own check)
    if field not in _WHY:
        return BadInput(f"`{field}`: {err['msg']}")
    try:
        last = given.get("accuracy_steps", DEFAULT_ACCURACY_STEPS) - 1
        return BadInput(_WHY[field].format(v=given.get(field), last=last))
    except (TypeError, ValueError):  # a value of the wrong kind for the message's format
        return BadInput(_WHY[field].split(" (not")[0])


class StudyRecord(BaseModel):
    """What `plan` stores with a study: where its inputs are and how it runs, for `work` and reports."""

    model_config = ConfigDict(extra="ignore")  # a newer planner's extra fields: read what is known

    model: str
    data: str
    preprocess: list | dict | None = None
    tokenizer: str | None = None
    classes: list[str] | None = None
    target: str
    space: str | None = None
    tracker: str | None = None
    key: str | None = None
    trials: int
    seed: int
    sampler: str
    anchors: bool
    accuracy_steps: int
    screen_steps: int = 0  # a study from before screening fine-tuned every candidate fully
    latency_repeats: int
    tune_trials: int = 0
