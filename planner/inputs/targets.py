"""Hardware targets: what a board is, how to compile for it, how to reach it, and its budgets.

Targets are YAML files (`hw_targets/NAME.yaml`, or a user's path), validated here:

    description: Raspberry Pi 4 Model B (Cortex-A72)
    tvm_target: {kind: llvm, mtriple: aarch64-linux-gnu, mcpu: cortex-a72}
    toolchain: aarch64-linux-gnu-g++        # cross compiler for export; omit for the host's
    ram_budget_bytes: 1GiB                  # memory the training step may use
    ram_budgets: [256MiB, 512MiB]           # optional: a plan for each, too (`planner plan` writes OUT/<budget>/)
    latency_budget_ms: 200                  # optional
    flash_budget_bytes: 64MiB               # optional: the compiled step must fit
    precisions: [fp32]
    backend: vm                             # optional: what builds the step (vm, the default: TVM's Relax VM)
    runner: rpc                             # where the step runs: local (the default) | rpc
    kernels: openblas                       # optional: openblas (default) | tvm | portable (microcontrollers)
    rpc: {tracker: 127.0.0.1:9190, key: raspberry-pi-4, priority: 1, session_timeout_s: 600}

A microcontroller is a target of the `c` back end (a bare-metal C step) and the `qemu` runner (the
step run and its instructions counted on an emulated board of the same core):

    backend: c
    runner: qemu
    toolchain: arm-none-eabi-gcc
    tvm_target: {kind: llvm, mtriple: thumbv7em-none-eabihf, mcpu: cortex-m4, num-cores: 1}
    kernels: portable
    ram_budget_bytes: 256KiB                # SRAM
    flash_budget_bytes: 1MiB
    mcu:
      cflags: [-mcpu=cortex-m4, -mthumb, -mfloat-abi=hard, -mfpu=fpv4-sp-d16]
      clock_hz: 64e6
      flash: {origin: 0x0, bytes: 4MiB}     # the emulated board's memory map, where the step is linked
      sram: {origin: 0x20000000, bytes: 4MiB}
      qemu: {machine: mps2-an386, cpu: cortex-m4}
"""

from __future__ import annotations

import re
import shutil
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from planner.errors import BadInput
from planner.inputs.addresses import parse_host_port
from planner.inputs.resources import shipped
from planner.inputs.specs import load_spec
from planner.types import Kernels

TARGETS_DIR = shipped("hw_targets")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def budget_label(nbytes: int) -> str:
    """A size as a directory name people read: `256KiB`, `1.5MiB` -> `1536KiB`, `1000B`."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"


def parse_bytes(value: int | str) -> int:
    """`536870912`, `512MiB`, `0.5 GB` -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use bytes or units like 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class RpcRunner(BaseModel):
    """Boards registered with a TVM RPC tracker under one key (several boards may share it)."""

    model_config = ConfigDict(extra="forbid")

    tracker: str
    key: str = Field(min_length=1)
    priority: int = 1
    session_timeout_s: float = Field(default=600, gt=0)

    @field_validator("tracker")
    @classmethod
    def _addr(cls, v: str) -> str:
        parse_host_port(v)
        return v

    @property
    def address(self) -> tuple[str, int]:
        return parse_host_port(self.tracker)


class Region(BaseModel):
    """A range of a board's address space."""

    model_config = ConfigDict(extra="forbid")

    origin: int = Field(ge=0, lt=2**32)
    bytes: int = Field(gt=0)

    @field_validator("bytes", mode="before")
    @classmethod
    def _size(cls, v: int | str) -> int:
        return parse_bytes(v)

    def holds(self, address: int) -> bool:
        return self.origin <= address < self.origin + self.bytes


class Emulator(BaseModel):
    """The qemu-system-arm machine that runs a microcontroller target's steps (and counts their
    instructions): its machine and core, as `qemu-system-arm -machine M -cpu C` takes them."""

    model_config = ConfigDict(extra="forbid")

    machine: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    cpu: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")


class Mcu(BaseModel):
    """A microcontroller: how gcc compiles for its core, its clock, and the memory map a step is
    linked into — the emulated board's (`qemu`), where the step is measured; a real board's
    firmware project links the same sources with its own."""

    model_config = ConfigDict(extra="forbid")

    cflags: list[str] = Field(min_length=1)  # e.g. [-mcpu=cortex-m4, -mthumb, -mfloat-abi=hard, -mfpu=fpv4-sp-d16]
    clock_hz: float = Field(gt=0)  # the core's clock: an instruction count becomes an estimate in ms at it
    flash: Region
    sram: Region
    qemu: Emulator

    @field_validator("cflags")
    @classmethod
    def _flags(cls, v: list[str]) -> list[str]:
        bad = [f for f in v if not re.fullmatch(r"-m[a-z0-9=.+-]+", f)]
        if bad:
            raise ValueError(f"only -m options (the core, its FPU and ABI) belong here, not {bad[0]!r}")
        return v


