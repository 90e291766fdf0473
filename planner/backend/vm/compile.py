"""The VM back end's build: a training module compiled and linked into one shared library,
kept in the build cache (`planner.backend.cache`).

Failures of the machine rather than the candidate — a cache that cannot be written, a full disk,
the C++ compiler gone — are `EnvironmentFailure`, never a failed trial.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import tvm

from planner import cachefile
from planner.backend._base import ARTIFACT_STEM, ArtifactKind, BuiltArtifact
from planner.backend.cache import META_NAME, cached_build, entry_key
from planner.backend.graph.memory import step_peak
from planner.backend.graph.trainer import update_lr
from planner.backend.lower import link
from planner.backend.lower.pipeline import TVM_COMPILE, BuildOptions, lower_step, training_module
from planner.backend.sgemm import gemm
from planner.errors import DISK_REASONS, CandidateFailed, EnvironmentFailure, PlannerBug, disk_problem, first_line, last_line
from planner.inputs.model import Model
from planner.runtime.convention import STEP_FUNC
from planner.runtime.libraries import PACKAGE, link_options
from planner.types import Candidate, MemoryBreakdown, Recompute, StepSignature

LIB_NAME = f"{ARTIFACT_STEM}.so"


VM_LIBRARY = ArtifactKind("relax-vm")  # a shared library of Relax VM bytecode and kernels, run by TVM's VM


@dataclass(frozen=True, kw_only=True)
class CompiledStep(BuiltArtifact):
    """A compiled candidate in the cache: the VM back end's artifact, one shared library."""

    directory: Path  # the cache entry
    kernel_table: tuple[link.Kernel, ...] = ()  # the library's kernels: symbol, name, flops per call

    @property
    def library(self) -> Path:
        return self.directory / LIB_NAME


def cache_key(model: Model, candidate: Candidate, build: BuildOptions) -> str:
    lr_apart = {k: v for k, v in candidate.to_json().items() if k != "lr"}  # a step input
    settings = {"target": str(build.target), "toolchain": build.toolchain, "kernels": build.kernels}
    return entry_key(model, lr_apart, settings | {"tune_trials": build.tune_trials})


def compile_candidate(model: Model, candidate: Candidate, build: BuildOptions) -> CompiledStep:
    """The candidate's compiled step, from the cache when it is there (see `BuildOptions`).

    The learning rate is an input of the step (`StepSignature.with_lr`), not compiled in: a
    candidate that differs from a cached one only in lr reuses its step."""
    step = _compile_or_load(model, candidate, build)
    return replace(step, signature=step.signature.with_lr(update_lr(candidate, step.signature.loss_scale)))


def _compile_or_load(model: Model, candidate: Candidate, build: BuildOptions) -> CompiledStep:
    cache_dir = build.cache_dir or cachefile.default_cache_dir()
    entry = cache_dir / "steps" / cache_key(model, candidate, build)
    return cached_build(entry, lambda tmp: _compile(model, candidate, build, cache_dir, tmp), _load)


def _failure(exc: Exception, stage: str, cache_dir: Path, toolchain: str | None) -> Exception:
    """`exc`, raised in `stage` of a compile, as the error it is: `EnvironmentFailure` when the
    machine failed (a write refused for want of room or access, by planner or by the linker; the
    C++ compiler or a file gone); `PlannerBug` when TVM could not compile the step (the operator
    table promised it); else `CandidateFailed`."""
    found = disk_problem(exc)
    if found is not None:
        why, filename = found
        return EnvironmentFailure(f"{stage}: cannot write {filename or cache_dir}: {why}")
    text = str(exc)
    for code, why in DISK_REASONS.items():  # the linker is a subprocess: its errno comes as text
        if os.strerror(code) in text:
            return EnvironmentFailure(f"{stage}: the linker cannot write into {cache_dir}: {why}")
    if "File size limit exceeded" in text:  # the linker killed by SIGXFSZ (`ulimit -f`)
        return EnvironmentFailure(f"{stage}: the linker cannot write into {cache_dir}: {DISK_REASONS[errno.EFBIG]}")
    compiler = toolchain or tvm.support.cc.get_cc()
    if compiler is None:
        return EnvironmentFailure(f"{stage}: no C++ compiler found (install g++, or set CXX to one)")
    if shutil.which(compiler) is None:
        return EnvironmentFailure(f"{stage}: the C++ compiler {compiler} is not installed (or not on PATH)")
    missing: BaseException | None = exc
    while missing is not None and not isinstance(missing, FileNotFoundError):
        missing = missing.__cause__ or missing.__context__
    if missing is not None:
        return EnvironmentFailure(f"{stage}: {missing.filename or first_line(missing)}: not found")
    if stage == TVM_COMPILE:  # every op of the step is one the operator table says runs
        return PlannerBug("the step of a model the operator table accepts did not compile", last_line(exc))
    return CandidateFailed(f"{stage} failed: {last_line(exc)}")


