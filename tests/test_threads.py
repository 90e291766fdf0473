"""How many threads a step runs on: the machine's cores unless the user says otherwise, and a
search's fine-tune on one of them while a compile runs beside it. Each case runs in a process of
its own: TVM sizes a thread's pool once, when the thread first runs a kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from planner.runtime.threads import physical_cores


def _run(code: str, threads: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    if threads is not None:
        env["TVM_NUM_THREADS"] = threads
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


POOL = """
import os, threading, tvm
from tvm import relax
from planner.runtime.session import TrainingSession
from planner.types import StepSignature
print(os.environ.get("TVM_NUM_THREADS"))
bb = relax.BlockBuilder()
x = relax.Var("x", relax.TensorType((1,), "float32"))
with bb.function("main", [x]):
    bb.emit_func_output(x)
nothing = StepSignature(
    inputs=(), batch_size=1, micro_batch=1, frozen=(), trainable=(), layouts={}, quantized={}, loss_scale=1.0, optim_states=(), n_classes=1
)
TrainingSession(tvm.compile(bb.get(), "llvm"), nothing, {})  # what every run of a step makes first
out = []
t = threading.Thread(target=lambda: out.append(tvm.runtime.num_threads()))
t.start(); t.join()
print(out[0])
"""


def test_steps_run_on_every_physical_core_unless_the_user_says_otherwise():
    """TVM alone halves an x86 machine's hardware threads (assuming two per core): on a machine
    without SMT that left half the cores idle in every measured step. planner claims the cores
    when a step's session is made, not on import: a program that only imports planner keeps its
    environment."""
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))
    assert _run(POOL, None).split() == ["None", str(physical_cores())]
    assert _run(POOL, "1").split() == ["1", "1"]


FINE_TUNE = """
import sys, threading, tvm
from pathlib import Path
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.inputs.data import load_dataset
from planner.inputs.model import load_model
from planner.measurement.accuracy import FineTune
from planner.types import Candidate
model_path, data_path, cache = sys.argv[1:4]
model = load_model(model_path)
data = load_dataset(data_path, model)
head = [layer.name for layer in model.layers if layer.weight][-1]
candidate = Candidate(trainable=((head, "full"),), batch_size=4, optimizer="sgd", lr=0.05)
step = compile_candidate(model, candidate, BuildOptions(tvm.target.Target({"kind": "llvm"}), Path(cache)))
compiling, seen = [True], []
def fine_tune():  # one core while a compile runs beside it, then all of them
    run = FineTune(model, data, candidate, step, 0, Path(cache), threads=lambda: 1 if compiling[0] else 0)
    run.result(2)
    seen.append(tvm.runtime.num_threads())
    compiling[0] = False
    run.result(6)
    seen.append(tvm.runtime.num_threads())
t = threading.Thread(target=fine_tune)
t.start(); t.join()
print(*seen)
"""


def test_a_fine_tune_uses_the_threads_it_is_given_step_by_step(tiny_model, tiny_data, tmp_path):
    """A search's fine-tune asks before every step how many threads it may use: one while the
    next candidate compiles beside it, all of them once it runs alone."""
    if physical_cores() < 2:
        pytest.skip("one core: nothing to share")
    code = FINE_TUNE.replace("sys.argv[1:4]", repr([str(tiny_model), str(tiny_data), str(tmp_path / "cache")]))
    assert _run(code, "2") == "1 2"


TIMED = """
import sys, tvm
from pathlib import Path
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.runtime.threads import use_threads
from planner.inputs.model import load_model
from planner.measurement import latency
from planner.measurement.local import local_session
from planner.types import Candidate
model_path, cache, short_ms = sys.argv[1:4]
latency.SHORT_STEP_MS = float(short_ms)
model = load_model(model_path)
head = [layer.name for layer in model.layers if layer.weight][-1]
candidate = Candidate(trainable=((head, "full"),), batch_size=1, optimizer="sgd", lr=0.05)
step = compile_candidate(model, candidate, BuildOptions(tvm.target.Target({"kind": "llvm"}), Path(cache)))
asked = []
def set_threads(n):
    asked.append(n)
    use_threads(n)
timed = latency.time_step(local_session(step, model.initializers), 3, "local", repeat_ms=2.0, set_threads=set_threads)
print(*asked, "|", timed.threads, tvm.runtime.num_threads())
"""


@pytest.mark.parametrize("short_ms, asked", [("1e9", ("0 1 0", "0 1 1 0")), ("0", ("0",))])
def test_a_short_step_is_timed_on_one_thread_too_and_the_pool_is_left_whole(tiny_model, tmp_path, short_ms, asked):
    """A step of a few kernels spends more on waking and joining the pool's threads than it
    saves by splitting (and on a 2-vCPU VM was bimodal, 2x apart): under `SHORT_STEP_MS` it is
    tried on one thread as well (timed in full when its first repeat is faster) and keeps the
    faster, saying which; above it, on all. Either way the pool is whole again after the timing."""
    if physical_cores() < 2:
        pytest.skip("one core: nothing to choose")
    code = TIMED.replace("sys.argv[1:4]", repr([str(tiny_model), str(tmp_path / "cache"), short_ms]))
    calls, result = _run(code, "2").split(" | ")
    threads, pool = result.split()
    assert calls in asked and pool == "2"
    assert threads == "0" or calls == "0 1 1 0"  # one thread kept only when timed in full


RUN = """
import json, sys, tvm
from pathlib import Path
import planner
from planner.runtime.session import TrainingSession
plan, data, out, threads = sys.argv[1:5]
path = Path(plan) / "plan.json"
raw = json.loads(path.read_text())
raw["metrics"]["step_latency_ms"]["threads"] = int(threads)
from planner.plans.schema import content_sha256
path.write_text(json.dumps({**raw, "sha256": content_sha256(raw)}))  # a plan re-timed, signed as planner signs
seen, step = set(), TrainingSession.step
def counted(self, x, y):
    seen.add(tvm.runtime.num_threads())
    return step(self, x, y)
TrainingSession.step = counted
planner.run(plan, data=data, steps=3, out=out)
print(*seen, tvm.runtime.num_threads())
"""


def test_planner_run_steps_on_as_many_threads_as_the_plan_was_timed_on(tiny_model, tiny_data, tmp_path):
    """A plan whose step was faster on one thread runs on one thread, or its run would be the
    2-4x slower step the plan chose against (and `planner run`'s check would warn of it); the
    caller's thread has its whole pool again afterwards."""
    if physical_cores() < 2:
        pytest.skip("one core: nothing to choose")
    import planner

    plan = tmp_path / "plan"
    planner.plan(model=tiny_model, data=tiny_data, out=plan, trials=1, accuracy_steps=5)
    for threads, pool in (("1", "1 2"), ("0", "2 2")):
        code = RUN.replace("sys.argv[1:5]", repr([str(plan), str(tiny_data), str(tmp_path / f"ft{threads}"), threads]))
        assert _run(code, "2") == pool
