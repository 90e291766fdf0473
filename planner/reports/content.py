"""What a report shows, gathered once from a plan directory or a study; renderers only format it.

A plan directory carries everything: plan.json (the choice, its metrics, how they were measured),
trials.json (every trial of the study that chose it) and model.onnx (the layer table). A study in
storage carries the trials and where its model lives; its report marks the trial `planner plan`
would choose (default policy) instead of a written plan.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from planner.errors import BadInput, NoFeasiblePlan
from planner.inputs.data import format_named
from planner.inputs.model import Model, load_model
from planner.inputs.preprocess import Preprocess
from planner.inputs.targets import load_target
from planner.modes import FROZEN, MODES
from planner.plans.directory import MODEL_FILE, TRIALS_FILE, read_plan
from planner.plans.schema import ParetoEntry, Plan
from planner.plans.select import choice_json, metrics_json, select
from planner.search.urls import redact
from planner.types import (
    ACCURACY,
    AccuracyResult,
    Latency,
    MemoryBreakdown,
    Metric,
    Mode,
    TrialRecord,
    TrialResult,
    TrialState,
    metric_named,
)

MEMORY_PARTS = ("activations", "trainable_params", "gradients", "optimizer_state", "frozen_params", "scratch")


@dataclass(frozen=True)
class ReportContent:
    title: str
    target: dict  # name, device, ram_budget_bytes, latency_budget_ms
    trials: list[TrialRecord]
    pareto: list[int]  # trial numbers on the feasible Pareto front
    chosen: int | None  # the deployed (or, for a bare study, the would-be) trial
    choice: dict | None  # what the chosen trial trains, as plan.json's "choice"
    metrics: dict | None  # the chosen trial's numbers, as plan.json's "metrics"
    layers: list[dict]  # per layer: name, op, param_bytes, mode, label, color, params
    provenance: dict  # how every number was measured; versions; the study
    plan: Plan | None = None

    @property
    def metric(self) -> Metric:
        """The metric the study's fine-tunes were judged by (accuracy, for a study with none complete)."""
        return next((t.measured().accuracy.measure for t in self.trials if t.complete), ACCURACY)

    @property
    def budgets(self) -> list[dict]:
        """The plan per RAM budget (`planner plan --budgets`): budget_bytes, directory, trial."""
        return [] if self.plan is None else [b.model_dump() for b in self.plan.selection.budgets]

    @property
    def latency_note(self) -> str:
        """What the headline latency is, where it is not a timing on the target."""
        if self.plan is None:
            return ""
        if self.plan.measurement.retargeted_from is not None:
            return f" (measured on {self.plan.measurement.retargeted_from}, not on this target)"
        if self.plan.measurement.latency_estimated:
            return " (an estimate: instructions counted on the emulated core, at one per cycle)"
        return ""

    @property
    def flash(self) -> tuple[int, int] | None:
        """(bytes the step stores, the target's flash budget), for a target with a flash budget."""
        if self.plan is None or self.plan.measurement.flash_budget_bytes is None or self.plan.metrics.library_bytes is None:
            return None
        return self.plan.metrics.library_bytes, self.plan.measurement.flash_budget_bytes

    @property
    def warnings(self) -> list[str]:
        """What a reader must know before any figure, in the words the report leads with."""
        if self.plan is None:
            return []
        found = []
        sel, acc = self.plan.selection, self.plan.metrics.accuracy
        if sel.learned is False:
            m = metric_named(acc.metric)
            found.append(
                f"This plan learned nothing: val {m.name} {m.text(acc.before)} → {m.text(acc.after)} is within the val "
                f"split's noise (±{sel.accuracy_noise:.3g}). Fine-tuning with it would not improve the model."
            )
        origin = self.plan.measurement.retargeted_from
        if origin is not None:
            found.append(
                f"Compiled for {self.plan.target.name} from a plan made on {origin}: its step latency and accuracy "
                f"were measured there, not on {self.plan.target.name} (its memory was planned for this build). "
                f"Plan with --target {self.plan.target.name} to measure here."
            )
        return found

    @property
    def counts(self) -> dict[str, int]:
        c = Counter(
            "feasible"
            if t.feasible
            else "screened"
            if t.screened_out
            else "infeasible"
            if t.complete or t.ended_over_budget
            else t.state.lower()
            for t in self.trials
        )
        return {k: c.get(k, 0) for k in ("feasible", "screened", "infeasible", "fail", "running")}

    def to_json(self) -> dict:
        return {
            "title": self.title,
            "target": self.target,
            "chosen": self.chosen,
            "choice": self.choice,
            "metrics": self.metrics,
            "pareto": self.pareto,
            "counts": self.counts,
            "warnings": self.warnings,
            "layers": self.layers,
            "provenance": self.provenance,
            "trials": [t.to_json() for t in self.trials],
        }


