"""A candidate's training module lowered for a target: fused, tuned, scheduled, updated in place,
storages shared and memory planned — the static program both back ends generate code from.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu

from planner.backend.graph.training import build_training_module
from planner.backend.lower import activations, hoist, portable, quantized, sparse, tune
from planner.backend.lower.inplace import in_place_candidates, update_in_place
from planner.backend.lower.kernels import legalize
from planner.backend.lower.schedule import default_schedule
from planner.backend.lower.storage import share_storage
from planner.backend.sgemm import gemm
from planner.inputs.model import Model
from planner.inputs.targets import HardwareTarget, RpcRunner
from planner.runtime.convention import STEP_FUNC
from planner.types import Candidate, Kernels, StepSignature, Updates

TVM_COMPILE = "TVM compile"


def _fuse(mod: tvm.IRModule, target: tvm.target.Target, kernels: Kernels, cache_dir: Path | None, n_inputs: int) -> tvm.IRModule:
    """TVM's CPU pipeline up to fused kernels (TIR functions), the unit of tuning; weight-only
    values that feed much larger kernels fused apart from them (`planner.backend.lower.hoist`)."""
    # planner's legalization first; TVM's own after it is then a no-op
    passes = cpu.library_dispatch_passes(target) + [
        legalize(target, kernels, cache=cache_dir),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
    ]
    mod = sparse.embedding_sgd(mod, threads=gemm.pool_threads(target))
    if kernels is Kernels.PORTABLE:  # int8 activations written as codes; int8 frozen weights read where they lie (flash)
        mod = quantized.int8_activations(mod)
        mod = portable.int8_weights(mod, gemm.pool_threads(target), gemm.limits_for(kernels), cache=cache_dir)
    with target:
        fused = hoist.fuse(tvm.transform.Sequential(passes)(mod), n_inputs)
    if kernels.sgemm:
        fused = gemm.accumulate_in_place(fused, STEP_FUNC, gemm.pool_threads(target), gemm.limits_for(kernels), cache=cache_dir)
    return fused


def _schedule(fused: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """Every kernel not tuned yet given planner's default schedule."""
    with target:
        return default_schedule()(fused)


def _lower(scheduled: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The rest of the CPU pipeline, up to memory planning, where the step's allocations become
    explicit; then the step's storages shared by lifetime (`planner.backend.lower.storage`)."""
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
    fused = _fuse(mod, target, build.kernels, cache_dir, len(sig.inputs))
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
    estimates a candidate's memory from this graph (`planner.backend.graph.estimate`), then compiles
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
