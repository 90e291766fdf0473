"""`CBackend`: the C step built, linked for the target's board and cached by content."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import tvm

from planner import cachefile
from planner.backend import backend_for
from planner.backend._base import ArtifactKind, Backend, BuiltArtifact, DoesNotFit, Provenance
from planner.backend.cache import cached_build, entry_key
from planner.backend.graph.trainer import update_lr
from planner.backend.graph.training import build_training_module
from planner.backend.lower.pipeline import BuildOptions, lower_step
from planner.backend.mcu._firmware import Overflowed, SramPlan, build_firmware
from planner.backend.mcu.cstep import emit
from planner.backend.sgemm.gemm_kernels import FLOPS
from planner.errors import BadInput, CandidateFailed, last_line
from planner.inputs.model import Model
from planner.inputs.targets import HardwareTarget, Mcu, load_target
from planner.types import Candidate, Kernels, MemoryBreakdown, StepSignature

C_FIRMWARE = ArtifactKind("c-firmware")  # an ELF for the target's emulated board, with the C it is built from
DEFAULT_COMPILER = "arm-none-eabi-gcc"


@dataclass(frozen=True, kw_only=True)
class CFirmware(BuiltArtifact):
    """The C back end's artifact: the ELF (the entry) and its sources, as linked."""

    directory: Path  # the cache entry
    flash_bytes: int  # from the ELF's sections
    planned_sram_bytes: int  # from the storage plan, before linking (memory.total is the ELF's)
    calls: tuple[tuple[str, int], ...] = ()  # each kernel call of the step: its kernel and flops (0: not counted)

    @property
    def stored_bytes(self) -> int:
        """The flash the image takes (code, constants, .data's initial values), not its files'
        bytes: sources and debug information never reach the board."""
        return self.flash_bytes


