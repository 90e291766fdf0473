"""planner's Python API: plan, measure, run, compile and report, as scripts call them.

    import planner

    result = planner.plan(model="model.onnx", data="data.npz", target="raspberry-pi-4", out="plan", trials=40)
    print(result.plan.choice.trainable, result.plan.metrics.peak_memory_bytes.total)

Every parameter after the subject is keyword-only. A search's settings are one validated object
(`Settings`), given whole or as keyword options (`trials=40`), which override it. Errors are
`planner.errors` types whose messages name parameters as they are named here (`trials`, `out`);
the CLI maps those to its flags and exit codes, in `planner/cli/`. Importing this package loads
no TVM: each function imports the compiler when it needs it, so `import planner` stays fast for
reports and scripts.
"""

from planner.api._inputs import Inputs, resolve_target
from planner.api._measure import measure
from planner.api._plans import check_target, compile, example_images, inspect, operators, operators_markdown, report, run
from planner.api._search import PlanResult, plan, work
from planner.api._writing import default_storage
from planner.inputs.settings import Settings

__all__ = [
    "Inputs",
    "PlanResult",
    "Settings",
    "check_target",
    "compile",
    "default_storage",
    "example_images",
    "inspect",
    "measure",
    "operators",
    "operators_markdown",
    "plan",
    "report",
    "resolve_target",
    "run",
    "work",
]
