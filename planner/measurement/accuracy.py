"""Accuracy of a candidate: a short, real fine-tune with its own compiled step.

Accuracy does not depend on the board, so results are cached by model, dataset, candidate, step
budget and seed — never by target — and reused across targets and runs. A cached result carries
its sha256 (see `cachefile`) and is checked on read: an edited or damaged one is measured again.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from planner import cachefile
from planner.backend.compile import CompiledStep, code_id
from planner.backend.session import TrainingSession
from planner.inputs.data import Dataset
from planner.inputs.model import Model
from planner.types import AccuracyResult, Candidate


def batches(n: int, batch_size: int, steps: int, seed: int | None):
    """Index batches for `steps` steps: reshuffled each epoch, or in file order when seed is None.

    In file order, step k uses samples [k*B, (k+1)*B) (wrapping around), the contract of
    `planner run --no-shuffle`.
    """
    rng = np.random.default_rng(seed) if seed is not None else None
    order = np.arange(n)
    pos = n  # forces a (re)shuffle before the first batch
    for k in range(steps):
        if rng is None:
            yield np.arange(k * batch_size, (k + 1) * batch_size) % n
            continue
        if pos + batch_size > n:
            order, pos = rng.permutation(n), 0
        yield order[pos : pos + batch_size]
        pos += batch_size


def finetune(session: TrainingSession, data: Dataset, steps: int, seed: int | None) -> list[float]:
    """Train `steps` steps on the train split; returns the loss of each step. Stops at the first
    non-finite loss: a diverged run cannot recover, and its remaining steps are wasted time."""
    losses = []
    for i in batches(len(data.y_train), session.sig.batch_size, steps, seed):
        losses.append(session.step(data.x_train[i], data.y_train[i]))
        if not np.isfinite(losses[-1]):
            break
    return losses


def measure_accuracy(
    model: Model, data: Dataset, candidate: Candidate, compiled: CompiledStep, steps: int, seed: int, cache_dir: Path
) -> AccuracyResult:
    """Val accuracy before and after `steps` fine-tuning steps (cached across targets)."""
    key = hashlib.sha256(
        json.dumps([model.sha256, data.sha256, candidate.to_json(), steps, seed, code_id()], sort_keys=True).encode()
    ).hexdigest()[:32]
    path = cache_dir / "accuracy" / f"{key}.json"
    cached = cachefile.read_json(path, key)
    if cached is not None and (result := AccuracyResult.from_json(cached)) is not None:
        return result
    t0 = time.perf_counter()
    session = TrainingSession(compiled.library, compiled.signature, model.initializers)
    loss_before, before = session.evaluate(data.x_val, data.y_val)
    losses = finetune(session, data, steps, seed)
    loss_after, after = session.evaluate(data.x_val, data.y_val)
    # A diverged fine-tune is a measured result too — the candidate ruins the model — so the
    # search can learn where that happens (the evaluator marks it infeasible) instead of
    # ignoring a failed trial and proposing the same corner again.
    diverged = None if np.isfinite(losses[-1]) else len(losses)
    result = AccuracyResult(
        before, after, loss_before, loss_after if diverged is None else None, steps, time.perf_counter() - t0, diverged
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    cachefile.write_json(path, result.to_json(), key)
    return result
