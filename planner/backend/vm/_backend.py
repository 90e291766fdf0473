"""The Relax VM back end: a candidate's step as one shared library that TVM's Relax VM runs.

The build is `planner.backend.vm.compile` (fuse, schedule, update in place, share storages, plan
memory, link), cached by content; for a target behind a tracker, MetaSchedule times its tuning
trials on the target's boards.
"""

from __future__ import annotations

import tvm

from planner.backend._base import Backend, BuiltArtifact, MemoryEstimate, Provenance
from planner.backend.graph.estimate import estimate
from planner.backend.lower.pipeline import BuildOptions, training_module
from planner.backend.vm.compile import VM_LIBRARY, CompiledStep, compile_candidate, in_cache
from planner.errors import BadInput, last_line
from planner.inputs.model import Model
from planner.inputs.targets import HardwareTarget
from planner.runtime.convention import STEP_FUNC
from planner.types import Candidate, Kernels

HOST_TARGET = {"kind": "llvm"}  # this machine's CPU, as LLVM detects it


class VmBackend(Backend):
    name = "vm"
    kind = VM_LIBRARY

    @classmethod
    def check(cls, target: HardwareTarget) -> str:
        if target.mcu is not None:
            raise BadInput(
                f"target {target.name}: the vm back end builds for Linux; a microcontroller (`mcu:`) needs `backend: c`"
            )
        if target.kernels is Kernels.PORTABLE:
            raise BadInput(f"target {target.name}: `kernels: portable` is the c back end's; a Linux board takes openblas or tvm")
        try:
            return str(tvm.target.Target(target.tvm_target))
        except Exception as exc:  # noqa: BLE001 - TVM raises ValueError, TVMError, ... for a bad target
            raise BadInput(f"target {target.name}: tvm_target is not a valid TVM target: {last_line(exc)}") from None

    def _options(self) -> BuildOptions:
        return BuildOptions.for_target(self.target, cache_dir=self.cache_dir, tune_trials=self.tune_trials)

    def build(self, model: Model, candidate: Candidate) -> CompiledStep:
        return compile_candidate(model, candidate, self._options())

    def estimate(self, model: Model, candidate: Candidate) -> MemoryEstimate | None:
        build = self._options()
        if in_cache(model, candidate, build):  # loading it is cheaper than estimating
            return None
        mod, sig = training_module(model, candidate)
        return estimate(mod[STEP_FUNC], sig, candidate)

    def host_build(self, model: Model, candidate: Candidate) -> CompiledStep:
        host = BuildOptions(tvm.target.Target(HOST_TARGET), self.cache_dir, kernels=self.target.kernels)
        return compile_candidate(model, candidate, host)

    def provenance(self, artifact: BuiltArtifact) -> Provenance:
        return Provenance(
            memory="liveness over the compiled step after TVM static memory planning, replaying TVM's "
            "pooled allocator (page-rounded blocks reused by size, never returned), plus resident weights, "
            "optimizer state, the batch and the kernels' own workspace scratch (sizes read from the "
            "compiled code, replayed through TVM's workspace pool)",
            schedules=f"{len(artifact.tuned_kernels)} of {artifact.kernels} kernels scheduled from the shared "
            f"MetaSchedule database (tuning trials for this step: {self.tune_trials}), the rest by planner's default "
            "CPU schedule",
        )
