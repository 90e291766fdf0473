"""report.md: the Pareto front, the chosen plan, what trains per layer, and where memory goes."""

from __future__ import annotations

from ..model import Model
from ..plan import Plan


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def _mode(entry: dict) -> str:
    return f"ratio {entry['ratio']:g}" if entry["mode"] == "ratio" else entry["mode"]


def _trainable_cell(choice: dict) -> str:
    return ", ".join(f"{t['layer']}:{_mode(t)}" for t in choice["trainable"]) or "—"


def render(plan: Plan, model: Model) -> str:
    m = plan.metrics
    lat, mem, acc = m["step_latency_ms"], m["peak_memory_bytes"], m["accuracy"]
    c = plan.choice
    sel = plan.selection
    if sel["policy"] == "scheme":
        fits = "fits the target's budgets" if sel["feasible"] else f"breaks the target's budgets ({', '.join(sel['over_budget'])})"
        origin = f"Measured scheme `{sel['scheme']}` (no search); it {fits}."
    else:
        origin = (
            f"Chosen by `{sel['policy']}` (accuracy tolerance {sel['accuracy_tolerance']}) from trial "
            f"{sel['trial']} of {plan.study['n_trials']} ({plan.study['n_failed']} failed, {sel['n_feasible']} feasible)."
        )
    lines = [
        f"# Training plan: {model.path.name} on {plan.target.name}",
        "",
        origin,
        "",
        "| | |",
        "|---|---|",
        f"| trainable | {_trainable_cell(c.model_dump())} |",
        f"| batch size | {c.batch_size} |",
        f"| optimizer | {c.optimizer['name']} (lr {c.optimizer['lr']:.4g}) |",
        f"| precision | {c.precision} |",
        f"| frozen weights stored | {c.frozen_weights} |",
        f"| updates | {c.updates} |",
        f"| val accuracy | {acc['before']:.3f} → {acc['after']:.3f} after {acc['steps']} steps |",
        f"| step latency | median {lat['median']:.2f} ms, p90 {lat['p90']:.2f} ms |",
        f"| peak memory | {_kib(mem['total'])} (budget {_kib(plan.measurement['ram_budget_bytes'])}) |",
        "",
        "## Per-layer map",
        "",
        "| layer | op | mode | parameters updated | parameter bytes |",
        "|---|---|---|---|---|",
    ]
    modes = {t["layer"]: t for t in c.trainable}
    frozen = "frozen" if c.frozen_weights == "fp32" else f"frozen ({c.frozen_weights} weights)"
    for layer in model.layers:
        t = modes.get(layer.name)
        lines.append(
            f"| {layer.name} | {layer.op} | {_mode(t) if t else frozen} | "
            f"{', '.join(t['params']) if t else '—'} | {layer.param_bytes:,} |"
        )
    lines += ["", "## Memory at the step's peak", "", "| part | bytes | share |", "|---|---|---|"]
    for part in ("activations", "trainable_params", "gradients", "optimizer_state", "frozen_params", "scratch"):
        lines.append(f"| {part} | {mem.get(part, 0):,} | {mem.get(part, 0) / mem['total']:.0%} |")
    lines.append(f"| **total** | **{mem['total']:,}** | |")
    lines += [
        "",
        "## Pareto front (feasible trials)",
        "",
        "| trial | trainable | batch | lr | val acc | latency ms (median / p90) | peak memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in sorted(plan.pareto, key=lambda p: p["metrics"]["peak_memory_bytes"]["total"]):
        pm = p["metrics"]
        mark = " ★" if p["trial"] == plan.selection["trial"] else ""
        lines.append(
            f"| {p['trial']}{mark} | {_trainable_cell(p['choice'])} | {p['choice']['batch_size']} | "
            f"{p['choice']['optimizer']['lr']:.3g} | {pm['accuracy']['after']:.3f} | "
            f"{pm['step_latency_ms']['median']:.2f} / {pm['step_latency_ms']['p90']:.2f} | "
            f"{_kib(pm['peak_memory_bytes']['total'])} |"
        )
    lines += ["", "## How it was measured", ""]
    lines += [f"- {k}: {v}" for k, v in plan.measurement.items() if k != "ram_budget_bytes" and v is not None]
    return "\n".join(lines) + "\n"
