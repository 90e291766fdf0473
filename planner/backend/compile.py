"""Training module -> shared library for the target, cached on disk by content.

The cache key is everything that decides the bytes of the library: the model's sha256, the
candidate, the TVM target and the versions of planner and TVM. A candidate is never compiled twice,
in one run or across runs; entries are written to a temporary folder and renamed into place, so a
killed compile leaves nothing half-written. An entry is verified before it is used (see
`cachefile`): a damaged one is a miss, removed and compiled again.

Failures of the machine rather than the candidate — a cache that cannot be written, a full disk,
the C++ compiler gone — are `EnvironmentFailure`, never a failed trial.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import functools
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu

from planner import __version__, cachefile
from planner.backend import activations, gemm, link, sparse, tune
from planner.backend._base import ARTIFACT_STEM, ArtifactKind, BuiltArtifact
from planner.backend.graph import STEP_FUNC, build_training_module
from planner.backend.inplace import in_place_candidates, update_in_place
from planner.backend.kernels import legalize
from planner.backend.libraries import PACKAGE, link_options
from planner.backend.memory import step_peak
from planner.backend.schedule import default_schedule
from planner.backend.storage import share_storage
from planner.backend.trainer import update_lr
from planner.errors import (
    DISK_REASONS,
    CandidateFailed,
    EnvironmentFailure,
    PlannerBug,
    disk_problem,
    first_line,
    last_line,
    reason,
)
from planner.inputs.model import Model
from planner.inputs.targets import HardwareTarget, RpcRunner
from planner.types import Candidate, Kernels, MemoryBreakdown, Recompute, StepSignature, Updates

LIB_NAME = f"{ARTIFACT_STEM}.so"
VM_LIBRARY = ArtifactKind("relax-vm")  # a shared library of Relax VM bytecode and kernels, run by TVM's VM
META_NAME = "train_step.json"  # the cache entry's record, never part of the artifact
TVM_COMPILE = "TVM compile"


def check_cache_dir(path: str | Path) -> Path:
    """`path`, created when missing, once a file could be written in it: a file given as the
    cache, a read-only directory or file system, or a full disk is one `EnvironmentFailure` line
    naming the directory, before any trial runs instead of in every one."""
    path = Path(path)
    hint = "set PLANNER_CACHE_DIR to a writable directory"
    if path.exists() and not path.is_dir():
        raise EnvironmentFailure(f"cannot use the compile cache {path}: it is a file, not a directory ({hint})")
    try:
        path.mkdir(parents=True, exist_ok=True)
        # root ignores permission bits: only a real write tells whether writing works
        with tempfile.TemporaryFile(dir=path, prefix=".probe-", buffering=0) as probe:
            probe.write(b"planner")
    except OSError as exc:
        raise EnvironmentFailure(f"cannot use the compile cache {path}: {reason(exc)} ({hint})") from None
    return path


@dataclass(frozen=True, kw_only=True)
class CompiledStep(BuiltArtifact):
    """A compiled candidate in the cache: the VM back end's artifact, one shared library."""

    directory: Path  # the cache entry
    kernel_table: tuple[link.Kernel, ...] = ()  # the library's kernels: symbol, name, flops per call

    @property
    def library(self) -> Path:
        return self.directory / LIB_NAME


@functools.cache
def code_id() -> str:
    """A hash of planner's own source: a changed graph builder or memory model must not reuse
    entries built by the old one, even within one released version."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(model: Model, candidate: Candidate, build: BuildOptions) -> str:
    blob = json.dumps(
        {
            "model": model.key,
            "candidate": {k: v for k, v in candidate.to_json().items() if k != "lr"},  # a step input
            "target": str(build.target),
            "toolchain": build.toolchain,
            "kernels": build.kernels,
            "tune_trials": build.tune_trials,
            "versions": {"planner": __version__, "code": code_id(), "tvm": tvm.__version__},
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _fuse(mod: tvm.IRModule, target: tvm.target.Target, kernels: Kernels, cache_dir: Path | None) -> tvm.IRModule:
    """TVM's CPU pipeline up to fused kernels (TIR functions), the unit of tuning."""
    # planner's legalization first; TVM's own after it is then a no-op
    passes = cpu.library_dispatch_passes(target) + [legalize(target, kernels, cache=cache_dir)] + cpu.legalize_passes(target)
    mod = sparse.embedding_sgd(mod, threads=gemm.pool_threads(target))
    with target:
        fused = tvm.transform.Sequential(passes)(mod)
    if kernels.sgemm:
        fused = gemm.accumulate_in_place(fused, STEP_FUNC, gemm.pool_threads(target), gemm.limits_for(kernels), cache=cache_dir)
    return fused


