"""Accuracy of a candidate: a short, real fine-tune with its own compiled step.

Accuracy does not depend on the board, so results are cached by model, dataset, candidate, step
budget and seed — never by target — and reused across targets and runs. A cached result carries
its sha256 (see `cachefile`) and is checked on read: an edited or damaged one is measured again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from planner import cachefile
from planner.backend import Artifact
from planner.backend.cache import code_id
from planner.inputs.data import Dataset, Split
from planner.inputs.model import Model
from planner.measurement._base import Session
from planner.measurement.local import local_session
from planner.runtime.session import TrainingSession
from planner.runtime.threads import use_threads
from planner.types import AccuracyResult, Candidate

EVAL_CHUNK = 256  # samples evaluated at a time


def batches(n: int, batch_size: int, steps: int | None, seed: int | None):
    """Index batches for `steps` steps (None: without end): reshuffled each epoch, or in file
    order when seed is None.

    In file order, step k uses samples [k*B, (k+1)*B) (wrapping around), the contract of
    `planner run --no-shuffle`.
    """
    rng = np.random.default_rng(seed) if seed is not None else None
    order = np.arange(n)
    pos = n  # forces a (re)shuffle before the first batch
    for k in range(steps) if steps is not None else itertools.count():
        if rng is None:
            yield np.arange(k * batch_size, (k + 1) * batch_size) % n
            continue
        if pos + batch_size > n:
            order, pos = rng.permutation(n), 0
        yield order[pos : pos + batch_size]
        pos += batch_size


def finetune(session: Session, data: Dataset, steps: int, seed: int | None, augment_seed: int = 0) -> list[float]:
    """Train `steps` steps on the train split; returns the loss of each step. Stops at the first
    non-finite loss: a diverged run cannot recover, and its remaining steps are wasted time.
    Step k's augmentation (images with Random* steps) is drawn from (`augment_seed`, k)."""
    losses = []
    for k, i in enumerate(batches(len(data.train), session.sig.batch_size, steps, seed)):
        losses.append(session.step(*data.train.batch(i, augment=(augment_seed, k))))
        if not np.isfinite(losses[-1]):
            break
    return losses


def evaluate(session: Session, split: Split) -> tuple[float, float]:
    """(mean loss, the task's metric) over a split, a chunk at a time: a val split of any size
    is evaluated in the memory of a few batches."""
    return session.evaluate_chunks(split.chunks(max(EVAL_CHUNK, session.sig.micro_batch)))


