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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from planner.errors import BadInput
from planner.inputs.defaults import DEFAULT_ACCURACY_STEPS, DEFAULT_TRIALS
from planner.tasks import TASKS

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
    "task": f"`task` must be one of {', '.join(TASKS)} (not {{v!r}})",
}


def _setting(default: Any, help: str, *, flag: str | None = "", study: bool = False, **check: Any) -> Any:
    """A setting's field: its `help` (the API's and the CLI's words), its command-line `flag`
    ("": the field's name as one, `--accuracy-steps`; None: none) and whether a `study` stores
    it, so a worker joining the study runs with it (`StudyRecord`)."""
    return Field(default, description=help, json_schema_extra={"flag": flag, "study": study}, **check)


class Settings(BaseModel):
    """A run's settings, checked as they are made: `Settings(trials=40, seed=1)`.

    The one place a setting is declared: the API takes it by name, the CLI derives its flag
    (`planner.cli._settings`), a study stores it and `work` reads it back (`StudyRecord`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    trials: int = _setting(
        DEFAULT_TRIALS, "finished trials the study should hold; a rerun only adds the missing ones", study=True, ge=1
    )
    timeout_s: float | None = _setting(
        None, "stop starting new trials after this many seconds", flag="--timeout", gt=0, allow_inf_nan=False
    )
    seed: int = _setting(0, "sampler and fine-tuning seed", study=True, ge=0, le=SEED_MAX)
    policy: Policy = _setting(
        "memory",
        "pick the least memory / least latency among trials within --accuracy-tolerance of the best, or the most accurate",
        flag="--select",
    )
    accuracy_tolerance: float = _setting(
        0.01, "accuracy a plan may give up against the best feasible trial", ge=0, le=1, allow_inf_nan=False
    )
    accuracy_steps: int = _setting(DEFAULT_ACCURACY_STEPS, "fine-tuning steps per candidate for its accuracy", study=True, ge=1)
    # None: a quarter of accuracy_steps (`screen`); 0: every candidate fine-tuned for all of them
    screen_steps: int | None = _setting(
        None,
        "fine-tune every candidate this many steps first and go on to --accuracy-steps only when no finished trial "
        "is better by then (more accurate, no slower, no larger); the space's hand-made recipes always get all steps, "
        "screened-out trials are never the plan. 0: every candidate gets all steps [default: a quarter of --accuracy-steps]",
        study=True,
        ge=0,
    )
    latency_repeats: int = _setting(10, "timed repeats of each candidate's step", flag=None, study=True, ge=1)
    tune_trials: int = _setting(
        0,
        "MetaSchedule trials spent on each compiled step, into one tuning database shared by every candidate and plan "
        "(0: planner's default schedules only; about 3-20 s per trial on 2 cores)",
        study=True,
        ge=0,
    )
    sampler: Any = _setting("tpe", "a name (tpe, random) or an Optuna sampler object", study=True)
    anchors: bool = _setting(True, "start from the space's hand-made recipes (a sampler that takes them)", flag=None, study=True)
    overlap: bool = _setting(
        True,
        "two trials at a time on this machine (2+ cores): compile the next candidate while this one fine-tunes "
        "(latency is still timed alone; same candidates for a seed). A candidate that crashes planner also cuts "
        "short the trial beside it: both run again, each alone. --no-overlap: one at a time",
    )
    budgets: tuple[int | str, ...] | None = _setting(
        None,
        "RAM budgets, comma-separated (e.g. 256KiB,1MiB,4MiB): a plan for each from the same trials, in OUT/<budget>/, "
        "so a device takes the one that fits; the study keeps the trials within the largest, and the report marks "
        "every budget [default: the target's ram_budgets, if it lists any]",
    )
    cache_dir: Path | None = _setting(None, "the compile cache [default: PLANNER_CACHE_DIR, else ~/.cache/planner]", flag=None)
    task: str | None = _setting(
        None,
        f"what the model is trained for: {', '.join(TASKS)} [default: inferred from the model's output and the data's "
        "labels: class indices or names are classification, 0/1 rows multilabel, floats regression, a label per "
        "token token-classification, no labels reconstruction]",
        study=True,
    )

    @field_validator("task")
    @classmethod
    def _known_task(cls, v: str | None) -> str | None:
        if v is not None and v not in TASKS:
            raise ValueError("task")
        return v

    @classmethod
    def flag(cls, name: str) -> str | None:
        """The command-line flag of setting `name` (None: not on the command line)."""
        extra = cls.model_fields[name].json_schema_extra
        assert isinstance(extra, dict)
        flag = extra["flag"]
        return f"--{name.replace('_', '-')}" if flag == "" else flag  # type: ignore[return-value]

    @classmethod
    def study_fields(cls) -> tuple[str, ...]:
        """The settings a study stores: what a worker joining it must run with."""
        return tuple(
            n for n, f in cls.model_fields.items() if isinstance(f.json_schema_extra, dict) and f.json_schema_extra["study"]
        )

    def study_json(self) -> dict[str, Any]:
        """The study's settings as it stores them: screening resolved, a sampler object by its class."""
        out = self.model_dump(include=set(self.study_fields()), mode="json")
        out["screen_steps"] = self.screen
        sampler = self.sampler
        out["sampler"] = sampler if isinstance(sampler, str) else f"{type(sampler).__module__}.{type(sampler).__qualname__}"
        return out

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
    """What `plan` stores with a study, for `work` and reports: where its inputs are, and beside
    them the settings a study keeps (`Settings.study_fields`), so a new setting is stored and
    read back without a word here."""

    model_config = ConfigDict(extra="allow")  # the study's settings (and a newer planner's fields)

    model: str
    data: str
    preprocess: list | dict | None = None
    tokenizer: str | None = None
    classes: list[str] | None = None
    target: str
    space: str | None = None
    tracker: str | None = None
    key: str | None = None

    @classmethod
    def of(cls, settings: Settings, **inputs: Any) -> StudyRecord:
        return cls(**inputs, **settings.study_json())

    @property
    def sampler(self) -> str:
        """The study's sampler: a name, or the class of a sampler object a script gave."""
        return str((self.model_extra or {}).get("sampler", "tpe"))

    def settings(self, **here: Any) -> Settings:
        """The study's settings, with this process's own (`here`: overlap, the cache) beside them."""
        stored = {k: v for k, v in (self.model_extra or {}).items() if k in Settings.study_fields()}
        stored.setdefault("screen_steps", 0)  # a study from before screening fine-tuned every candidate fully
        return Settings(**stored, **here)
