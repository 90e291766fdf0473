"""What every command starts from, loaded and checked once: the model, the data, the target and its runner.

`plan`, `work` and `measure` take the same inputs; here they are read, bound (a sequence model's
lengths to its data's) and checked — a target whose back end and runner do not fit, a model TVM
cannot import, a data file the plan directory could not hold — before anything is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.cachefile import default_cache_dir
from planner.errors import BadInput
from planner.inputs.calibration import calibrate
from planner.inputs.data import Dataset, bind_lengths, input_encodings, load_dataset
from planner.inputs.defaults import DEFAULT_DATA, DEFAULT_MODEL, DEFAULT_TARGET
from planner.inputs.model import Model, load_model
from planner.inputs.settings import Settings
from planner.inputs.targets import HardwareTarget, load_target
from planner.plans.directory import model_files
from planner.types import Precision

if TYPE_CHECKING:
    from planner.measurement import Runner


@dataclass(frozen=True)
class Inputs:
    """Where the inputs are, as a caller names them (None: the bundled example's)."""

    model: str | Path | None = None
    data: str | Path | None = None
    preprocess: Any = None  # images: the spec's text, a YAML path, or a recorded spec
    tokenizer: str | Path | None = None  # text: the tokenizer.json
    classes: list[str] | None = None  # class names by index, as a study recorded them
    target: str = DEFAULT_TARGET
    space: str | Path | None = None
    tracker: str | None = None
    key: str | None = None


INPUT_FIELDS = frozenset(f.name for f in fields(Inputs))
SETTING_FIELDS = frozenset(Settings.model_fields)


def split_options(
    function: str, options: Mapping[str, Any], settings: Settings | None, allowed: frozenset[str]
) -> tuple[Inputs, Settings]:
    """A call's keyword options as its inputs and its settings (those given over `settings`). An
    option the function does not take is the TypeError Python raises for any unknown keyword."""
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    given = {k: v for k, v in options.items() if k in SETTING_FIELDS}
    base = settings.model_dump() if settings is not None else {}
    inputs = Inputs(**{k: v for k, v in options.items() if k in INPUT_FIELDS})
    return inputs, Settings(**{**base, **given})


def resolve_target(name: str, *, tracker: str | None = None, key: str | None = None) -> HardwareTarget:
    """A target by name (`planner.list_targets()`) or YAML path; `tracker` and `key` (both or
    neither) move it onto RPC boards. A missing cross compiler, or a back end and runner that
    do not fit, is refused here."""
    from planner.backend import backend_class
    from planner.measurement import runner_for

    target = load_target(name)
    if (tracker is None) != (key is None):
        raise BadInput("`tracker` and `key` go together")
    if tracker is not None and key is not None:
        target = target.over_tracker(tracker, key)
    target.toolchain_path()  # a missing cross compiler is bad input, not N failed trials
    runner_for(target)
    backend_class(target.backend).check(target)  # settings its back end cannot build for: refused now
    return target


@dataclass(frozen=True)
class Loaded:
    """The inputs, read and checked."""

    model: Model
    dataset: Dataset
    target: HardwareTarget
    runner: Runner
    cache_dir: Path


def load_inputs(inputs: Inputs, settings: Settings, *, on_data: Callable[[int, int], None] | None = None) -> Loaded:
    """`inputs` read and checked, in the order a user fixes them: the model, the cache, the data
    (`on_data(samples, total)` while it is read once), the target; then what the model must be
    for a plan directory and for TVM's importer."""
    from planner.backend.cache import check_cache_dir
    from planner.backend.graph.importer import check_importable
    from planner.measurement import runner_for

    m = load_model(Path(inputs.model) if inputs.model else DEFAULT_MODEL)
    cache = check_cache_dir(settings.cache_dir or default_cache_dir())  # a file, read-only: one line, no trial burnt
    dataset = load_dataset(
        Path(inputs.data) if inputs.data else DEFAULT_DATA,
        m,
        preprocess=inputs.preprocess,
        tokenizer=inputs.tokenizer,
        classes=inputs.classes,
        cache_dir=cache,
        progress=on_data,
        task=settings.task,
    )
    m = bind_lengths(m, dataset)
    hw = resolve_target(inputs.target, tracker=inputs.tracker, key=inputs.key)
    if hw.input_bits == 8:  # the board takes its batches as 8-bit codes (a camera's pixels)
        m = m.encoded(input_encodings(m, dataset))
    model_files(m)  # a data file the plan directory cannot hold fails now, not after the study
    check_importable(m)
    return Loaded(m, dataset, hw, runner_for(hw), cache)


def for_precisions(loaded: Loaded, precisions: Iterable[Precision]) -> Loaded:
    """`loaded` with its model's activations calibrated on its data when a candidate may be int8
    (`precisions` lists it; ONNX Runtime runs the model over training samples, so not otherwise).
    A model ONNX Runtime cannot run stays uncalibrated: its int8 candidates fail, the others run."""
    if Precision.INT8 not in precisions:
        return loaded
    with contextlib.suppress(BadInput):
        return replace(loaded, model=loaded.model.calibrated(calibrate(loaded.model, loaded.dataset)))
    return loaded


def where(name_or_path: str | Path) -> str:
    """A target or space as a worker elsewhere finds it: a shipped name, or an absolute path."""
    path = Path(name_or_path)
    return str(path.resolve()) if path.is_file() else str(name_or_path)


def recorded_preprocess(raw, where: str):
    """A completed spec as a study or a plan records it (None: arrays, no preprocessing)."""
    from planner.inputs.preprocess import Preprocess

    return None if raw is None else Preprocess.from_json(raw, where)
