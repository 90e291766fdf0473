"""Evaluate one candidate for real: compile it for the target, measure it there, fine-tune it.

This is the work of one search trial and of `planner measure` alike. What it measures fills a
`TrialResult` stage by stage, handed to `Hooks.saved` as each stage finishes, so a candidate that
fails late still leaves what was measured; `TrialRecord` is the plain-data view of a finished
evaluation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from planner import faults
from planner.backend import Backend, BuiltArtifact, DoesNotFit, backend_for
from planner.errors import CandidateFailed, EnvironmentFailure, NotTheCandidates, disk_problem, last_line
from planner.inputs.data import Dataset
from planner.inputs.model import Model
from planner.inputs.targets import HardwareTarget
from planner.measurement import Measurement, Runner, runner_for
from planner.measurement.accuracy import FineTune
from planner.runtime.threads import use_threads
from planner.search.fidelity import ScreenPoint, beaten_by, margin
from planner.types import AccuracyResult, Candidate, Fidelity, TrialResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    seed: int
    accuracy_steps: int
    latency_repeats: int
    cache_dir: Path
    tune_trials: int = 0  # MetaSchedule trials per candidate build for the target (0: default schedules)
    screen_steps: int = 0  # fine-tune this many steps first, the rest only if promising (0: all steps at once)


def _never() -> bool:
    return False


def _nothing(*_: object) -> None:
    pass


@dataclass(frozen=True)
class Hooks:
    """How a search steers one evaluation; the defaults are a lone one (`planner measure`)."""

    rivals: Callable[[], list[ScreenPoint]] = list  # finished trials' screens (multi-fidelity)
    before_timing: Callable[[], None] = _nothing  # returns once the machine is this trial's alone
    after_timing: Callable[[], None] = _nothing
    interrupted: Callable[[], bool] = _never  # true: stop the fine-tune now (KeyboardInterrupt)
    fine_tune_threads: Callable[[], int] | None = None  # the fine-tune's pool threads now (0: all; None: as is)
    recipe: bool = False  # one of the space's hand-made recipes: never screened out (`Evaluator._screen`)
    saved: Callable[[TrialResult], None] = _nothing  # the result so far, after each stage (a study stores it)


def _label(c: Candidate) -> str:
    """A candidate in one short line, for the debug log."""
    return f"[{','.join(f'{n}:{m}' for n, m in c.trainable)} b{c.batch_size} {c.optimizer} {c.precision}]"


class Evaluator:
    """Evaluates candidates of one model on one target; safe to call from several threads."""

    def __init__(self, model: Model, data: Dataset, target: HardwareTarget, settings: EvalSettings):
        self.model, self.data, self.target, self.settings = model, data, target, settings
        self.backend: Backend = backend_for(target, cache_dir=settings.cache_dir, tune_trials=settings.tune_trials)
        self.runner: Runner = runner_for(target)
        self._compile_lock = threading.Lock()  # TVM compiles one candidate at a time

    def compiling(self) -> bool:
        """Whether a compile is running (in any thread of this evaluator)."""
        return self._compile_lock.locked()

    def _build(self, candidate: Candidate, *, host: bool = False) -> BuiltArtifact:
        with self._compile_lock:  # tuning (if any) times its trials on the target's boards
            build = self.backend.host_build if host else self.backend.build
            return build(self.model, candidate)

    def evaluate(
        self, candidate: Candidate, result: TrialResult, hooks: Hooks = Hooks(), *, estimate: bool = True
    ) -> dict[str, float]:
        """Measure `candidate` into `result`; returns its constraints (feasible when all are <= 0): the target's
        budgets, `diverged`, and `screened` in a multi-fidelity search (`settings.screen_steps`).
        A candidate estimated over the RAM budget returns that constraint alone, its memory
        recorded as estimated (`memory_estimated`) and nothing else measured — unless not to
        `estimate` (`planner measure`: the scheme asked for is measured, over budget or not); one
        the board's linker refuses (`DoesNotFit`) returns its budgets' with its memory as linked.

        Raises CandidateFailed (with the reason also in `result`) when it cannot be built or run,
        KeyboardInterrupt when `hooks.interrupted()` turns true mid fine-tune.
        """
        settings = self.settings
        result.candidate = candidate
        hooks.saved(result)
        try:
            over = self._over_budget(candidate, result) if estimate else None
            if over is not None:
                hooks.saved(result)
                return over
            try:
                compiled = self._compile(candidate, result)
            except DoesNotFit as exc:  # the board's linker refused it: over budget, not failed ...
                if not estimate:  # ... but a scheme to measure cannot be
                    raise
                return self._does_not_fit(candidate, exc, result, hooks)
            hooks.saved(result)
            measured = self._measure(candidate, compiled, result, hooks)
            hooks.saved(result)
            faults.point("trial-accuracy")
            # accuracy does not depend on the board: a board build may not even run here
            t0 = time.perf_counter()
            on_host = compiled if self.runner.runs_here else self._build(candidate, host=True)
            one = self.runner.runs_here and measured.latency.threads == 1  # (a short step: one thread is faster)
            run = FineTune(
                self.model,
                self.data,
                candidate,
                on_host,
                settings.seed,
                settings.cache_dir,
                hooks.interrupted,
                (lambda: 1) if one else hooks.fine_tune_threads,
            )
            budgets = self._budgets(compiled.memory.total, compiled.stored_bytes, measured.latency.median)
            fidelity = None
            if settings.screen_steps:
                fidelity = self._screen(
                    run.result(settings.screen_steps), budgets, measured.latency.median, compiled, hooks.rivals, hooks.recipe
                )
                result.fidelity = fidelity
                hooks.saved(result)  # rival trials compare their screens with it from now on
            acc = run.result(settings.accuracy_steps) if fidelity is None or fidelity.promoted else fidelity.screen
            result.accuracy = acc
            result.seconds["accuracy_s"] = time.perf_counter() - t0
            hooks.saved(result)
            log.debug(
                "%s: fine-tuned %d steps, val acc %.3f -> %.3f%s",
                _label(candidate),
                acc.steps,
                acc.before,
                acc.after,
                f" (diverged at step {acc.diverged_at})" if acc.diverged_at else "",
            )
        except NotTheCandidates as exc:  # the board, cache or disk, or planner: not the candidate's failure
            log.debug("%s: not the candidate's failure: %s", _label(candidate), exc)
            raise
        except CandidateFailed as exc:
            log.debug("%s: failed: %s", _label(candidate), exc)
            result.fail_reason = str(exc)
            hooks.saved(result)
            raise
        except Exception as exc:  # anything else in TVM: this candidate fails, the study goes on
            disk = disk_problem(exc)
            if disk is not None:  # out of room or write access somewhere: the machine's, not the candidate's
                raise EnvironmentFailure(f"cannot write {disk[1] or 'a file'}: {disk[0]}") from None
            reason = f"{type(exc).__name__}: {last_line(exc)}" if str(exc).strip() else type(exc).__name__
            log.debug("%s: failed", _label(candidate), exc_info=True)
            result.fail_reason = reason
            hooks.saved(result)
            raise CandidateFailed(reason) from exc
        constraints = dict(budgets)
        # a fine-tune that diverged is measured but never deployable (1: violated, -1: met) ...
        constraints["diverged"] = 1.0 if acc.diverged_at is not None else -1.0
        if fidelity is not None:  # ... nor one beaten at its screen (its accuracy is short of accuracy_steps)
            beaten = not fidelity.promoted and all(v <= 0 for v in constraints.values())
            constraints["screened"] = 1.0 if beaten else -1.0
        return constraints

    def _over_budget(self, candidate: Candidate, result: TrialResult) -> dict[str, float] | None:
        """The constraints of a candidate whose memory estimate puts it over the RAM budget even
        at the estimate's measured worst error (`MemoryEstimate.at_least`): it is infeasible, and
        neither built, measured nor fine-tuned. None for every other candidate."""
        t0 = time.perf_counter()
        estimate = self.backend.estimate(self.model, candidate)
        if estimate is None or estimate.at_least <= self.target.ram_budget_bytes:
            return None
        result.memory, result.memory_estimated = estimate.memory, True
        result.seconds["compile_s"] = time.perf_counter() - t0
        log.debug("%s: estimated at %d bytes or more, over the RAM budget: not compiled", _label(candidate), estimate.at_least)
        return {"ram_budget": float(estimate.at_least - self.target.ram_budget_bytes)}

    def _does_not_fit(self, candidate: Candidate, exc: DoesNotFit, result: TrialResult, hooks: Hooks) -> dict[str, float]:
        """The constraints of a candidate too large for the board to link: how far over each
        budget what it needs is, and at least what the board lacks (a target may set a budget
        beyond its board's memory)."""
        result.memory = exc.memory
        hooks.saved(result)
        log.debug("%s: does not fit the board: %s", _label(candidate), exc)
        budgets = self._budgets(exc.memory.total, exc.flash_bytes, None)
        for region, by in exc.overflow.items():
            key = f"{region}_budget"
            budgets[key] = max(budgets.get(key, 0.0), float(by))
        return budgets

    def _compile(self, candidate: Candidate, result: TrialResult) -> BuiltArtifact:
        """Build `candidate` and record what the build cost, apart so `evaluate` stays readable."""
        faults.point("trial-compile")
        compiled = self._build(candidate)
        self.runner.check_kind(compiled)
        result.memory, result.library_bytes, result.tuned_kernels = (
            compiled.memory,
            compiled.stored_bytes,
            len(compiled.tuned_kernels),
        )
        # time this trial spent, not what cached results once cost
        result.seconds["compile_s"] = 0.0 if compiled.cached else compiled.compile_seconds - compiled.tune_seconds
        result.seconds["tune_s"] = 0.0 if compiled.cached else compiled.tune_seconds
        log.debug(
            "%s: %s, %d kernels (%d tuned), peak %d bytes",
            _label(candidate),
            "from the cache" if compiled.cached else f"compiled in {compiled.compile_seconds:.1f} s",
            compiled.kernels,
            len(compiled.tuned_kernels),
            compiled.memory.total,
        )
        return compiled

    def _measure(self, candidate: Candidate, compiled: BuiltArtifact, result: TrialResult, hooks: Hooks) -> Measurement:
        """Time `compiled` on the board and record it, apart so `evaluate` stays readable."""
        faults.point("trial-measure")
        hooks.before_timing()
        if hooks.interrupted():  # stopped at once while it waited: it is queued again
            raise KeyboardInterrupt
        t0 = time.perf_counter()
        use_threads(0)  # timed on every core, whatever this thread's last fine-tune used
        measured = self.runner.measure(compiled, self.model.initializers, self.settings.latency_repeats)
        hooks.after_timing()
        result.latency, result.board, result.board_memory = measured.latency, measured.board, measured.board_memory
        result.seconds["measure_s"] = time.perf_counter() - t0
        log.debug("%s: step %.3f ms median on %s", _label(candidate), measured.latency.median, measured.board)
        return measured

    def _budgets(self, ram: int, stored: int | None, latency_ms: float | None) -> dict[str, float]:
        """How far over each of the target's budgets a step of `ram` peak bytes, `stored` bytes on
        the board and `latency_ms` is (<= 0: within; a figure not known is not judged)."""
        target = self.target
        budgets = {"ram_budget": float(ram - target.ram_budget_bytes)}
        if target.latency_budget_ms is not None and latency_ms is not None:
            budgets["latency_budget"] = latency_ms - target.latency_budget_ms
        if target.flash_budget_bytes is not None and stored is not None:
            budgets["flash_budget"] = float(stored - target.flash_budget_bytes)
        return budgets

    def _screen(
        self,
        screen: AccuracyResult,
        budgets: dict[str, float],
        latency_ms: float,
        compiled,
        rivals: Callable[[], list[ScreenPoint]],
        recipe: bool = False,
    ) -> Fidelity:
        """Whether a candidate's screening fine-tune earns it the full `accuracy_steps`.

        A `recipe` (the space's hand-made schemes a study starts from) always does, within the
        budgets: a plan is to be never worse than the recipe a user would otherwise copy, and a
        short screen is unfair to exactly those that train many layers (after a quarter of the
        steps, updating every layer was still at chance where the head alone had converged; in
        full it was the more accurate)."""
        steps = self.settings.screen_steps
        if screen.diverged_at is not None:
            return Fidelity(screen, False, f"diverged at step {screen.diverged_at} of its {steps}-step screen")
        over = [k for k, v in budgets.items() if v > 0]
        if over:
            return Fidelity(screen, False, f"over {', '.join(over)}: fine-tuning longer cannot change that")
        metric = screen.measure
        noise, points = margin(self.data.judged, metric, screen.after), rivals()
        against = tuple(sorted(p.trial for p in points))
        if recipe:
            return Fidelity(screen, True, "one of the space's hand-made recipes: always fine-tuned in full", against)
        rival = beaten_by(screen.quality, latency_ms, float(compiled.memory.total), points, noise)
        name = metric.name
        if rival is not None:
            return Fidelity(
                screen,
                False,
                f"after {steps} steps trial {rival.trial} is better ({name} {metric.quality(rival.accuracy):.4g} vs "
                f"{screen.after:.4g}, beyond the {noise:.3g} noise margin), no slower and no larger",
                against,
            )
        why = f"none of the {len(points)} finished trials beats its {steps}-step {name} ({screen.after:.4g})"
        return Fidelity(screen, True, why, against)