def write_trials(trials: list[TrialRecord]) -> str:
    """trials.json's text."""
    return json.dumps([t.to_json() for t in trials], indent=1) + "\n"


def _workers(trials: list[TrialRecord]) -> str | None:
    """Which processes ran the trials, and how many each (None when the records do not say)."""
    counts = Counter(t.worker for t in trials if t.worker)
    return ", ".join(f"{w}: {n}" for w, n in counts.most_common()) or None


def _layer_map(model: Model, choice: dict | None) -> list[dict]:
    trains = {t["layer"]: t for t in (choice or {}).get("trainable", [])}
    frozen = "frozen" if not choice or choice.get("frozen_weights", "fp32") == "fp32" else f"frozen ({choice['frozen_weights']})"
    precision = choice["precision"] if choice else None  # every trained layer's
    rows = []
    for layer in model.layers:
        t = trains.get(layer.name)
        mode = Mode.parse(t["mode"]) if t else None
        rows.append(
            {
                "layer": layer.name,
                "op": layer.op,
                "param_bytes": layer.param_bytes,
                "mode": str(mode) if mode else FROZEN,
                "label": mode.label if mode else frozen,  # `ratio 0.25`, `frozen (int8)`
                "color": (mode.spec if mode else MODES[FROZEN]).color,
                "params": t["params"] if t else [],
                "precision": precision if t else None,
                "excluded": layer.problem,  # why planner cannot train it (it stays frozen), None when it can
            }
        )
    return rows


def updated(row: dict) -> str:
    """A per-layer row's "parameters updated" cell: the parameters, or why there are none."""
    if row["params"]:
        return ", ".join(row["params"])
    return f"— (not trainable: {row['excluded']})" if row.get("excluded") else "—"


def recompute_note(choice: dict, memory: dict, kept: tuple[str, ...] | list[str]) -> str:
    """One sentence on a recomputing step: what it keeps and the memory that saved."""
    saved = memory.get("recompute_saved", 0)
    if choice.get("recompute") == "auto" and not kept and saved == 0:
        return "Recomputation (`auto`): no cut lowered this step's peak, so it keeps every activation."
    keeps = f"the inputs of {', '.join(kept)}" if kept else "only the step's inputs"
    effect = f"{saved:,} bytes less at the peak" if saved >= 0 else f"{-saved:,} bytes more at the peak"
    how = "chosen by `auto`" if choice.get("recompute") == "auto" else "as the scheme lists"
    return f"Recomputation ({how}): the backward pass keeps {keeps} and recomputes the other activations; {effect} than keeping them all."


def from_plan_dir(plan_dir: str | Path) -> ReportContent:
    plan_dir = Path(plan_dir)
    plan = read_plan(plan_dir)
    trials_path = plan_dir / TRIALS_FILE
    if trials_path.is_file():
        trials = [TrialRecord.from_json(d) for d in json.loads(trials_path.read_text())]
    else:  # a plan written before trials.json existed: its Pareto front is all it kept
        trials = [_pareto_record(p) for p in plan.pareto]
    return from_plan(plan, load_model(plan_dir / MODEL_FILE), trials)


def _data(plan: Plan) -> str:
    """The data a plan was measured on, and how a file (or a text) became the model's input."""
    d = plan.dataset
    kind = format_named(d.format).description  # every registered format has one
    held = f"{d.n_classes} classes" if d.task == "classification" else f"task {d.task}"
    text = f"{kind}, {d.source}: {d.n_train} train, {d.n_val} val ({d.split or 'as given'}), {held}"
    if d.preprocess is not None:
        text += f"; preprocessing {Preprocess.from_json(d.preprocess, 'plan.json')}"
    if d.tokenizer is not None:
        t = d.tokenizer
        text += (
            f"; tokenised by {t.file} (sha256 {t.sha256[:12]}): {t.max_length} ids a text, "
            f"padded on the {t.padding} with {t.pad_token} ({t.pad_id}), truncated on the {t.truncation}"
        )
    return text