def in_cache(model: Model, candidate: Candidate, build: BuildOptions) -> bool:
    """Whether the candidate's step looks built already (its entry's record is there; `_cached`
    verifies it when it is loaded)."""
    cache_dir = build.cache_dir or cachefile.default_cache_dir()
    return (cache_dir / "steps" / cache_key(model, candidate, build) / META_NAME).exists()


def _compile(model: Model, candidate: Candidate, build: BuildOptions, cache_dir: Path, tmp: Path) -> dict:
    """The candidate compiled and linked into `tmp`; the cache entry's record."""
    t0 = time.perf_counter()
    target, toolchain = build.target, build.toolchain
    mod, sig = training_module(model, candidate)
    try:
        step = lower_step(mod, sig, candidate, build, cache_dir)
        lowered, kernels, tuned, tune_seconds, in_place = step.lowered, step.kernels, step.tuned, step.tune_seconds, step.in_place
        executable, workspaces, kernel_table = link.build(lowered, target, cache_dir)
        memory = step_peak(lowered[STEP_FUNC], sig, workspaces)
        requires = [PACKAGE] if gemm.calls_openblas(lowered) else []
    except Exception as exc:
        raise _failure(exc, TVM_COMPILE, cache_dir, toolchain) from None
    if candidate.recompute != Recompute.NONE:
        memory = replace(memory, recompute_saved=_held(_baseline(model, candidate, build)) - _held(memory))

    try:
        compiler = toolchain or tvm.support.cc.get_cc()
        options = link_options(compiler, cache_dir) if requires else []
        executable.export_library(str(tmp / LIB_NAME), fcompile=link.linker(toolchain), options=options)
    except Exception as exc:
        raise _failure(exc, "linking the step", cache_dir, toolchain) from None
    return {
        "files": {LIB_NAME: cachefile.digest(tmp / LIB_NAME)},
        "signature": sig.to_json(),
        "memory": memory.to_json(),
        "compile_seconds": time.perf_counter() - t0,  # linked, as a trial waits for it
        "kernels": kernels,
        "tuned_kernels": list(tuned),
        "tune_seconds": tune_seconds,
        "in_place_updates": in_place,
        "candidate": candidate.to_json(),
        "target": str(target),
        "toolchain": toolchain,
        "requires": requires,
        "kernel_table": [asdict(k) for k in kernel_table],
    }


def _held(memory: MemoryBreakdown) -> int:
    """The bytes recomputation changes: activations and the gradients alive beside them."""
    return memory.activations + memory.gradients


def _baseline(model: Model, candidate: Candidate, build: BuildOptions) -> MemoryBreakdown:
    """The planned memory of `candidate` without recomputation, compiled into the cache as any
    candidate is (a search that proposes both pays for it once)."""
    return _compile_or_load(model, replace(candidate, recompute=Recompute.NONE), build).memory


def _load(entry: Path, meta: dict, cached: bool) -> CompiledStep:
    return CompiledStep(
        kind=VM_LIBRARY,
        files=(entry / LIB_NAME,),
        directory=entry,
        signature=StepSignature.from_json(meta["signature"]),
        memory=MemoryBreakdown(**meta["memory"]),
        compile_seconds=float(meta["compile_seconds"]),
        cached=cached,
        kernels=int(meta.get("kernels", 0)),
        tuned_kernels=tuple(meta.get("tuned_kernels", ())),
        tune_seconds=float(meta.get("tune_seconds", 0.0)),
        in_place_updates=int(meta.get("in_place_updates", 0)),
        kernel_table=tuple(link.Kernel(str(k["symbol"]), str(k["name"]), int(k["flops"])) for k in meta["kernel_table"]),
        requires=tuple(str(r) for r in meta["requires"]),
    )
