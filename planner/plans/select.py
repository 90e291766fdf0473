"""Which trial becomes the plan, and the plan that records it.

Selection: among *feasible* completed trials, find the best val accuracy; every trial within
`accuracy_tolerance` of it is "as good"; of those take the least peak memory (`memory`, default)
or the least median step latency (`latency`). `accuracy` takes the most accurate trial outright
(ties: least memory). Under `latency`, trials whose median is within the fastest one's spread
(its p90) are as fast: timing noise does not choose, memory does.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner import __version__
from planner.errors import NoFeasiblePlan
from planner.inputs.data import Dataset
from planner.inputs.model import Model
from planner.inputs.targets import HardwareTarget
from planner.plans.directory import TOKENIZER_FILE
from planner.plans.schema import (
    SCHEMA_VERSION,
    Choice,
    DatasetInfo,
    Measurement,
    Metrics,
    ModelInfo,
    ModelInput,
    ParetoEntry,
    Plan,
    Policy,
    Selection,
    Step,
    StudyInfo,
    TargetInfo,
)
from planner.search.fidelity import margin
from planner.types import Candidate, TrialRecord, TrialState

if TYPE_CHECKING:
    from planner.backend import Backend, BuiltArtifact
    from planner.measurement import Runner


def select(trials: list[TrialRecord], policy: Policy = "memory", accuracy_tolerance: float = 0.01) -> TrialRecord:
    """The trial to deploy (see the module docstring)."""
    feasible = [t for t in trials if t.feasible]
    if not feasible:
        finished = [t for t in trials if t.state.finished]
        n_complete = sum(t.complete for t in finished)
        ended = [t for t in finished if t.ended_over_budget]
        failed = [t.fail_reason or "no reason recorded" for t in finished if not t.complete and t not in ended]
        parts = [f"{n_complete} of {len(finished)} trials completed"]
        for what, these in (
            ("estimated over the RAM budget before compiling", [t for t in ended if t.memory_estimated]),
            ("too large for the board to link", [t for t in ended if not t.memory_estimated]),
        ):
            if these:
                least = min(t.memory.total for t in these if t.memory is not None)
                parts.append(f"{len(these)} {what} (the least at {least:,} bytes)")
        if n_complete:
            n_diverged = sum(t.complete and "diverged" in t.over_budget for t in finished)
            why = f" ({n_diverged} of them diverged while fine-tuning: lower the space's lr)" if n_diverged else ""
            parts.append(f"none within the target's budgets{why}")
        if failed:
            reason, count = Counter(failed).most_common(1)[0]
            parts.append(f"{len(failed)} failed, {count} of them with: {reason}")
        raise NoFeasiblePlan(f"no feasible plan: {'; '.join(parts)}")
    # a feasible trial is complete: `measured()` has its numbers; `quality` ranks any task's
    # metric higher-is-better (an error negated)
    best = max(feasible, key=lambda t: t.measured().accuracy.quality).measured().accuracy
    if policy == "accuracy":
        return min(feasible, key=lambda t: (-t.measured().accuracy.quality, t.measured().memory.total, t.number))
    slack = best.measure.slack(best.after, accuracy_tolerance)
    good = [t for t in feasible if t.measured().accuracy.quality >= best.quality - slack]
    if policy == "latency":
        # as fast: within the fastest's own spread (its p90): a median below it by less than
        # the timing's noise is no faster, and the least memory among them decides
        fastest = min(good, key=lambda t: t.measured().latency.median).measured().latency
        good = [t for t in good if t.measured().latency.median <= max(fastest.p90, fastest.median)]
    return min(good, key=lambda t: (t.measured().memory.total, t.measured().latency.median, t.number))


def learned(chosen: TrialRecord, n_val: int) -> tuple[bool, float]:  # n_val: `Dataset.judged`
    """Whether the chosen trial's fine-tune beat the model's starting val metric by more than
    the split's noise — two of the standard errors screening judges by (`fidelity.margin`) — and
    that margin. A plan that learned nothing is still a plan (its latency and memory hold) but
    must say so: it would fine-tune for nothing."""
    acc = chosen.measured().accuracy
    noise = 2 * margin(n_val, acc.measure, acc.before)
    return acc.measure.gain(acc.before, acc.after) > noise, noise


def choice_json(model: Model, cand: Candidate) -> dict:
    params = {name: model.layer(name).params_for(mode) for name, mode in cand.trainable}
    return Choice.of(cand, params).model_dump(mode="json")


def metrics_json(t: TrialRecord) -> dict:
    measured = t.measured()
    acc = measured.accuracy
    metrics = {
        "step_latency_ms": measured.latency.to_json(),
        "peak_memory_bytes": measured.memory.to_json(),
        "accuracy": {"before": acc.before, "after": acc.after, "steps": acc.steps, "metric": acc.metric},
        "library_bytes": t.library_bytes,
        "board": t.board,
    }
    if t.board_memory:
        metrics["board_memory"] = t.board_memory
    return metrics


def _dataset_json(dataset: Dataset) -> dict:
    """What plan.json records of the data; a tokenizer is named by its copy in the plan directory."""
    recorded = {**dataset.to_json(), "sha256": dataset.sha256}
    if recorded["tokenizer"] is not None:
        recorded["tokenizer"] = {"file": TOKENIZER_FILE, **recorded["tokenizer"]}
    return recorded


def target_record(target: HardwareTarget, runner: Runner) -> TargetInfo:
    """What plan.json records of the target: what it is, what builds its step, where that runs."""
    return TargetInfo(
        name=target.name, tvm_target=target.tvm_target, backend=target.backend, device=runner.device, toolchain=target.toolchain
    )


def step_record(artifact: BuiltArtifact, tune_trials: int) -> Step:
    """What plan.json records of the step: its files (by name in the plan directory) and how to call it."""
    return Step(
        kind=str(artifact.kind),
        files=[f.name for f in artifact.files],
        signature=artifact.signature.to_json(),
        kernels=artifact.kernels,
        tuned_kernels=list(artifact.tuned_kernels),
        tune_trials=tune_trials,
        in_place_updates=artifact.in_place_updates,
        requires=list(artifact.requires),
    )


@dataclass(frozen=True)
class Context:
    """How a plan's trials were run and chosen, as the plan records it: the selection, the study,
    the fine-tunes' seed, and the back end and runner whose words say how its numbers were taken."""

    selection: dict
    study: dict
    accuracy_seed: int
    backend: Backend
    runner: Runner