class FineTune:
    """One candidate's fine-tune, measured after some steps and, if asked, trained on to more.

    A search screens every candidate with a short fine-tune and trains only promising ones on to
    the full count (`planner.search.fidelity`). Training on from the screened state costs the
    difference, not a second run, and ends where a fresh run of the full count would: the same
    seeded batches in the same order, and evaluating the val split changes no weight. Each step
    count's result is cached on its own (by model, dataset, candidate, steps and seed; never by
    target), so a cached full result needs no screen and a cached screen no session.
    """

    def __init__(
        self,
        model: Model,
        data: Dataset,
        candidate: Candidate,
        compiled: Artifact,
        seed: int,
        cache_dir: Path,
        interrupted: Callable[[], bool] | None = None,
        threads: Callable[[], int] | None = None,
    ) -> None:
        """`interrupted()`, checked before every step, stops the fine-tune with KeyboardInterrupt:
        how a search running it in a worker thread is stopped at once (a second Ctrl-C).
        `threads()`, also asked before every step, is how many of the pool's threads it may use
        now (0: all; None: as the pool is)."""
        self.model, self.data, self.candidate, self.compiled = model, data, candidate, compiled
        self.seed, self.cache_dir, self.interrupted, self.threads = seed, cache_dir, interrupted, threads
        self._session: TrainingSession | None = None
        self._using: int | None = None  # threads last set for this thread's pool

    def _pace(self) -> None:
        if self.threads is not None and (n := self.threads()) != self._using:
            use_threads(n)
            self._using = n

    def _path(self, steps: int) -> tuple[Path, str]:
        m, d, c = self.model, self.data, self.candidate
        key = hashlib.sha256(
            json.dumps([m.key_for(c.precision), d.sha256, c.to_json(), steps, self.seed, code_id()], sort_keys=True).encode()
        ).hexdigest()[:32]
        return self.cache_dir / "accuracy" / f"{key}.json", key

    def _start(self) -> None:
        t0 = time.perf_counter()
        self._pace()
        self._session = local_session(self.compiled, self.model.initializers)
        self._loss_before, self._before = self._measured_before(self._session)
        self._batches = batches(len(self.data.train), self._session.sig.batch_size, None, self.seed)
        self._losses: list[float] = []
        self._seconds = time.perf_counter() - t0

    def _measured_before(self, session: TrainingSession) -> tuple[float, float]:
        """Val loss and accuracy of the weights before fine-tuning, as this candidate's step
        computes them. Which layers train does not change them, nor does the batch size beyond
        the order of float sums; the precision and the weights stored int8 do. So they are
        measured once per model, dataset, precision and int8 weights, and cached (a batch-1
        candidate spent a quarter of its fine-tune evaluating the untouched model)."""
        sig, m, d = session.sig, self.model, self.data
        # with int8 weights, how each reshaped weight is stored decides what is quantized around it
        layouts = sorted((w, [lay.mode, lay.axis, lay.size]) for w, lay in sig.layouts.items()) if sig.quantized else []
        precision = self.candidate.precision
        blob = [m.key_for(precision), d.sha256, str(precision), sorted(sig.quantized.items()), layouts, code_id()]
        key = hashlib.sha256(json.dumps(blob).encode()).hexdigest()[:32]
        path = self.cache_dir / "accuracy" / "before" / f"{key}.json"
        cached = cachefile.read_json(path, key)
        if cached is not None and set(cached) == {"loss", "accuracy"}:
            loss, accuracy = cached["loss"], cached["accuracy"]
            if all(isinstance(v, float) for v in (loss, accuracy)) and math.isfinite(loss) and m.task.metric.valid(accuracy):
                return loss, accuracy
        loss, accuracy = evaluate(session, d.val)
        path.parent.mkdir(parents=True, exist_ok=True)
        cachefile.write_json(path, {"loss": loss, "accuracy": accuracy}, key)
        return loss, accuracy

    def result(self, steps: int) -> AccuracyResult:
        """Val accuracy before and after `steps` fine-tuning steps (cached across targets)."""
        path, key = self._path(steps)
        cached = cachefile.read_json(path, key)
        if cached is not None and (result := AccuracyResult.from_json(cached)) is not None:
            return result
        if self._session is None or len(self._losses) > steps:
            self._start()
        assert self._session is not None
        t0 = time.perf_counter()
        session, data = self._session, self.data
        # a diverged run cannot recover: it stops at the first non-finite loss, and stays stopped
        while len(self._losses) < steps and (not self._losses or np.isfinite(self._losses[-1])):
            if self.interrupted is not None and self.interrupted():
                raise KeyboardInterrupt
            self._pace()
            i = next(self._batches)
            self._losses.append(session.step(*data.train.batch(i, augment=(self.seed, len(self._losses)))))
        self._pace()
        loss_after, after = evaluate(session, data.val)
        self._seconds += time.perf_counter() - t0
        # A diverged fine-tune is a measured result too — the candidate ruins the model — so the
        # search can learn where that happens (the evaluator marks it infeasible) instead of
        # ignoring a failed trial and proposing the same corner again.
        diverged = None if np.isfinite(self._losses[-1]) else len(self._losses)
        result = AccuracyResult(
            self._before,
            after,
            self._loss_before,
            loss_after if diverged is None else None,
            steps,
            self._seconds,
            diverged,
            self.model.task.metric.name,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        cachefile.write_json(path, result.to_json(), key)
        return result


def measure_accuracy(
    model: Model, data: Dataset, candidate: Candidate, compiled: Artifact, steps: int, seed: int, cache_dir: Path
) -> AccuracyResult:
    """Val accuracy before and after `steps` fine-tuning steps (cached across targets)."""
    return FineTune(model, data, candidate, compiled, seed, cache_dir).result(steps)
