"""How many threads a step runs on in this process, and the calling thread's share of them.

TVM sizes each thread's pool from TVM_NUM_THREADS, else from the hardware threads, halved on x86
on the assumption of two per core. On a machine without SMT (many cloud VMs and
edge x86 boxes) every step then ran on half the cores, while its kernels are split for all of
them (`gemm.pool_threads`), and plans reported that half's latency. planner sets TVM_NUM_THREADS,
where the user has not, to the physical cores this process may use, before any pool exists:
where planner first runs kernels — a step's session made, a thread's share set (`use_threads`),
MetaSchedule's local runner started (its processes inherit the variable) — not on import, so a
process that only imports planner keeps its environment as it was.

Pools are per thread: `use_threads` changes the calling thread's, so a search's fine-tune can
step on one core while a compile runs beside it and on all of them once it is alone. TVM's pool
threads spin while they wait for each other: two pools sharing the cores with a compile ran a
batch-1 fine-tune 2-10x slower than one thread did.
"""

from __future__ import annotations

import os
from pathlib import Path

import tvm_ffi

ENV = "TVM_NUM_THREADS"


def physical_cores() -> int:
    """Cores (not hardware threads) of the CPUs this process may run on; all of them where the
    topology cannot be read."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1
    cores = set()
    for cpu in allowed:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return len(allowed)
    return max(1, len(cores))


def claim_cores() -> None:
    """Every thread's pool as large as the physical cores, unless TVM_NUM_THREADS says otherwise
    (pools that exist already keep their size); after the first call, nothing to do."""
    if ENV not in os.environ:
        os.environ[ENV] = str(physical_cores())


def use_threads(n: int) -> None:
    """The calling thread's steps run on `n` of its pool's threads from now on (0: all of them).

    TVM also pins the calling thread to one core when it is left one thread, and threads started
    from it later inherit that: a search's compile and fine-tune would then share one core. The
    thread keeps the cores it had."""
    claim_cores()  # the call below makes the thread's pool, if it has none yet
    try:
        cpus = os.sched_getaffinity(0)  # (0: the calling thread)
    except AttributeError:  # (not Linux)
        cpus = None
    tvm_ffi.get_global_func("runtime.config_threadpool")(1, n)  # 1: TVM's default mode (its "big" cores)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