def _schedule(fused: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """Every kernel not tuned yet given planner's default schedule."""
    with target:
        return default_schedule()(fused)


def _lower(scheduled: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The rest of the CPU pipeline, up to memory planning, where the step's allocations become
    explicit; then the step's storages shared by lifetime (`planner.backend.storage`)."""
    passes = cpu.dataflow_lower_passes(target) + [
        relax.transform.StaticPlanBlockMemory(),
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
    ]
    with target:
        lowered = tvm.transform.Sequential(passes)(scheduled)
    lowered[STEP_FUNC] = share_storage(lowered[STEP_FUNC])
    return lowered


@dataclass(frozen=True)
class BuildOptions:
    """How every step of a study is built: for which TVM target, linked by which compiler, cached
    where, tuned how much (and timed on which boards). One object, so no caller forgets a part.

    `toolchain` is the C++ (cross) compiler that links the library, e.g. `aarch64-linux-gnu-g++`
    for a Raspberry Pi; None links with the host's default compiler. `tune_trials` > 0 first
    spends that many MetaSchedule trials on the step's kernels, then schedules every kernel the
    target's shared tuning database has a record for (found now or by any earlier tuning); 0
    uses planner's default schedule only. `rpc` (a target's boards behind a tracker) times the
    tuning trials on a board rather than here. `kernels` says who computes dense convolutions
    (`Kernels`): OpenBLAS, the default, makes the step need scipy-openblas32 where it runs.
    """

    target: tvm.target.Target
    cache_dir: Path | None = None
    toolchain: str | None = None
    tune_trials: int = 0
    rpc: RpcRunner | None = None
    kernels: Kernels = Kernels.OPENBLAS

    @classmethod
    def for_target(cls, target: HardwareTarget, *, cache_dir: Path | None = None, tune_trials: int = 0) -> BuildOptions:
        """The build `target` (a hardware target file) asks for: its TVM target, toolchain,
        boards and kernels."""
        return cls(tvm.target.Target(target.tvm_target), cache_dir, target.toolchain, tune_trials, target.boards, target.kernels)


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


T = TypeVar("T")


def cached_build(entry: Path, make: Callable[[Path], dict], load: Callable[[Path, dict, bool], T]) -> T:
    """The artifact in the cache entry `entry`, built by `make(tmp)` when it is not there whole.

    `make` writes the artifact's files into the empty folder `tmp` and returns the entry's record,
    whose `files` maps each of them to its digest; the folder is renamed into place, so a killed
    build leaves nothing half-written. `load(entry, record, cached)` makes the artifact. Workers
    of one study share the cache: whoever builds a candidate first, the others wait for it and
    load the result instead of building it again."""
    if (step := _cached(entry, load)) is not None:
        return step
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with open(entry.parent / f"{entry.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (step := _cached(entry, load)) is not None:
                return step
            _discard(entry)
            tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
            try:
                meta = make(tmp)
                cachefile.write_json(tmp / META_NAME, meta, entry.name)
                tmp.rename(entry)  # under the lock, after `_discard`: no other entry is there
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            return load(entry, meta, False)
    except OSError as exc:  # the cache's own files: its folders, the lock, the entry's metadata
        raise EnvironmentFailure(f"cannot write the compile cache {entry.parent.parent}: {reason(exc)}") from None


def _cached(entry: Path, load: Callable[[Path, dict, bool], T]) -> T | None:
    """The entry's artifact when its metadata verifies and every file is the one the metadata
    hashed; None (a miss) for a missing, partial, damaged or edited entry. Nothing may load a
    library before this check: dlopen of a truncated one is a SIGBUS, not an exception."""
    meta = cachefile.read_json(entry / META_NAME, entry.name)
    if meta is None or not isinstance(meta.get("files"), dict) or not meta["files"]:
        return None
    if not all(cachefile.matches(entry / name, digest) for name, digest in meta["files"].items()):
        return None
    try:
        return load(entry, meta, True)
    except (KeyError, TypeError, ValueError):  # a field missing or of the wrong kind
        return None


def _discard(entry: Path) -> None:
    """Removes a bad entry (if there is one): renamed aside first, so no reader ever sees it
    half-deleted, then deleted."""
    bad = entry.with_name(f".bad-{entry.name}-{secrets.token_hex(4)}")
    try:
        entry.rename(bad)
    except FileNotFoundError:
        return
    shutil.rmtree(bad, ignore_errors=True)


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


@dataclass(frozen=True)
class LoweredStep:
    """A candidate's step after planner's passes, before code generation: a static program of
    storages, tensors and kernel calls (`lowered[STEP_FUNC]`) that a back end turns into code."""

    lowered: tvm.IRModule
    signature: StepSignature
    kernels: int  # compiled kernels in the step
    tuned: tuple[str, ...]  # those scheduled from the tuning database
    tune_seconds: float
    in_place: int  # updates written over their old buffers


def lower_step(
    mod: tvm.IRModule, sig: StepSignature, candidate: Candidate, build: BuildOptions, cache_dir: Path | None
) -> LoweredStep:
    """The candidate's training module (`build_training_module`) fused, tuned (with
    `build.tune_trials`), scheduled, updated in place and memory-planned for `build.target`."""
    target = build.target
    fused = _fuse(mod, target, build.kernels, cache_dir)
    # judged before tuning and scheduling rewrite the kernels
    in_place_ok = in_place_candidates(fused, sig) if candidate.updates is Updates.IN_PLACE else set()
    # a microcontroller's step, where every kilobyte counts; OpenBLAS steps would gain too, but their
    # memory was measured and recorded without it (docs/benchmarks.md)
    over_activations = activations.candidates(fused) if build.kernels is Kernels.PORTABLE else set()
    tuned: tuple[str, ...] = ()
    tune_seconds = 0.0
    if build.tune_trials > 0 and cache_dir is not None:
        db = tune.database_dir(cache_dir, target)
        t_tune = time.perf_counter()
        tune.tune(fused, target, build.tune_trials, db, build.rpc, build.toolchain)
        tune_seconds = time.perf_counter() - t_tune
        fused, tuned = tune.apply(fused, target, db)
    kernels = sum(isinstance(f, tvm.tirx.PrimFunc) for _, f in fused.functions_items())
    scheduled = _schedule(fused, target)
    scheduled, in_place = update_in_place(scheduled, sig, in_place_ok)
    scheduled, _ = activations.in_place(scheduled, over_activations)
    return LoweredStep(_lower(scheduled, target), sig, kernels, tuned, tune_seconds, in_place)


_GRAPHS: collections.OrderedDict[str, tuple[tvm.IRModule, StepSignature]] = collections.OrderedDict()
_GRAPHS_LOCK = threading.Lock()


def training_module(model: Model, candidate: Candidate) -> tuple[tvm.IRModule, StepSignature]:
    """`build_training_module(model, candidate)`, kept for the last few candidates: a search
    estimates a candidate's memory from this graph (`planner.backend.estimate`), then compiles
    the same one. Each caller gets a module of its own (passes may add functions to it)."""
    key = f"{model.key}:{candidate.key()}"
    with _GRAPHS_LOCK:
        found = _GRAPHS.get(key)
    if found is None:
        found = build_training_module(model, candidate)
        with _GRAPHS_LOCK:
            _GRAPHS[key] = found
            while len(_GRAPHS) > 4:
                _GRAPHS.popitem(last=False)
    mod, sig = found
    return tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs), sig


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
