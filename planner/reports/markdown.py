"""report.md: the chosen plan, what trains per layer, where memory goes, the Pareto front, the trials."""

from __future__ import annotations

from collections import Counter

from planner.reports.content import MEMORY_PARTS, ReportContent, recompute_note, updated
from planner.types import Mode, TrialState, metric_named
from planner.units import kib


def _origin(content: ReportContent) -> str:
    plan = content.plan
    counts = content.counts
    tally = f"{len(content.trials)} trials ({counts['fail']} failed, {counts['feasible']} feasible)"
    if plan is None:
        return f"Study report: {tally}. Trial {content.chosen} is what `planner plan` would choose; no plan is written yet."
    sel = plan.selection
    if sel.policy == "scheme":
        fits = "fits the target's budgets" if sel.feasible else f"is infeasible ({', '.join(sel.over_budget)})"
        return f"Measured scheme `{sel.scheme}` (no search); it {fits}."
    return f"Chosen by `{sel.policy}` (accuracy tolerance {sel.accuracy_tolerance}) from trial {content.chosen} of {tally}."


def _budget_table(content: ReportContent) -> list[str]:
    """The plan-per-budget section (none without a budget family), kept out of `render` for its length."""
    if not content.budgets:
        return []
    lines = [
        "",
        "## A plan per memory budget",
        "",
        "From the same trials; each directory is a whole plan (`planner run DIR/<budget>`).",
        "",
        f"| RAM budget | plan | trial | peak memory | val {content.metric.short} | latency ms (median) |",
        "|---|---|---|---|---|---|",
    ]
    by_number = {t.number: t for t in content.trials}
    for b in content.budgets:
        if b["trial"] is None:
            lines.append(f"| {kib(b['budget_bytes'])} | — | no trial fits | | | |")
            continue
        measured = by_number[b["trial"]].measured()
        lines.append(
            f"| {kib(b['budget_bytes'])} | `{b['directory']}/` | {b['trial']} | {kib(measured.memory.total)} | "
            f"{measured.accuracy.measure.text(measured.accuracy.after)} | {measured.latency.median:.2f} |"
        )
    return lines


def render(content: ReportContent) -> str:
    lines = [f"# {content.title}", ""]
    lines += [line for warning in content.warnings for line in (f"> **Warning:** {warning}", "")]
    c, m = content.choice, content.metrics
    if c is None or m is None:
        lines += [f"{len(content.trials)} trials, none feasible yet.", ""]
    else:
        lat, mem, acc = m["step_latency_ms"], m["peak_memory_bytes"], m["accuracy"]
        budget = content.target.get("ram_budget_bytes")
        lines += [
            _origin(content),
            "",
            "| | |",
            "|---|---|",
            f"| trainable | {', '.join(t['layer'] + ':' + Mode.parse(t['mode']).label for t in c['trainable']) or '—'} |",
            f"| batch size | {c['batch_size']} |",
            f"| optimizer | {c['optimizer']['name']} (lr {c['optimizer']['lr']:.4g}) |",
            f"| precision | {c['precision']} |",
            f"| frozen weights stored | {c.get('frozen_weights', 'fp32')} |",
            f"| updates | {c['updates']} |",
            f"| val {acc['metric']} | {_text(acc, 'before')} → {_text(acc, 'after')} after {acc['steps']} steps |",
            f"| step latency | median {lat['median']:.2f} ms, p90 {lat['p90']:.2f} ms{content.latency_note} |",
            f"| peak memory | {kib(mem['total'])}" + (f" (budget {kib(budget)})" if budget else "") + " |",
        ]
        if content.flash is not None:
            lines.append(f"| flash | {kib(content.flash[0])} (budget {kib(content.flash[1])}) |")
    if content.layers:
        lines += [
            "",
            "## Per-layer map",
            "",
            "| layer | op | mode | parameters updated | parameter bytes |",
            "|---|---|---|---|---|",
        ]
        for r in content.layers:
            lines.append(f"| {r['layer']} | {r['op']} | {r['label']} | {updated(r)} | {r['param_bytes']:,} |")
    if m is not None:
        mem = m["peak_memory_bytes"]
        lines += ["", "## Memory at the step's peak", "", "| part | bytes | share |", "|---|---|---|"]
        for part in MEMORY_PARTS:
            lines.append(f"| {part} | {mem.get(part, 0):,} | {mem.get(part, 0) / mem['total']:.0%} |")
        lines.append(f"| **total** | **{mem['total']:,}** | |")
        if c is not None and c.get("recompute", "none") != "none":
            lines += ["", recompute_note(c, mem, content.plan.signature.kept if content.plan else ())]
    lines += _budget_table(content)
    lines += [
        "",
        "## Pareto front (feasible trials)",
        "",
        f"| trial | trainable | batch | lr | val {content.metric.short} | latency ms (median / p90) | peak memory |",
        "|---|---|---|---|---|---|---|",
    ]
    front = [(t, t.measured()) for t in content.trials if t.number in content.pareto and t.complete]
    for t, measured in sorted(front, key=lambda tm: tm[1].memory.total):
        mark = " ★" if t.number == content.chosen else ""
        cand, lat = measured.candidate, measured.latency
        lines.append(
            f"| {t.number}{mark} | {', '.join(f'{n}:{md}' for n, md in cand.trainable) or '—'} | {cand.batch_size} | "
            f"{cand.lr:.3g} | {measured.accuracy.measure.text(measured.accuracy.after)} | {lat.median:.2f} / {lat.p90:.2f} | {kib(measured.memory.total)} |"
        )
    reasons = Counter((t.fail_reason or "unknown").split(":")[0] for t in content.trials if t.state is TrialState.FAIL)
    if reasons:
        lines += ["", "## Failed trials", "", "| reason | trials |", "|---|---|"]
        lines += [f"| {r} | {n} |" for r, n in reasons.most_common()]
    lines += ["", "## How it was measured", ""]
    lines += [f"- {k}: {v}" for k, v in content.provenance.items() if v is not None]
    return "\n".join(lines) + "\n"


def _text(acc: dict, which: str) -> str:
    """A plan's val metric `before` or `after`, as its metric prints."""
    return metric_named(acc["metric"]).text(acc[which])
