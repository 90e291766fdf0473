"""PyTorch-exported model families through planner: step latency, peak memory, and a default plan.

    pip install -e '.[test]'          # PyTorch, torchvision and onnxscript come with the test extra
    python benchmarks/families.py [--families resnet18 vit ...] [--exporters dynamo legacy]
                                  [--batch 8] [--plan] [--trials 20] [--json results.json]

For each family of `tests/torch_families.py` (torchvision classifiers and two transformer
encoders at small input sizes, random weights, 10 classes) and each exporter, on this host:

- `planner measure` of the full update (every layer, plain SGD, batch `--batch`): the step's
  median latency (VM time evaluator, 10 repeats) and planned peak training memory;
- the same for the last layer alone;
- with `--plan`: `planner plan` with the default search space (`--trials` trials) on a synthetic
  learnable task (a template per class plus noise), its wall time and what it chose.

Numbers go to stdout as a Markdown table (and to `--json`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import torch_families as tf  # noqa: E402


def _dataset(path: Path, family: str, n: int = 400) -> Path:
    """A learnable task in the family's input shape: one random template per class plus noise."""
    rng = np.random.default_rng(0)
    shape = tf.FAMILIES[family].input_shape
    templates = rng.normal(0, 1, (10, *shape))
    y = rng.integers(0, 10, n)
    x = templates[y] + rng.normal(0, 1.0, (n, *shape))
    np.savez(path, x=x.astype(np.float32), y=y)
    return path


def _planner(*args: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "planner", *args, "--json"], capture_output=True, text=True)
    if res.returncode not in (0,):
        raise RuntimeError(f"planner {' '.join(args[:1])} failed ({res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout), time.perf_counter() - t0


def _scheme(path: Path, layers: list[str], batch: int) -> Path:
    entries = "\n".join(f"  - {{layer: '{name}'}}" for name in layers)
    path.write_text(f"name: {path.stem}\ntrainable:\n{entries}\nbatch_size: {batch}\noptimizer: {{name: sgd, lr: 0.01}}\n")
    return path


def _measure(model: Path, layers: list[str], data: Path, batch: int, work: Path, name: str) -> dict:
    result, _ = _planner(
        "measure",
        str(model),
        "--scheme",
        str(_scheme(work / f"{name}.yaml", layers, batch)),
        "--data",
        str(data),
        "--out",
        str(work / name),
        "--accuracy-steps",
        "20",
    )
    m = result["metrics"]
    return {"latency_ms": m["step_latency_ms"]["median"], "peak_kib": m["peak_memory_bytes"]["total"] / 1024}


def run(family: str, exporter: str, batch: int, plan: bool, trials: int) -> dict:
    model = tf.export(family, exporter)
    layers, _ = _planner("inspect", str(model))
    names = [r["layer"] for r in layers["layers"] if r["trainable"]]
    row = {
        "family": family,
        "exporter": exporter,
        "input": list(tf.FAMILIES[family].input_shape),
        "layers": len(layers["layers"]),
        "trainable": len(names),
    }
    with tempfile.TemporaryDirectory(prefix="planner-families-") as tmp:
        work = Path(tmp)
        data = _dataset(work / "data.npz", family)
        row["full"] = _measure(model, names, data, batch, work, "full")
        row["last"] = _measure(model, names[-1:], data, batch, work, "last")
        if plan:
            result, seconds = _planner(
                "plan", "--model", str(model), "--data", str(data), "--trials", str(trials), "--out", str(work / "plan")
            )
            row["plan"] = {
                "seconds": seconds,
                "trials": trials,
                "trainable": [t["layer"] for t in result["choice"]["trainable"]],
                "batch_size": result["choice"]["batch_size"],
                "val_accuracy": result["metrics"]["accuracy"]["after"],
                "latency_ms": result["metrics"]["step_latency_ms"]["median"],
                "peak_kib": result["metrics"]["peak_memory_bytes"]["total"] / 1024,
            }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(tf.FAMILIES))
    ap.add_argument("--exporters", nargs="+", default=list(tf.EXPORTERS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--plan", action="store_true", help="also run `planner plan` with the default space")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    print(
        "| family | input | exporter | layers | full update: step ms | peak KiB | last layer: step ms | peak KiB |"
        + (" plan (default space): wall s, chosen |" if args.plan else "")
    )
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.plan else ""), flush=True)
    for family in args.families:
        for exporter in args.exporters:
            row = run(family, exporter, args.batch, args.plan, args.trials)
            rows.append(row)
            line = (
                f"| {family} | {'x'.join(map(str, row['input']))} | {exporter} | {row['trainable']}/{row['layers']} | "
                f"{row['full']['latency_ms']:.2f} | {row['full']['peak_kib']:,.0f} | "
                f"{row['last']['latency_ms']:.2f} | {row['last']['peak_kib']:,.0f} |"
            )
            if "plan" in row:
                p = row["plan"]
                line += (
                    f" {p['seconds']:.0f} s: {len(p['trainable'])} layers, batch {p['batch_size']}, "
                    f"acc {p['val_accuracy']:.2f}, {p['latency_ms']:.2f} ms, {p['peak_kib']:,.0f} KiB |"
                )
            print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