def from_plan(plan: Plan, model: Model, trials: list[TrialRecord]) -> ReportContent:
    """The report of a plan (as it is being written, or read back) and the trials behind it."""
    choice = plan.choice.model_dump(mode="json")
    lat = plan.metrics.step_latency_ms
    measurement = plan.measurement.model_dump()
    provenance = {
        **{
            k: v for k, v in measurement.items() if v is not None and not k.endswith("_budget_bytes") and k != "latency_budget_ms"
        },
        "device": lat.device,
        "board": plan.metrics.board,
        "repeats": f"{lat.repeats} × {lat.number} steps; median {lat.median:.3f} ms, p90 {lat.p90:.3f} ms, "
        f"spread {lat.min:.3f}–{lat.max:.3f} ms",
        "data": _data(plan),
        "study": f"{plan.study.name} in {plan.study.storage}" if plan.study.storage else "none (one measured scheme)",
        "trials per process": _workers(trials),
        "versions": ", ".join(f"{k} {v}" for k, v in plan.versions.items()),
    }
    return ReportContent(
        title=f"Training plan: {Path(plan.model.path).name} on {plan.target.name}",
        target={
            "name": plan.target.name,
            "device": plan.target.device,
            "ram_budget_bytes": plan.measurement.ram_budget_bytes,
            "latency_budget_ms": plan.measurement.latency_budget_ms,
        },
        trials=trials,
        pareto=[p.trial for p in plan.pareto],
        chosen=plan.selection.trial,
        choice=choice,
        metrics=plan.metrics.model_dump(exclude_none=True),
        layers=_layer_map(model, choice),
        provenance=provenance,
        plan=plan,
    )


def _pareto_record(entry: ParetoEntry) -> TrialRecord:
    m = entry.metrics.model_dump()
    acc = {**m["accuracy"], "loss_before": float("nan"), "loss_after": float("nan"), "seconds": 0.0}
    result = TrialResult(
        candidate=entry.choice.candidate(),
        accuracy=AccuracyResult(**acc),
        latency=Latency(**m["step_latency_ms"]),
        memory=MemoryBreakdown(**m["peak_memory_bytes"]),
    )
    return TrialRecord.of(entry.trial, TrialState.COMPLETE, result, {})


def from_study(storage: str, study: str) -> ReportContent:
    """A report of a study in storage (finished or still running), before or without a plan."""
    from planner.search.records import load_records

    records, pareto, inputs = load_records(storage, study)
    target = load_target(inputs["target"])
    try:
        model = load_model(inputs["model"])
    except BadInput:
        model = None  # the model moved: the report goes on without the per-layer map
    try:
        chosen = select(records)
    except NoFeasiblePlan:
        chosen = None
    choice = choice_json(model, chosen.measured().candidate) if chosen is not None and model is not None else None
    return ReportContent(
        title=f"Study {study}: {Path(inputs['model']).name} on {target.name}",
        target={
            "name": target.name,
            # where its trials were timed (a report loads no runner: that would load a compiler)
            "device": next((r.latency.device for r in records if r.latency is not None), target.runner),
            "ram_budget_bytes": target.ram_budget_bytes,
            "latency_budget_ms": target.latency_budget_ms,
        },
        trials=records,
        pareto=pareto,
        chosen=chosen.number if chosen else None,
        choice=choice,
        metrics=metrics_json(chosen) if chosen else None,
        layers=_layer_map(model, choice) if model is not None else [],
        provenance={
            "study": f"{study} in {redact(storage)}",
            "latency": f"TVM VM time_evaluator per trial, median of {inputs['latency_repeats']} repeats",
            "accuracy": f"fine-tuned {inputs['accuracy_steps']} steps (seed {inputs['seed']}) per trial",
            "selection": "the trial `planner plan` would choose (least memory within 0.01 of the best accuracy); no plan written",
            "trials per process": _workers(records),
        },
    )
