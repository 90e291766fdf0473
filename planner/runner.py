"""Execute a plan: fine-tune with the plan's compiled step and export the result.

A plan directory is self-contained — plan.json, the compiled step, the starting weights and the
model graph — so this is what runs on the board.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .accuracy import finetune
from .data import load_dataset
from .defaults import DEFAULT_RUN_STEPS
from .errors import BadInput
from .model import load_model, save_onnx
from .plan import MODEL_FILE, STEP_LIBRARY, WEIGHTS_FILE, read_plan
from .session import TrainingSession


@dataclass(frozen=True)
class RunResult:
    before: dict[str, float]  # {loss, accuracy} on the val split
    after: dict[str, float]
    steps: int
    out: Path

    def to_json(self) -> dict:
        return {"before": self.before, "after": self.after, "steps": self.steps, "out": str(self.out)}


def run_plan(
    plan_dir: Path, data: Path | None = None, steps: int = DEFAULT_RUN_STEPS, out: Path | None = None, shuffle: bool = True, seed: int = 0
) -> RunResult:
    """Train `steps` steps from the plan's weights; write weights.npz and model.onnx to `out`."""
    plan = read_plan(plan_dir)
    if steps < 1:
        raise BadInput("--steps must be at least 1")
    model = load_model(plan_dir / MODEL_FILE)
    dataset = load_dataset(data or Path(plan.dataset.source), model)
    with np.load(plan_dir / WEIGHTS_FILE) as npz:
        weights = {k: npz[k] for k in npz.files}
    session = TrainingSession(plan_dir / STEP_LIBRARY, plan.signature, weights)
    loss0, acc0 = session.evaluate(dataset.x_val, dataset.y_val)
    finetune(session, dataset, steps, seed if shuffle else None)
    loss1, acc1 = session.evaluate(dataset.x_val, dataset.y_val)
    out = out or plan_dir / "finetuned"
    out.mkdir(parents=True, exist_ok=True)
    final = session.weights()
    np.savez(out / WEIGHTS_FILE, **final)
    save_onnx(model, final, out / MODEL_FILE)
    return RunResult({"loss": loss0, "accuracy": acc0}, {"loss": loss1, "accuracy": acc1}, steps, out)