class HardwareTarget(BaseModel):
    """A board planner plans for."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    tvm_target: dict[str, Any]
    toolchain: str | None = None
    ram_budget_bytes: int = Field(gt=0)
    ram_budgets: list[int] = []
    latency_budget_ms: float | None = Field(default=None, gt=0)
    flash_budget_bytes: int | None = Field(default=None, gt=0)
    precisions: list[Literal["fp32", "fp16", "bf16", "int8"]] = ["fp32"]
    # by name, as `planner.backend.BACKENDS` and `planner.measurement.RUNNERS` register them
    backend: str = Field(default="vm", pattern=r"^[a-z][a-z0-9-]*$")
    runner: str = Field(default="local", pattern=r"^[a-z][a-z0-9-]*$")
    rpc: RpcRunner | None = None  # the `rpc` runner's boards
    mcu: Mcu | None = None  # a microcontroller (the `c` back end's targets)
    # dense convolutions through OpenBLAS (scipy-openblas32 where the step runs) or TVM's schedules
    kernels: Kernels = Kernels.OPENBLAS
    # 8: the step takes each float input as 8-bit codes and decodes them as its first operation
    # (`planner.types.Encoding`): images as their pixels, exactly; arrays scaled to their training range
    input_bits: Literal[8, 32] = 32

    @field_validator("tvm_target", mode="before")
    @classmethod
    def _target_mapping(cls, v: Any) -> Any:
        if isinstance(v, str):  # TVM's own string form: the usual slip
            raise ValueError(
                f"write it as a mapping like {{kind: llvm, mtriple: aarch64-linux-gnu, mcpu: cortex-a72}}, not {v!r}"
            )
        return v

    @field_validator("ram_budget_bytes", "flash_budget_bytes", mode="before")
    @classmethod
    def _bytes(cls, v: int | str | None) -> int | None:
        return None if v is None else parse_bytes(v)

    @field_validator("ram_budgets", mode="before")
    @classmethod
    def _budgets(cls, v: list[int | str]) -> list[int]:
        budgets = [parse_bytes(b) for b in v]
        if any(b <= 0 for b in budgets):
            raise ValueError("every RAM budget must be more than 0 bytes")
        return sorted(set(budgets))

    @model_validator(mode="after")
    def _runner(self) -> HardwareTarget:
        if self.runner == "rpc" and self.rpc is None:
            raise ValueError("runner: rpc needs an `rpc: {tracker: HOST:PORT, key: KEY}` section")
        return self

    @property
    def boards(self) -> RpcRunner | None:
        """The boards behind a tracker this target runs on, or None when it runs here."""
        return self.rpc if self.runner == "rpc" else None

    def over_tracker(self, tracker: str, key: str) -> HardwareTarget:
        """This target measured on boards behind `tracker` under `key` (the CLI's --tracker/--key)."""
        rest = self.rpc.model_dump(exclude={"tracker", "key"}) if self.rpc else {}
        try:
            rpc = RpcRunner(tracker=tracker, key=key, **rest)
        except ValidationError as exc:
            raise BadInput(f"`tracker`/`key`: {exc.errors()[0]['msg']}") from None
        return self.model_copy(update={"runner": "rpc", "rpc": rpc})

    def identity(self) -> dict:
        """What decides a measurement's result: the board kind and budgets, not where it is reached."""
        # the default back end is left out: studies made before targets named one were its studies
        return self.model_dump(exclude={"description", "runner", "rpc", *(["backend"] if self.backend == "vm" else [])})

    def toolchain_path(self) -> str | None:
        """The cross compiler found on PATH (None: the target uses the host's default compiler)."""
        if self.toolchain is None:
            return None
        found = shutil.which(self.toolchain)
        if found is None:
            raise BadInput(
                f"target {self.name} needs the cross compiler {self.toolchain!r}, which is not on PATH "
                "(Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu)"
            )
        return found


def load_target(name_or_path: str) -> HardwareTarget:
    """A shipped target by name (`hw_targets/NAME.yaml`) or a user's YAML file."""
    return load_spec(name_or_path, TARGETS_DIR, "target", HardwareTarget)


def list_targets() -> list[HardwareTarget]:
    return [load_target(p.stem) for p in sorted(TARGETS_DIR.glob("*.yaml"))]
