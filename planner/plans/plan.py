"""The plan: which trial to deploy, and the versioned plan directory that carries it to the board.

Selection (documented in README): among *feasible* completed trials, find the best val accuracy;
every trial within `accuracy_tolerance` of it is "as good"; of those take the least peak memory
(`memory`, default) or the least median step latency (`latency`). `accuracy` takes the most
accurate trial outright (ties: least memory).

A plan directory is replaced atomically (`outdir.replace_files`), so a reader never sees half a
plan, and a reader verifies every file against plan.json before loading it.
"""

from __future__ import annotations

import json
from collections import Counter
import shutil
import sys
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ValidationError

from planner import __version__
from planner.errors import BadInput, NoFeasiblePlan, OutputUnwritable
from planner.digest import file_sha256
from planner.plans.directory import MARKER, STAGED_PREFIX, locked, prepare_out_dir, reading, release_if_empty, replace_files, safe_name
from planner.backend.compile import CompiledStep
from planner.backend.graph import StepSignature
from planner.inputs.data import Dataset
from planner.inputs.model import Model
from planner.search.evaluate import TrialRecord
from planner.inputs.spaces import Candidate, split_mode
from planner.inputs.targets import HardwareTarget

SCHEMA_VERSION = 2  # 2: `files`, the sha256 of every file a run loads
PLAN_FILE = "plan.json"
WEIGHTS_FILE = "weights.npz"
STEP_LIBRARY = "train_step.so"
MODEL_FILE = "model.onnx"
# every name a plan directory holds (the reports and the study database too): a model's external
# data file, copied in beside model.onnx, must not be one of them
RESERVED_NAMES = frozenset({PLAN_FILE, WEIGHTS_FILE, STEP_LIBRARY, MODEL_FILE, "report.md", "report.html", "trials.json", "study.db"})
Policy = Literal["memory", "latency", "accuracy"]


class ModelInfo(BaseModel):
    path: str
    sha256: str  # of the model file and its external data files
    inputs: list[dict]
    data_files: list[str] = []  # external data files, copied into the plan directory beside model.onnx


class DatasetInfo(BaseModel):
    source: str
    sha256: str
    n_train: int
    n_val: int
    n_classes: int


class TargetInfo(BaseModel):
    name: str
    tvm_target: dict
    device: str
    toolchain: str | None = None


class Choice(BaseModel):
    trainable: list[dict]  # {layer, params, mode}
    precision: str
    batch_size: int  # micro-batch: samples per forward/backward
    grad_accum: int = 1  # micro-batches per update
    frozen_weights: str = "fp32"  # int8: frozen Conv/Gemm/MatMul weights stored quantized
    updates: str = "copy"  # in-place: each update overwrites its weight during the backward pass
    optimizer: dict  # {name, lr}

    def candidate(self) -> Candidate:
        """The search's view of this choice (what compiles it and keys its caches)."""
        return Candidate(
            trainable=tuple((t["layer"], f"ratio:{t['ratio']:g}" if t["mode"] == "ratio" else t["mode"]) for t in self.trainable),
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            optimizer=self.optimizer["name"],
            lr=float(self.optimizer["lr"]),
            precision=self.precision,
            frozen_weights=self.frozen_weights,
            updates=self.updates,
        )


class Plan(BaseModel):
    schema_version: int
    model: ModelInfo
    dataset: DatasetInfo
    target: TargetInfo
    choice: Choice
    metrics: dict
    measurement: dict
    pareto: list[dict]
    selection: dict
    step: dict  # {library, signature}
    versions: dict
    study: dict
    files: dict[str, str] = {}  # name -> sha256 of each file `run` and `compile` load

    @property
    def signature(self) -> StepSignature:
        return StepSignature.from_json(self.step["signature"])

    def as_target(self) -> HardwareTarget:
        """The target this plan was built for, as far as the plan records it."""
        t = self.target
        return HardwareTarget(
            name=t.name, tvm_target=t.tvm_target, toolchain=t.toolchain,
            ram_budget_bytes=self.measurement["ram_budget_bytes"],
        )

    @property
    def candidate(self) -> Candidate:
        return self.choice.candidate()


def select(trials: list[TrialRecord], policy: Policy = "memory", accuracy_tolerance: float = 0.01) -> TrialRecord:
    """The trial to deploy (see the module docstring)."""
    feasible = [t for t in trials if t.feasible]
    if not feasible:
        finished = [t for t in trials if t.state in ("COMPLETE", "FAIL")]
        n_complete = sum(t.complete for t in finished)
        failed = [t.fail_reason or "no reason recorded" for t in finished if not t.complete]
        parts = [f"{n_complete} of {len(finished)} trials completed"]
        if n_complete:
            n_diverged = sum(t.complete and "diverged" in t.over_budget for t in finished)
            why = f" ({n_diverged} of them diverged while fine-tuning: lower the space's lr)" if n_diverged else ""
            parts.append(f"none within the target's budgets{why}")
        if failed:
            reason, count = Counter(failed).most_common(1)[0]
            parts.append(f"{len(failed)} failed, {count} of them with: {reason}")
        raise NoFeasiblePlan(f"no feasible plan: {'; '.join(parts)}")
    best = max(t.accuracy.after for t in feasible)
    if policy == "accuracy":
        return min(feasible, key=lambda t: (-t.accuracy.after, t.memory.total, t.number))
    good = [t for t in feasible if t.accuracy.after >= best - accuracy_tolerance]
    if policy == "latency":
        return min(good, key=lambda t: (t.latency.median, t.memory.total, t.number))
    return min(good, key=lambda t: (t.memory.total, t.latency.median, t.number))


