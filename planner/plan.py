"""The plan: which trial to deploy, and the versioned plan directory that carries it to the board.

Selection (documented in README): among *feasible* completed trials, find the best val accuracy;
every trial within `accuracy_tolerance` of it is "as good"; of those take the least peak memory
(`memory`, default) or the least median step latency (`latency`). `accuracy` takes the most
accurate trial outright (ties: least memory).

A plan directory is written into a temporary sibling and renamed into place, so a reader never
sees half a plan.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ValidationError

from . import __version__
from .errors import BadInput, NoFeasiblePlan, OutputUnwritable
from .outdir import prepare_out_dir, reason
from .compile import CompiledStep
from .graph import StepSignature
from .data import Dataset
from .model import Model
from .evaluate import TrialRecord
from .space import Candidate, split_mode
from .target import HardwareTarget

SCHEMA_VERSION = 1
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
        n_complete = sum(t.complete for t in trials)
        n_diverged = sum(t.complete and "diverged" in t.over_budget for t in trials)
        why = f" ({n_diverged} of them diverged while fine-tuning: lower the space's lr)" if n_diverged else ""
        raise NoFeasiblePlan(
            f"no feasible plan: {n_complete} of {len(trials)} trials completed, none within the target's budgets{why}"
        )
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
            "accuracy": f"fine-tuned on the planning host for {chosen.accuracy.steps} steps (seed {accuracy_seed}) "
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
    clash = sorted(set(model.data_files) & RESERVED_NAMES)
    if clash:
        raise BadInput(f"{model.path.name}: its external data file is named {clash[0]}, a name the plan directory uses; rename it (and re-save the model)")
    return {MODEL_FILE: model.path, **model.data_paths}


def write_plan_dir(out: Path, plan: Plan, files: dict[str, Path], weights: dict[str, np.ndarray], texts: dict[str, str]) -> None:
    """Write plan.json, copies of `files`, weights.npz and `texts` atomically into `out`.

    Everything goes into a temporary directory inside `out` first and is then renamed into
    place, plan.json last (its presence marks a complete plan). When a write fails (out of disk,
    a read-only file system, ...) the temporary directory is removed, an earlier plan in `out`
    stays as it was, and the failure is one `OutputUnwritable` line. Files already in `out` that
    are not part of a plan (e.g. the study database) are kept.
    """
    out = Path(out)
    created = not out.exists()
    out = prepare_out_dir(out)
    tmp, current, placing = None, None, False
    try:
        tmp = Path(tempfile.mkdtemp(dir=out, prefix=".plan-"))
        for name, source in files.items():
            current = name
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, tmp / name)
        current = WEIGHTS_FILE
        np.savez(tmp / WEIGHTS_FILE, **weights)
        for name, text in texts.items():
            current = name
            (tmp / name).write_text(text)
        current = PLAN_FILE
        (tmp / PLAN_FILE).write_text(json.dumps(plan.model_dump(), indent=2) + "\n")
        placing = True  # renames within one directory: they need no space
        (out / PLAN_FILE).unlink(missing_ok=True)
        names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        for name in [n for n in names if n != PLAN_FILE] + [PLAN_FILE]:
            current = name
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / name, out / name)
    except OSError as exc:
        state = f"{out} holds no complete plan (no {PLAN_FILE})" if placing else "nothing was written"
        raise OutputUnwritable(f"cannot write the plan into {out}: {reason(exc)} ({current}); {state}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if created and out.is_dir() and not any(out.iterdir()):
            with suppress(OSError):
                out.rmdir()  # the directory this call made, left empty by a failure


def read_plan(plan_dir: Path) -> Plan:
    path = plan_dir / PLAN_FILE
    if not path.is_file():
        raise BadInput(f"{plan_dir} holds no plan (no {PLAN_FILE}); make one with `planner plan`")
    try:
        plan = Plan.model_validate_json(path.read_text())
    except ValidationError as exc:
        raise BadInput(f"{path} is not a valid plan: {exc.errors()[0]['msg']}") from None
    if plan.schema_version != SCHEMA_VERSION:
        raise BadInput(f"{path} has schema version {plan.schema_version}; this planner reads {SCHEMA_VERSION}")
    return plan
