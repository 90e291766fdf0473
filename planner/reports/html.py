"""report.html: one self-contained page (plotly.js inlined, no network) to read a plan by eye.

Pareto front (accuracy against step latency and against peak memory, every trial marked feasible,
infeasible or failed, the budgets drawn), where the memory of the front's trials goes, a per-layer
map of what trains, the trial history and how each number was measured.
"""

from __future__ import annotations

from html import escape

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from planner.modes import FROZEN
from planner.reports.content import MEMORY_PARTS, ReportContent, recompute_note, updated
from planner.types import Measured, Mode, TrialRecord, TrialState, metric_named

KIB = 1024
COLORS = {
    "pareto": "#1f77b4",
    "feasible": "#9ecae1",
    "screened": "#bcbd22",
    "infeasible": "#ff7f0e",
    "fail": "#7f7f7f",
    "chosen": "#d62728",
}
PLOT_CONFIG = {"displaylogo": False, "responsive": True}


def _trainable(t: TrialRecord) -> str:
    return ", ".join(f"{n}:{m}" for n, m in t.candidate.trainable) if t.candidate else "?"


def _hover(t: TrialRecord) -> str:
    lines = [f"trial {t.number}", _trainable(t)]
    if t.candidate:
        c = t.candidate
        lines.append(
            f"batch {c.batch_size}×{c.grad_accum}, {c.optimizer} lr {c.lr:.3g}, {c.precision}, frozen {c.frozen_weights}"
        )
    if t.accuracy:
        m = t.accuracy.measure
        lines.append(f"val {m.short} {m.text(t.accuracy.before)} → {m.text(t.accuracy.after)} after {t.accuracy.steps} steps")
    if t.fidelity:
        lines.append(("trained on: " if t.fidelity.promoted else "screened out: ") + t.fidelity.reason)
    if t.latency:
        lines.append(f"step {t.latency.median:.2f} ms (p90 {t.latency.p90:.2f})")
    if t.memory:
        how = ""
        if t.ended_over_budget:
            how = " estimated from the training graph: not compiled" if t.memory_estimated else " as linked: too large to run"
        lines.append(f"peak {t.memory.total / KIB:,.1f} KiB{how}")
    if t.over_budget and not t.screened_out:
        lines.append("infeasible: " + ", ".join(t.over_budget))
    if t.state is TrialState.PRUNED:
        lines.append("cut short by Ctrl-C; queued for the next run")
    elif t.fail_reason:
        lines.append("failed: " + t.fail_reason[:160])
    return "<br>".join(escape(x) for x in lines)


def _x(t: TrialRecord, metric: str) -> float | None:
    """A trial's place on the Pareto figure's `metric` axis: its median step latency (ms) or its
    peak memory (KiB); None when it has no such measurement."""
    if metric == "latency":
        return t.latency.median if t.latency is not None else None
    return t.memory.total / KIB if t.memory is not None else None


def _category(t: TrialRecord, content: ReportContent) -> str:
    if t.number == content.chosen:
        return "chosen"
    if t.feasible:
        return "pareto" if t.number in content.pareto else "feasible"
    return "screened" if t.screened_out else "infeasible" if t.complete or t.ended_over_budget else "fail"


LABELS = {
    "chosen": "chosen plan",
    "pareto": "Pareto front (feasible)",
    "feasible": "feasible",
    "screened": "screened out (short fine-tune only)",
    "infeasible": "infeasible (over a budget, or diverged)",
    "fail": "failed (no accuracy)",
}
SYMBOLS = {
    "chosen": "star",
    "pareto": "circle",
    "feasible": "circle-open",
    "screened": "diamond-open",
    "infeasible": "x",
    "fail": "x-thin-open",
}