def _entry(model: Model, name: str, mode: str) -> dict:
    kind, ratio = split_mode(mode)
    entry = {"layer": name, "params": list(model.layer(name).params_for(mode)), "mode": kind}
    if ratio is not None:
        entry["ratio"] = ratio  # share of the weight's output channels that train
    return entry


def choice_json(model: Model, cand: Candidate) -> dict:
    return {
        "trainable": [_entry(model, name, mode) for name, mode in cand.trainable],
        "precision": cand.precision,
        "batch_size": cand.batch_size,
        "grad_accum": cand.grad_accum,
        "frozen_weights": cand.frozen_weights,
        "updates": cand.updates,
        "optimizer": {"name": cand.optimizer, "lr": cand.lr},
    }


def metrics_json(t: TrialRecord) -> dict:
    metrics = {
        "step_latency_ms": t.latency.to_json(),
        "peak_memory_bytes": t.memory.to_json(),
        "accuracy": {"before": t.accuracy.before, "after": t.accuracy.after, "steps": t.accuracy.steps},
        "library_bytes": t.library_bytes,
        "board": t.board,
    }
    if t.board_memory:
        metrics["board_memory"] = t.board_memory
    return metrics


def assemble(
    model: Model,
    dataset: Dataset,
    target: HardwareTarget,
    trials: list[TrialRecord],
    chosen: TrialRecord,
    pareto: set[int],
    compiled: CompiledStep,
    selection: dict,
    study: dict,
    accuracy_seed: int,
    tune_trials: int = 0,
) -> Plan:
    """The plan for `chosen`, with the Pareto front and how every number was measured."""
    lat = chosen.latency
    where = "in-process on this machine" if target.runner == "local" else f"on a '{target.rpc.key}' board over TVM RPC"
    return Plan(
        schema_version=SCHEMA_VERSION,
        model={
            "path": str(model.path),
            "sha256": model.sha256,
            "inputs": [{"name": model.input_name, "shape": ["batch", *model.input_shape], "dtype": "float32"}],
            "data_files": list(model.data_files),
        },
        dataset={**dataset.to_json(), "sha256": dataset.sha256},
        target={"name": target.name, "tvm_target": target.tvm_target, "device": target.device, "toolchain": target.toolchain},
        choice=choice_json(model, chosen.candidate),
        metrics=metrics_json(chosen),
        measurement={
            "latency": f"TVM VM time_evaluator {where}, whole step (forward+backward+update); median and "
            f"p90 over {lat.repeats} repeats, each the mean of {lat.number} back-to-back steps; spread "
            f"{lat.min:.3f}-{lat.max:.3f} ms",
            "memory": "liveness over the compiled step after TVM static memory planning, replaying TVM's "
            "pooled allocator (page-rounded blocks reused by size, never returned), plus resident weights, "
            "optimizer state, the batch and the kernels' own workspace scratch (sizes read from the "
            "compiled code, replayed through TVM's workspace pool)",
            "schedules": f"{len(compiled.tuned_kernels)} of {compiled.kernels} kernels scheduled from the shared "
            f"MetaSchedule database (tuning trials for this step: {tune_trials}), the rest by planner's default "
            "CPU schedule",
            "accuracy": f"fine-tuned on the planning host for {chosen.accuracy.steps} steps (seed "
            f"{accuracy_seed if chosen.seed is None else chosen.seed}) "
            "with a host build of the candidate's step; accuracy does not depend on the board",
            "ram_budget_bytes": target.ram_budget_bytes,
            "latency_budget_ms": target.latency_budget_ms,
            "flash_budget_bytes": target.flash_budget_bytes,
        },
        pareto=[
            {"trial": t.number, "choice": choice_json(model, t.candidate), "metrics": metrics_json(t)}
            for t in trials
            if t.number in pareto
        ],
        selection={**selection, "trial": chosen.number, "n_feasible": sum(t.feasible for t in trials)},
        step={
            "library": STEP_LIBRARY,
            "signature": compiled.signature.to_json(),
            "kernels": compiled.kernels,
            "tuned_kernels": list(compiled.tuned_kernels),
            "tune_trials": tune_trials,
            "in_place_updates": compiled.in_place_updates,
        },
        versions=versions(),
        study={
            **study,
            "n_trials": sum(t.state in ("COMPLETE", "FAIL") for t in trials),
            "n_failed": sum(t.state == "FAIL" for t in trials),
        },
    )


