"""Hardware targets: what a board is, how to compile for it, and its budgets (YAML in hw_targets/)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import BadInput
from .spec import load_spec

TARGETS_DIR = Path(__file__).resolve().parent.parent / "hw_targets"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(value: int | str) -> int:
    """`536870912`, `512MiB`, `0.5 GB` -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use bytes or units like 512MiB, 2GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class HardwareTarget(BaseModel):
    """A board planner plans for."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    tvm_target: dict[str, Any]
    ram_budget_bytes: int = Field(gt=0, description="memory the training step may use")
    latency_budget_ms: float | None = Field(default=None, gt=0)
    precisions: list[Literal["fp32"]] = ["fp32"]
    runner: Literal["local"] = "local"

    @field_validator("ram_budget_bytes", mode="before")
    @classmethod
    def _bytes(cls, v: int | str) -> int:
        return parse_bytes(v)

    @property
    def device(self) -> str:
        return "local"

    def tvm(self):  # -> tvm.target.Target; imported lazily: TVM is slow to import
        import tvm

        return tvm.target.Target(self.tvm_target)


def load_target(name_or_path: str) -> HardwareTarget:
    """A shipped target by name (`hw_targets/NAME.yaml`) or a user's YAML file."""
    target = load_spec(name_or_path, TARGETS_DIR, "target", HardwareTarget)
    try:
        target.tvm()
    except Exception as exc:
        raise BadInput(f"target {target.name}: tvm_target is not a valid TVM target: {str(exc).strip().splitlines()[-1]}") from None
    return target