def pareto_figure(content: ReportContent) -> go.Figure:
    """Accuracy against latency and against memory; failed trials sit on a strip under the axis."""
    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.06,
        subplot_titles=(f"val {content.metric.name} vs step latency", f"val {content.metric.name} vs peak memory"),
    )
    accs = [t.measured().accuracy.after for t in content.trials if t.complete]
    lo = min(accs, default=0.0)
    hi = max(accs, default=1.0)
    pad = max(0.02 if content.metric.bounded else 0.0, (hi - lo) * 0.08)
    # where failed trials are drawn: worse than every measured value (below an accuracy, above an error)
    floor = lo - pad if content.metric.higher_is_better else hi + pad
    for cat in ("fail", "infeasible", "screened", "feasible", "pareto", "chosen"):
        group = [t for t in content.trials if _category(t, content) == cat]
        for col, metric in ((1, "latency"), (2, "memory")):
            pts = [t for t in group if _x(t, metric) is not None]
            xs = [_x(t, metric) for t in pts]
            ys = [t.measured().accuracy.after if t.complete else floor for t in pts]
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="markers",
                    name=f"{LABELS[cat]} ({len(group)})",
                    legendgroup=cat,
                    showlegend=col == 1,
                    marker={
                        "color": COLORS[cat],
                        "symbol": SYMBOLS[cat],
                        "size": 16 if cat == "chosen" else 9,
                        "line": {"width": 1.5, "color": COLORS[cat]},
                    },
                    hovertext=[_hover(t) for t in pts],
                    hoverinfo="text",
                ),
                row=1,
                col=col,
            )
    front = [t.measured() for t in content.trials if t.number in content.pareto and t.complete]
    for col, key in ((1, lambda m: m.latency.median), (2, lambda m: m.memory.total / KIB)):
        line = sorted(front, key=key)
        fig.add_trace(
            go.Scatter(
                x=[key(m) for m in line],
                y=[m.accuracy.after for m in line],
                mode="lines",
                line={"color": COLORS["pareto"], "width": 1, "dash": "dot"},
                hoverinfo="skip",
                showlegend=False,
                legendgroup="pareto",
            ),
            row=1,
            col=col,
        )
    _add_budgets(fig, content)
    fig.update_xaxes(title_text="median step latency (ms)", row=1, col=1)
    fig.update_xaxes(title_text="peak memory (KiB)", row=1, col=2)
    low, high = min(floor, lo), max(floor, hi)
    fig.update_yaxes(
        title_text=f"val {content.metric.name} after fine-tuning", range=[low - pad / 2, high + pad / 2], row=1, col=1
    )
    fig.update_layout(height=460, margin={"t": 40, "b": 50, "l": 60, "r": 20}, legend={"orientation": "h", "y": -0.18})
    return fig


# a budget's line and its label: the label upright along the line, at its foot, so neither the
# subplot titles above nor a neighbouring budget's label is written over
BUDGET_LINE = {
    "line_dash": "dash",
    "line_color": "#d62728",
    "annotation_position": "bottom left",
    "annotation_textangle": -90,
    "annotation_font": {"size": 11, "color": "#d62728"},
}


def _add_budgets(fig: go.Figure, content: ReportContent) -> None:
    """Draw the target's budgets (a budget family's lines and frontier) on `fig`: `pareto_figure`'s overlay."""
    budget = content.target.get("latency_budget_ms")
    if budget:
        fig.add_vline(x=budget, **BUDGET_LINE, annotation_text="latency budget", row=1, col=1)
    ram = content.target.get("ram_budget_bytes")
    mems = [t.memory.total for t in content.trials if t.memory]
    family = content.budgets
    if family:  # a plan per budget: each budget's line, and the accuracy-vs-memory frontier it cuts
        staircase = _frontier([t.measured() for t in content.trials if t.feasible])
        fig.add_trace(
            go.Scatter(
                x=[m.memory.total / KIB for m in staircase],
                y=[m.accuracy.after for m in staircase],
                mode="lines",
                line={"shape": "hv", "color": "#2ca02c", "width": 2},
                name="most accurate within each memory",
                hoverinfo="skip",
            ),
            row=1,
            col=2,
        )
        for b in family:
            text = f"{b['directory']}: trial {b['trial']}" if b["trial"] is not None else f"{b['directory']}: none fits"
            fig.add_vline(x=b["budget_bytes"] / KIB, **BUDGET_LINE, annotation_text=text, row=1, col=2)
    elif ram and mems and ram <= 1.5 * max(mems):  # a budget far off the chart would squash the points
        fig.add_vline(x=ram / KIB, **BUDGET_LINE, annotation_text="RAM budget", row=1, col=2)


def _frontier(measured: list[Measured]) -> list[Measured]:
    """The trials no smaller trial beats in accuracy, by peak memory: what each budget can have."""
    front: list[Measured] = []
    for m in sorted(measured, key=lambda m: (m.memory.total, -m.accuracy.quality)):
        if not front or m.accuracy.quality > front[-1].accuracy.quality:
            front.append(m)
    return front