def assemble(
    model: Model,
    dataset: Dataset,
    target: HardwareTarget,
    trials: list[TrialRecord],
    chosen: TrialRecord,
    pareto: set[int],
    compiled: BuiltArtifact,
    context: Context,
) -> Plan:
    """The plan for `chosen`, with the Pareto front and how every number was measured (in the
    words of the back end that built its step and the runner that timed it)."""
    measured = chosen.measured()  # the chosen trial is feasible, so complete
    selection, study, accuracy_seed, backend, runner = (
        context.selection,
        context.study,
        context.accuracy_seed,
        context.backend,
        context.runner,
    )
    provenance = backend.provenance(compiled)
    return Plan(
        schema_version=SCHEMA_VERSION,
        model=ModelInfo(
            path=str(model.path),
            sha256=model.sha256,
            inputs=[ModelInput(name=i.name, shape=["batch", *i.shape], dtype=i.dtype) for i in model.exported.inputs],
            data_files=list(model.data_files),
        ),
        dataset=DatasetInfo.model_validate(_dataset_json(dataset)),
        target=target_record(target, runner),
        choice=Choice.model_validate(choice_json(model, measured.candidate)),
        metrics=Metrics.model_validate(metrics_json(chosen)),
        measurement=Measurement(
            latency=runner.latency_method(measured.latency),
            latency_estimated=runner.latency_estimated,
            memory=provenance.memory,
            schedules=provenance.schedules,
            accuracy=f"fine-tuned on the planning host for {measured.accuracy.steps} steps (seed "
            f"{accuracy_seed if chosen.seed is None else chosen.seed}) "
            "with a host build of the candidate's step; accuracy does not depend on the board",
            ram_budget_bytes=target.ram_budget_bytes,
            latency_budget_ms=target.latency_budget_ms,
            flash_budget_bytes=target.flash_budget_bytes,
        ),
        pareto=[
            ParetoEntry(
                trial=t.number,
                choice=Choice.model_validate(choice_json(model, t.measured().candidate)),  # on the front: complete
                metrics=Metrics.model_validate(metrics_json(t)),
            )
            for t in trials
            if t.number in pareto
        ],
        selection=Selection.model_validate({**selection, "trial": chosen.number, "n_feasible": sum(t.feasible for t in trials)}),
        step=step_record(compiled, backend.tune_trials),
        versions=versions(),
        study=StudyInfo.model_validate(
            {
                **study,
                "n_trials": sum(t.state.finished for t in trials),
                "n_failed": sum(t.state is TrialState.FAIL for t in trials),
            }
        ),
    )


def versions() -> dict:
    """The versions a plan was made with, read from the installed packages' metadata: writing a
    plan loads no compiler."""
    from importlib.metadata import version

    return {
        "planner": __version__,
        "tvm": version("apache-tvm"),
        "onnx": version("onnx"),
        "optuna": version("optuna"),
        "python": sys.version.split()[0],
    }
