"""Importing planner leaves the process as it was: a program that uses TVM, Optuna or warnings of
its own and imports planner beside them sees no change until it calls planner."""

from __future__ import annotations

import os
import subprocess
import sys

EVERY_MODULE = """
import importlib, os, pkgutil, warnings
import optuna, plotly.tools, tvm  # (plotly.tools adds a warning filter of its own on import)
def state():
    gradients = {op: tvm.ir.Op.get(op).get_attr("FPrimalGradient") for op in tvm.ir.Op.list_op_names()}
    return dict(os.environ), list(warnings.filters), gradients
env, filters, gradients = state()
import planner
names = [m.name for m in pkgutil.walk_packages(planner.__path__, "planner.") if m.name != "planner.__main__"]
for name in names:
    importlib.import_module(name)
env_after, filters_after, gradients_after = state()
print(len(names))
print(sorted(set(env_after.items()) ^ set(env.items())))
print(filters_after == filters)
print(sorted(op for op, g in gradients.items() if not (g is None is gradients_after[op] or g is not None and g.same_as(gradients_after[op]))))
"""


def test_importing_every_module_changes_no_environment_warning_filter_or_gradient():
    """No TVM_NUM_THREADS written (a step's session claims the cores, `planner.runtime.threads`),
    no warning filter added (Optuna's ExperimentalWarning is silenced around the calls that raise
    it), and TVM's gradients as TVM registered them (planner's are set while it differentiates)."""
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}  # (conftest sets it: planner would not)
    done = subprocess.run([sys.executable, "-c", EVERY_MODULE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    count, env, filters, gradients = done.stdout.splitlines()
    assert int(count) > 50  # every module was imported
    assert (env, filters, gradients) == ("[]", "True", "[]")