def versions() -> dict:
    import onnx
    import optuna
    import tvm

    return {
        "planner": __version__,
        "tvm": tvm.__version__,
        "onnx": onnx.__version__,
        "optuna": optuna.__version__,
        "python": sys.version.split()[0],
    }


def model_files(model: Model) -> dict[str, Path]:
    """The files of `model` as a plan directory holds them: model.onnx and, under the names the
    model gives them, its external data files. BadInput when one would overwrite a plan file."""
    clash = sorted(n for n in model.data_files if n in RESERVED_NAMES or n.startswith((MARKER, STAGED_PREFIX)))
    if clash:
        raise BadInput(f"{model.path.name}: its external data file is named {clash[0]}, a name the plan directory uses; rename it (and re-save the model)")
    return {MODEL_FILE: model.path, **model.data_paths}


def write_plan_dir(out: Path, plan: Plan, files: dict[str, Path], weights: dict[str, np.ndarray], texts: dict[str, str]) -> Plan:
    """Write plan.json, copies of `files`, weights.npz and `texts` into `out`, atomically (see
    `outdir.replace_files`: the old plan stays whole, or the new one is complete, under kill -9 at
    any instant). plan.json, written last, records the sha256 of every file a run loads, and
    the plan with them is returned. Files already in `out` that are not part of a plan (the
    study database) are kept; an old plan's external data file the new model lacks is removed.
    """
    created = not Path(out).exists()
    out = prepare_out_dir(out)
    old_files = _plan_files(out)
    written = plan

    def fill(staged: Path) -> None:
        nonlocal written
        for name, source in files.items():
            (staged / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, staged / name)
        np.savez(staged / WEIGHTS_FILE, **weights)
        for name, text in texts.items():
            (staged / name).write_text(text)
        loaded = [*files, WEIGHTS_FILE]  # what `run` and `compile` load: verified before use
        written = plan.model_copy(update={"files": {name: file_sha256(staged / name) for name in loaded}})
        (staged / PLAN_FILE).write_text(json.dumps(written.model_dump(), indent=2) + "\n")

    try:
        with locked(out):
            replace_files(out, fill, last=PLAN_FILE, remove=tuple(sorted(set(old_files) - set(files) - {WEIGHTS_FILE})))
    except OutputUnwritable as exc:
        release_if_empty(out, created)  # nothing of a plan: no marker claiming one (nor a directory made for it)
        raise OutputUnwritable(str(exc).replace("cannot write into", "cannot write the plan into", 1)) from None
    return written


def _plan_files(out: Path) -> list[str]:
    """The files the plan now in `out` names (none when there is no readable plan)."""
    try:
        old = json.loads((out / PLAN_FILE).read_text())
        names = [*old.get("files", {}), *old.get("model", {}).get("data_files", [])]
    except (OSError, ValueError, AttributeError, TypeError):
        return []
    return [n for n in names if safe_name(n)]  # plan.json is read from disk: never `../x` or the study


def read_plan(plan_dir: Path, verify: bool = True) -> Plan:
    """The plan in `plan_dir`, validated; with `verify`, every file it names is checked against
    its recorded sha256 *before* anything is loaded — a truncated library would crash the loader,
    and a swapped one (another plan's, or code planted there) would run silently."""
    plan_dir = Path(plan_dir)
    if not plan_dir.is_dir():
        raise BadInput(f"{plan_dir} holds no plan (no {PLAN_FILE}); make one with `planner plan`")
    with reading(plan_dir):  # no writer replaces files while they are checked
        return _read_plan(plan_dir, verify)


def _read_plan(plan_dir: Path, verify: bool) -> Plan:
    path = plan_dir / PLAN_FILE
    if not path.is_file():
        raise BadInput(f"{plan_dir} holds no plan (no {PLAN_FILE}); make one with `planner plan`")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path} is not a valid plan: {exc}") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise BadInput(f"{path} has schema version {version}; this planner reads {SCHEMA_VERSION} (re-create the plan with `planner plan`)")
    try:
        plan = Plan.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise BadInput(f"{path} is not a valid plan: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    if verify:
        for name, digest in plan.files.items():
            file = plan_dir / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise BadInput(f"{path} names a file outside its directory: {name}")
            if not file.is_file():
                raise BadInput(f"{file} is missing; the plan needs it (copy the whole plan directory)")
            if file_sha256(file) != digest:
                raise BadInput(
                    f"{file} is not the file this plan was written with (sha256 differs): it was changed, "
                    "truncated or swapped; nothing was loaded — re-create or re-copy the plan"
                )
        missing = {STEP_LIBRARY, WEIGHTS_FILE, MODEL_FILE} - plan.files.keys()
        if missing:
            raise BadInput(f"{path} records no sha256 for {', '.join(sorted(missing))}; re-create the plan")
    return plan
