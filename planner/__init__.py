"""planner: a hardware-aware planner for on-device training.

Which layers to update, in what precision, with what batch size — decided by measuring each
candidate's compiled training step on the target (Apache TVM) and searching with Optuna::

    import planner

    result = planner.plan(model="model.onnx", data="data.npz", target="raspberry-pi-4", out="plan",
                          trials=40, storage="sqlite:///study.db")
    print(result.plan.choice.trainable, result.plan.metrics.peak_memory_bytes.total)
    planner.run("plan", data="new-data.npz", steps=500)          # fine-tune with the plan's step
    print(planner.report("plan", fmt="md"))

Everything here is loaded on first use: `import planner` loads neither TVM nor Optuna, so
reading plans, reports and targets from a script stays fast. Errors are the types in
`planner.errors`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    # the pipeline
    "plan": "planner.api",
    "work": "planner.api",
    "measure": "planner.api",
    "run": "planner.api",
    "compile": "planner.api",
    "report": "planner.api",
    "inspect": "planner.api",
    "example_images": "planner.api",
    "check_target": "planner.api",
    "resolve_target": "planner.api",
    "default_storage": "planner.api",
    "PlanResult": "planner.api",
    "Settings": "planner.inputs.settings",
    # inputs and their loaders
    "Model": "planner.inputs.model",
    "load_model": "planner.inputs.model",
    "Dataset": "planner.inputs.data",
    "load_dataset": "planner.inputs.data",
    "HardwareTarget": "planner.inputs.targets",
    "load_target": "planner.inputs.targets",
    "list_targets": "planner.inputs.targets",
    "SearchSpace": "planner.inputs.spaces",
    "load_space": "planner.inputs.spaces",
    "Scheme": "planner.inputs.schemes",
    "load_scheme": "planner.inputs.schemes",
    # plans
    "Plan": "planner.plans.schema",
    "read_plan": "planner.plans.directory",
    # the types stages pass along
    "Candidate": "planner.types",
    "Mode": "planner.types",
    "Precision": "planner.types",
    "Optimizer": "planner.types",
    "FrozenWeights": "planner.types",
    "Updates": "planner.types",
    "TrialState": "planner.types",
    "TrialRecord": "planner.types",
    "RunResult": "planner.types",
    "StepProfile": "planner.types",
    "KernelTime": "planner.types",
    "Kernels": "planner.types",
}
__all__ = [
    "Settings",
    "Candidate",
    "Dataset",
    "FrozenWeights",
    "HardwareTarget",
    "Mode",
    "Model",
    "Optimizer",
    "Plan",
    "PlanResult",
    "Precision",
    "RunResult",
    "Scheme",
    "StepProfile",
    "KernelTime",
    "Kernels",
    "SearchSpace",
    "TrialRecord",
    "TrialState",
    "Updates",
    "check_target",
    "compile",
    "default_storage",
    "example_images",
    "inspect",
    "list_targets",
    "load_dataset",
    "load_model",
    "load_scheme",
    "load_space",
    "load_target",
    "measure",
    "plan",
    "read_plan",
    "report",
    "resolve_target",
    "run",
    "work",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` loads these on first use
    from planner.api import (
        PlanResult,
        Settings,
        check_target,
        compile,
        default_storage,
        example_images,
        inspect,
        measure,
        plan,
        report,
        resolve_target,
        run,
        work,
    )
    from planner.inputs.data import Dataset, load_dataset
    from planner.inputs.model import Model, load_model
    from planner.inputs.schemes import Scheme, load_scheme
    from planner.inputs.spaces import SearchSpace, load_space
    from planner.inputs.targets import HardwareTarget, list_targets, load_target
    from planner.plans.directory import read_plan
    from planner.plans.schema import Plan
    from planner.types import (
        Candidate,
        FrozenWeights,
        Kernels,
        KernelTime,
        Mode,
        Optimizer,
        Precision,
        RunResult,
        StepProfile,
        TrialRecord,
        TrialState,
        Updates,
    )