def memory_figure(content: ReportContent) -> go.Figure:
    """Where the peak goes, for every trial on the front (the chosen one starred)."""
    rows = [(t, mem) for t in content.trials if (t.number in content.pareto or t.number == content.chosen) and (mem := t.memory)]
    rows.sort(key=lambda row: row[1].total)
    labels = [("★ " if t.number == content.chosen else "") + f"trial {t.number}" for t, _ in rows]
    fig = go.Figure()
    for part in MEMORY_PARTS:
        fig.add_trace(
            go.Bar(
                y=labels,
                x=[getattr(mem, part) / KIB for _, mem in rows],
                name=part.replace("_", " "),
                orientation="h",
                hovertemplate="%{y}: %{x:,.1f} KiB<extra>" + part + "</extra>",
            )
        )
    fig.update_layout(
        barmode="stack",
        height=120 + 28 * len(rows),
        xaxis_title="KiB at the step's peak",
        margin={"t": 20, "b": 40, "l": 90, "r": 20},
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def history_figure(content: ReportContent) -> go.Figure:
    """Each trial's accuracy in the order it finished, and the best feasible one so far."""
    trials = sorted(content.trials, key=lambda t: t.number)
    fig = go.Figure()
    accs = [t.measured().accuracy.after for t in trials if t.complete]
    metric = content.metric
    floor = min(accs, default=0.0) - 0.03 if metric.higher_is_better else max(accs, default=0.0) * 1.1
    for cat in ("fail", "infeasible", "screened", "feasible", "pareto", "chosen"):
        pts = [t for t in trials if _category(t, content) == cat]
        fig.add_trace(
            go.Scatter(
                x=[t.number for t in pts],
                y=[t.measured().accuracy.after if t.complete else floor for t in pts],
                mode="markers",
                name=LABELS[cat],
                marker={"color": COLORS[cat], "symbol": SYMBOLS[cat], "size": 14 if cat == "chosen" else 8},
                hovertext=[_hover(t) for t in pts],
                hoverinfo="text",
            )
        )
    best, xs, ys = None, [], []
    for t in trials:
        if t.feasible:  # a feasible trial is complete
            after = t.measured().accuracy.after
            if best is None or metric.quality(after) > metric.quality(best):
                best = after
        if best is not None:
            xs.append(t.number)
            ys.append(best)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"shape": "hv", "color": "#2ca02c"}, name="best feasible so far"))
    fig.update_layout(
        height=360,
        xaxis_title="trial",
        yaxis_title=f"val {metric.name}",
        margin={"t": 20, "b": 40, "l": 60, "r": 20},
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def _table(rows: list[tuple[str, str]]) -> str:
    return "<table class='kv'>" + "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _summary(content: ReportContent) -> str:
    c, m = content.choice, content.metrics
    counts = content.counts
    head = (
        f"{len(content.trials)} trials: {counts['feasible']} feasible, "
        + (f"{counts['screened']} screened out after a short fine-tune, " if counts["screened"] else "")
        + f"{counts['infeasible']} infeasible, "
        f"{counts['fail']} failed" + (f", {counts['running']} running" if counts["running"] else "")
    )
    if c is None or m is None:
        return f"<p>{escape(head)}. No feasible trial yet.</p>"
    plan = content.plan
    if plan is not None and plan.selection.policy == "scheme":
        scheme = plan.selection.scheme
        assert scheme is not None, "`planner measure` records the scheme it measured"
        origin = f"Measured scheme {escape(scheme)} (no search)."
    elif plan is not None:
        origin = (
            f"Chosen by <b>{escape(plan.selection.policy)}</b> (accuracy tolerance "
            f"{plan.selection.accuracy_tolerance}) from trial {content.chosen}."
        )
    else:
        origin = f"Trial {content.chosen} is what <code>planner plan</code> would choose; no plan is written yet."
    lat, mem, acc = m["step_latency_ms"], m["peak_memory_bytes"], m["accuracy"]
    ram = content.target.get("ram_budget_bytes")
    trains = ", ".join(f"{t['layer']}:{Mode.parse(t['mode']).label}" for t in c["trainable"])
    return f"<p>{escape(head)}. {origin}</p>" + _table(
        [
            ("trains", escape(trains) or "—"),
            ("batch", f"{c['batch_size']}" + (f" × {c['grad_accum']} accumulated" if c.get("grad_accum", 1) > 1 else "")),
            ("optimizer", escape(f"{c['optimizer']['name']} (lr {c['optimizer']['lr']:.4g})")),
            (
                "precision",
                escape(f"{c['precision']}; frozen weights stored {c.get('frozen_weights', 'fp32')}; updates {c['updates']}"),
            ),
            (
                f"val {acc['metric']}",
                f"{metric_named(acc['metric']).text(acc['before'])} → <b>{metric_named(acc['metric']).text(acc['after'])}</b> "
                f"after {acc['steps']} steps",
            ),
            ("step latency", f"<b>{lat['median']:.2f} ms</b> median, p90 {lat['p90']:.2f} ms{escape(content.latency_note)}"),
            ("peak memory", f"<b>{mem['total'] / KIB:,.1f} KiB</b>" + (f" of a {ram / KIB:,.0f} KiB budget" if ram else "")),
            *(
                [("flash", f"<b>{content.flash[0] / KIB:,.1f} KiB</b> of a {content.flash[1] / KIB:,.0f} KiB budget")]
                if content.flash is not None
                else []
            ),
            *(
                [("recomputation", escape(recompute_note(c, mem, content.plan.signature.kept if content.plan else ())))]
                if c.get("recompute", "none") != "none"
                else []
            ),
        ]
    )


def _layers(content: ReportContent) -> str:
    if not content.layers:
        return "<p>The model was not found, so no per-layer map.</p>"
    biggest = max(r["param_bytes"] for r in content.layers) or 1
    out = [
        "<table class='layers'><tr><th>layer</th><th>op</th><th>what trains</th><th>parameters updated</th>"
        "<th>precision</th><th>parameter bytes</th></tr>"
    ]
    for r in content.layers:
        color, text = r["color"], "#fff" if r["mode"] != FROZEN else "#333"
        width = 100 * r["param_bytes"] / biggest
        out.append(
            f"<tr><td>{escape(r['layer'])}</td><td>{escape(r['op'])}</td>"
            f"<td><span class='mode' style='background:{color};color:{text}'>{escape(r['label'])}</span></td>"
            f"<td>{escape(updated(r))}</td><td>{escape(r['precision'] or '—')}</td>"
            f"<td><div class='bar' style='width:{width:.1f}%'></div>{r['param_bytes']:,}</td></tr>"
        )
    return "".join(out) + "</table>"


def _provenance(content: ReportContent) -> str:
    return _table([(k, escape(str(v))) for k, v in content.provenance.items() if v is not None])


STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1180px;color:#222;padding:0 16px}
h1{font-size:22px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse} td,th{padding:3px 10px;text-align:left;vertical-align:top}
table.kv th{color:#555;font-weight:600} table.layers tr:nth-child(even){background:#f7f7f7}
table.layers td:last-child{position:relative;min-width:160px}
.bar{position:absolute;left:0;top:3px;bottom:3px;background:#dbe9f6;z-index:-1}
.mode{border-radius:3px;padding:1px 6px} code{background:#f2f2f2;padding:0 3px}
.warning{background:#fdecea;border-left:4px solid #d62728;padding:8px 12px}
"""


def render(content: ReportContent) -> str:
    """The page; plotly.js is inlined once, so the file opens anywhere with no network."""
    figures = {"pareto": pareto_figure(content), "memory": memory_figure(content), "history": history_figure(content)}
    divs = {
        k: f.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{k}", config=PLOT_CONFIG) for k, f in figures.items()
    }
    target = content.target
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(content.title)}</title>
<style>{STYLE}</style><script type="text/javascript">{get_plotlyjs()}</script></head>
<body>
<h1>{escape(content.title)}</h1>
{"".join(f'<p class="warning"><b>Warning:</b> {escape(w)}</p>' for w in content.warnings)}
<p>Target <b>{escape(target["name"])}</b> ({escape(str(target.get("device") or ""))}).</p>
{_summary(content)}
<h2>Pareto front</h2>
<p>Every trial: accuracy after fine-tuning against the step's latency and peak memory on the target. Hover a point for its scheme.</p>
{divs["pareto"]}
<h2>Memory at the step's peak</h2>
{divs["memory"]}
<h2>What trains, per layer</h2>
{_layers(content)}
<h2>Trial history</h2>
{divs["history"]}
<h2>How it was measured</h2>
{_provenance(content)}
</body></html>
"""
