"""Hardware targets: what a board is, how to compile for it, and its budgets (YAML in hw_targets/)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import BadInput

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
    path = Path(name_or_path)
    if not path.suffix:
        path = TARGETS_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in TARGETS_DIR.glob("*.yaml")))
        raise BadInput(f"unknown target {name_or_path!r} (shipped: {shipped}; or a path to a YAML file)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        target = HardwareTarget.model_validate({"name": path.stem, **raw})
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        raise BadInput(f"{path}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from None
    try:
        target.tvm()
    except Exception as exc:
        raise BadInput(f"{path}: tvm_target is not a valid TVM target: {str(exc).strip().splitlines()[-1]}") from None
    return target
