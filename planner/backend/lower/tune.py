"""Kernel tuning with MetaSchedule, in one database per target shared by every candidate and plan.

Candidates of one model share most of their kernels (the forward pass, the backward of the last
layers), and MetaSchedule keys a workload by its structure (here: its anchor block), so what one
candidate's tuning finds serves every later candidate, plan and run with the same kernel. The database lives in the
compile cache (`tuning/<target hash>/`); a lock file serialises writers across processes.

Tuning is opt-in (`--tune-trials N`): on this 2-core host MetaSchedule needs about 3-7 s per
trial, and a training step has tens of kernels. Kernels without a record keep planner's default
schedule (`planner.backend.lower.schedule`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib
import importlib.util
import inspect
import linecache
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import tvm
from tvm import relax
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.analysis import estimate_tir_flops

from planner.backend.lower.link import linker
from planner.inputs.targets import RpcRunner
from planner.runtime.convention import STEP_FUNC
from planner.runtime.threads import claim_cores


def _with_cores(target: tvm.target.Target) -> tvm.target.Target:
    """MetaSchedule needs the core count; a target that does not say is this machine."""
    if "num-cores" in target.attrs:
        return target
    return tvm.target.Target({**target.export(), "num-cores": os.cpu_count() or 1})


def database_dir(cache_dir: Path, target: tvm.target.Target) -> Path:
    return cache_dir / "tuning" / hashlib.sha256(str(target).encode()).hexdigest()[:16]


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _database(directory: Path) -> ms.database.JSONDatabase:
    return ms.database.JSONDatabase(work_dir=str(directory), module_equality=EQUALITY)


# Kernels match by their anchor block (the convolution or matmul), not their whole body: a weight
# gradient fused with its update carries the learning rate as a constant, and every candidate of a
# study has another one — whole-body keys would make every record a miss.
EQUALITY = "anchor-block"
TRIALS_PER_KERNEL = 32  # enough for MetaSchedule's evolutionary search to beat the default schedule


MS_LOGGER = "tvm.s_tir.meta_schedule"


@contextmanager
def _own_handlers_only(logger: logging.Logger) -> Iterator[None]:
    """MetaSchedule rebuilds its logging with `dictConfig`, listing the handlers its logger has by
    name, and fails on any it did not create itself (pytest's capture handlers, an application's
    own): those step aside while it does."""
    foreign = [h for h in logger.handlers if not (h.get_name() or "").startswith(MS_LOGGER)]
    for handler in foreign:
        logger.removeHandler(handler)
    try:
        yield
    finally:
        for handler in foreign:
            logger.addHandler(handler)


def _export(toolchain: str | None, mod: tvm.runtime.Module) -> str:
    """A candidate kernel as a shared library linked here (with the board's cross compiler), so
    the board needs no compiler of its own (MetaSchedule's default ships object files in a tar)."""
    path = Path(tempfile.mkdtemp(prefix="planner-tune-")) / "kernel.so"
    mod.export_library(str(path), fcompile=linker(toolchain))
    return str(path)


INTRINSICS = "tvm.s_tir.tensor_intrin"
_INSPECT_STACK = inspect.stack


def _stack(context: int = 1) -> list[inspect.FrameInfo]:
    """`inspect.stack()` for TVMScript's parser, which reads each frame's locals and, of one frame,
    its line: the same frames and lines, without `inspect`'s module lookup per frame."""
    if context > 1:
        return _INSPECT_STACK(context)[1:]
    frames = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        line = linecache.getline(code.co_filename, frame.f_lineno, frame.f_globals) if context else ""
        frames.append(
            inspect.FrameInfo(
                frame, code.co_filename, frame.f_lineno, code.co_name, [line] if line else None, 0 if line else None
            )
        )
        frame = frame.f_back
    return frames


def import_intrinsics() -> None:
    """Import TVM's tensor intrinsics, which MetaSchedule needs in every process that tunes or
    builds a candidate kernel.

    Why here and not by MetaSchedule: its hundreds of TVMScript functions each call
    `inspect.stack()`, which looks up the module of every frame by scanning `sys.modules` (the
    import machinery's frozen frames never hit its cache): 55 s in a bare process on this 2-core
    host, about 90 s deep in a test run, and again in every builder process, whose pool MetaSchedule
    restarts each round. With `_stack` it takes about 6 s; the parser sees the same frames."""
    if INTRINSICS in sys.modules:
        return
    inspect.stack = _stack
    try:
        importlib.import_module(INTRINSICS)
    finally:
        inspect.stack = _INSPECT_STACK


# The builder's processes import the intrinsics (`import_intrinsics`, a few seconds) before their
# first build; a loaded 2-core host may need more than the default 30 s.
BUILD_TIMEOUT_S = 180.0


def _measurers(rpc: RpcRunner | None, toolchain: str | None) -> tuple[object, object]:
    """MetaSchedule's builder and runner: on this machine, or — for a target behind a tracker —
    candidate kernels built here and timed on a board of the target's key."""
    if rpc is None:
        claim_cores()  # the runner's processes inherit it: kernels timed on pools the size a step's are
        return ms.builder.LocalBuilder(timeout_sec=BUILD_TIMEOUT_S, initializer=import_intrinsics), "local"
    host, port = rpc.address
    config = ms.runner.RPCConfig(
        tracker_host=host,
        tracker_port=port,
        tracker_key=rpc.key,
        session_priority=rpc.priority,
        session_timeout_sec=rpc.session_timeout_s,
    )
    builder = ms.builder.LocalBuilder(
        f_export=functools.partial(_export, toolchain), timeout_sec=BUILD_TIMEOUT_S, initializer=import_intrinsics
    )
    return builder, ms.runner.RPCRunner(config)


def _written_scheduled(mod: tvm.IRModule) -> bool:
    """Whether `mod`'s kernel was written scheduled (`tirx.is_scheduled` before any schedule ran:
    the OpenBLAS kernels, the softmax by rows)."""
    return any(
        isinstance(f, tvm.tirx.PrimFunc) and bool((f.attrs or {}).get("tirx.is_scheduled")) for _, f in mod.functions_items()
    )


def tune(
    fused: tvm.IRModule,
    target: tvm.target.Target,
    trials: int,
    directory: Path,
    rpc: RpcRunner | None = None,
    toolchain: str | None = None,
) -> int:
    """Spend up to `trials` MetaSchedule trials on the step's kernels (`fused`, after
    FuseOps/FuseTIR) that the shared database has never seen, heaviest first; returns how many
    kernels were tuned.

    Why heaviest first, `TRIALS_PER_KERNEL` each: a step's time sits in a few convolutions and
    their gradients, and a handful of trials per kernel spread over all of them (MetaSchedule's
    own round-robin) beats the default schedule nowhere. Kernels tuned before, for any candidate,
    cost nothing again, so the kernels a small budget leaves out are tuned by later compiles, and
    with a warm database a step compiles at the speed of an untuned one. Only the step's kernels
    are tuned: the predict function serves accuracy evaluation on the host. The cost model is
    XGBoost when installed (`pip install -e '.[tune]'`), guiding an evolutionary search; else
    schedules are sampled at random (`replay-trace`). With `rpc`, each
    candidate schedule is timed on a board behind the tracker (built here with `toolchain`).
    """
    cost_model = "xgb" if importlib.util.find_spec("xgboost") else "random"
    target = _with_cores(target)
    import_intrinsics()
    step_only = relax.transform.DeadCodeElimination([STEP_FUNC])(fused)
    with _locked(directory), tempfile.TemporaryDirectory(prefix="planner-tune-") as logs:
        logging.getLogger(MS_LOGGER).setLevel(logging.WARNING)
        database = _database(directory)
        new = [
            task
            for task in ms.relax_integration.extract_tasks(step_only, target, module_equality=EQUALITY)
            # planner's own kernels are written scheduled: a library kernel's work is a call
            # MetaSchedule cannot schedule, and the softmax by rows has no blocks to schedule
            if not database.has_workload(task.dispatched[0]) and not _written_scheduled(task.dispatched[0])
        ]
        new.sort(key=lambda task: -estimate_tir_flops(task.dispatched[0]) * task.weight)
        new = new[: max(1, trials // TRIALS_PER_KERNEL)]
        if not new:
            return 0
        with _own_handlers_only(logging.getLogger(MS_LOGGER)):
            # without a cost model to rank them, an evolutionary search's population (hundreds of
            # schedules sampled and mutated per kernel) buys nothing over sampling the trials alone
            strategy = "evolutionary" if cost_model == "xgb" else "replay-trace"
            contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(new, work_dir=logs, strategy=strategy)
        builder, runner = _measurers(rpc, toolchain)
        ms.tune.tune_tasks(
            tasks=contexts,
            task_weights=weights,
            work_dir=logs,
            max_trials_global=trials,
            max_trials_per_task=max(TRIALS_PER_KERNEL, trials // len(new)),
            num_trials_per_iter=min(16, trials),
            database=database,
            cost_model=cost_model,
            module_equality=EQUALITY,
            builder=builder,
            runner=runner,
        )
        return len(new)


def apply(fused: tvm.IRModule, target: tvm.target.Target, directory: Path) -> tuple[tvm.IRModule, tuple[str, ...]]:
    """`fused` with every kernel the database has a record for scheduled by its best record;
    returns the module and the names of the kernels that got one."""
    if not (directory / "database_tuning_record.json").is_file():
        return fused, ()
    with _locked(directory), _with_cores(target), _database(directory):
        scheduled = relax.transform.MetaScheduleApplyDatabase()(fused)
    tuned = tuple(
        sorted(
            gv.name_hint
            for gv, func in scheduled.functions_items()
            if isinstance(func, tvm.tirx.PrimFunc) and not func.same_as(fused[gv.name_hint])
        )
    )
    return scheduled, tuned
