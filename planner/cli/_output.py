"""Where commands print: results to stdout (a table, or JSON with --json), progress and errors
to stderr, both without rich's markup (names and paths are printed as they are)."""

from __future__ import annotations

from rich.console import Console

from planner.types import metric_named
from planner.units import kib

stderr = Console(stderr=True)
stdout = Console()


def say(text: str) -> None:
    """One result line on stdout."""
    stdout.print(text, markup=False, highlight=False, soft_wrap=True)


def note(text: str) -> None:
    """One line on stderr (a warning, where a file went)."""
    stderr.print(text, markup=False, highlight=False, soft_wrap=True)


def measured_line(check) -> str:
    """`planner run`'s figures beside the plan's (a `RunCheck`)."""
    step = (
        f"step {check.step_ms:.3f} ms measured (median of {check.steps_timed}, p10-p90 "
        f"{check.step_ms_p10:.3f}-{check.step_ms_p90:.3f})"
        if check.step_ms is not None
        else "step not timed"
    )
    memory = f"memory {kib(check.memory_bytes)} measured" if check.memory_bytes is not None else "memory not measured"
    return f"{step} vs {check.planned_step_ms:.3f} ms planned; {memory} vs {kib(check.planned_memory_bytes)} planned"


def learned_nothing(plan) -> str:
    """The line a plan that learned nothing ends with (exit 4), and what to try."""
    acc, sel = plan.metrics.accuracy, plan.selection
    m = metric_named(acc.metric)
    return (
        f"warning: the plan learned nothing: val {m.name} {m.text(acc.before)} → {m.text(acc.after)} after {acc.steps} steps "
        f"is within the val split's noise (±{sel.accuracy_noise:.3g}); try more --accuracy-steps or --trials, "
        "or a space that trains more layers (--space full)"
    )


def plan_summary(result) -> None:
    """The line `plan` and `measure` end with: what the plan trains and what it measured."""
    p = result.plan
    m = p.metrics
    metric = metric_named(m.accuracy.metric)
    say(
        f"plan written to {result.out}/: trial {p.selection.trial}, trains "
        f"{', '.join(f'{t.layer}:{t.update_mode}' for t in p.choice.trainable)}; batch {p.choice.batch_size}; "
        f"val {metric.short} {metric.text(m.accuracy.before)} → {metric.text(m.accuracy.after)}; "
        f"step {m.step_latency_ms.median:.2f} ms; peak {kib(m.peak_memory_bytes.total)}"
    )
    for b in p.selection.budgets:
        where = f"{result.out}/{b.directory}/: trial {b.trial}" if b.trial is not None else "no trial fits"
        say(f"  within {kib(b.budget_bytes)}: {where}")
    if p.selection.feasible is False:
        broken = [k.replace("_", " ") for k in p.selection.over_budget if k != "diverged"]
        diverged = " and diverged while fine-tuning" if "diverged" in p.selection.over_budget else ""
        what = f"over budget: it breaks the target's {', '.join(broken)}" if broken else "infeasible"
        note(f"warning: the scheme is {what}{diverged}; its measured figures are in {result.out}/plan.json")