class CBackend(Backend):
    name = "c"
    kind = C_FIRMWARE

    @classmethod
    def check(cls, target: HardwareTarget) -> str:
        if target.mcu is None:
            raise BadInput(f"target {target.name}: the c back end needs an `mcu:` section (cflags, clock_hz, flash, sram, qemu)")
        if target.kernels is Kernels.OPENBLAS:
            raise BadInput(
                f"target {target.name}: a microcontroller has no OpenBLAS; set `kernels: portable` (planner's C sgemm) or `tvm`"
            )
        try:
            tvm.target.Target(target.tvm_target)
        except Exception as exc:  # noqa: BLE001 - TVM raises ValueError, TVMError, ... for a bad target
            raise BadInput(f"target {target.name}: tvm_target is not a valid TVM target: {last_line(exc)}") from None
        return f"C for {' '.join(target.mcu.cflags)} ({target.toolchain or DEFAULT_COMPILER}), on qemu {target.mcu.qemu.machine}"

    @property
    def _board(self) -> Mcu:
        self.check(self.target)
        assert self.target.mcu is not None
        return self.target.mcu

    def _key(self, model: Model, candidate: Candidate) -> str:
        """Everything that decides the image: the learning rate too, as `planner_init` starts from it."""
        build = self.target.model_dump(include={"tvm_target", "toolchain", "mcu", "kernels"})
        return entry_key(model, candidate.to_json(), build)

    def build(self, model: Model, candidate: Candidate) -> CFirmware:
        entry = self.cache_dir / "steps" / f"c-{self._key(model, candidate)}"
        return cached_build(entry, lambda tmp: self._make(model, candidate, tmp), _load)

    def _make(self, model: Model, candidate: Candidate, tmp: Path) -> dict:
        t0 = time.perf_counter()
        board = self._board
        build = BuildOptions(tvm.target.Target(self.target.tvm_target), self.cache_dir, kernels=self.target.kernels)
        mod, sig = build_training_module(model, candidate, bands=True)  # kilobytes of SRAM: the first maps in bands
        sig = sig.with_lr(update_lr(candidate, sig.loss_scale))
        try:
            lowered = lower_step(mod, sig, candidate, build, None)
            step = emit(lowered.lowered, sig)
        except CandidateFailed:
            raise
        except Exception as exc:
            raise CandidateFailed(f"TVM compile failed: {last_line(exc)}") from None
        try:
            firmware = build_firmware(step, sig, model.initializers, board, self.target.toolchain or DEFAULT_COMPILER, tmp)
        except Overflowed as exc:  # over the board's regions: what it would need is the region and more
            ram, flash = exc.regions.get("RAM"), exc.regions.get("FLASH")
            sram = board.sram.bytes + ram if ram is not None else exc.planned.total
            raise DoesNotFit(
                str(exc),
                memory=_memory(sram, exc.planned),
                flash_bytes=board.flash.bytes + flash if flash is not None else None,
                overflow={region: n for region, n in (("ram", ram), ("flash", flash)) if n is not None},
            ) from None
        memory = _memory(firmware.sram_bytes, firmware.planned)
        return {
            "files": {f.name: cachefile.digest(f) for f in firmware.files},
            "order": [f.name for f in firmware.files],
            "signature": sig.to_json(),
            "memory": memory.to_json(),
            "flash_bytes": firmware.flash_bytes,
            "planned_sram_bytes": firmware.planned.total,
            "compile_seconds": time.perf_counter() - t0,
            "kernels": lowered.kernels,
            "in_place_updates": lowered.in_place,
            "calls": [[name, _flops(lowered.lowered[name])] for name in step.calls],
            "candidate": candidate.to_json(),
        }

    def host_build(self, model: Model, candidate: Candidate) -> BuiltArtifact:
        """The step for the fine-tune on this machine: the VM's, which the C step equals up to the
        rounding of the board's libm (`tests/test_c_step.py`)."""
        # by the registry's name: the back ends never import each other
        return backend_for(load_target("host"), cache_dir=self.cache_dir).build(model, candidate)

    def provenance(self, artifact: BuiltArtifact) -> Provenance:
        return Provenance(
            memory="the linked ELF's sections in the board's SRAM (.data, .bss: the arena every activation and "
            "gradient shares, the kernels' scratch, the batch, trainable weights and optimizer state; the stack) "
            "and in flash (code, frozen weights, trainable weights' start)",
            schedules=f"planner's default schedules for {self.target.tvm_target.get('mcpu', 'the core')}, every kernel "
            "emitted as C by TVM and compiled by gcc",
        )


def _load(entry: Path, meta: dict, cached: bool) -> CFirmware:
    return CFirmware(
        kind=C_FIRMWARE,
        files=tuple(entry / name for name in meta["order"]),
        directory=entry,
        signature=StepSignature.from_json(meta["signature"]),
        memory=MemoryBreakdown(**meta["memory"]),
        compile_seconds=float(meta["compile_seconds"]),
        cached=cached,
        kernels=int(meta["kernels"]),
        in_place_updates=int(meta["in_place_updates"]),
        flash_bytes=int(meta["flash_bytes"]),
        planned_sram_bytes=int(meta["planned_sram_bytes"]),
        calls=tuple((str(name), int(flops)) for name, flops in meta["calls"]),
    )


def _memory(sram: int, plan: SramPlan) -> MemoryBreakdown:
    """The SRAM an image takes (`sram`: linked, or what ld said it needed), split as `plan` does."""
    return MemoryBreakdown(
        total=sram,
        activations=plan.arena + plan.batch,
        trainable_params=plan.trainable,
        gradients=0,  # in the arena, among the activations
        optimizer_state=plan.optimizer,
        frozen_params=0,  # in flash
        scratch=sram - plan.arena - plan.batch - plan.trainable - plan.optimizer,
    )


def _flops(func) -> int:
    """A kernel's multiply-adds x 2 where planner's kernels record them (`gemm_kernels.FLOPS`), else 0."""
    return int((func.attrs or {}).get(FLOPS, 0))
