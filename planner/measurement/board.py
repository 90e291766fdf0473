"""The board side: a TVM RPC tracker, and TVM's RPC server with planner's memory probes.

`planner board serve` is TVM's own RPC server (a user can equally run
`python -m tvm.exec.rpc_server`) plus three functions registered in every session process, so a
measurement can read the board's real memory use:

- `planner.board.reset_peak()` resets the session process's peak RSS and returns its RSS;
- `planner.board.peak_rss()` returns the peak RSS since then (Linux `VmHWM`);
- `planner.board.rss()` returns the current RSS;
- `planner.board.id()` names the board: `HOST/PID` of the server process.

TVM RPC runs whatever code it is sent: both servers bind to loopback unless told otherwise
(`check_bind_host`), and TVM's worker processes die with the `planner board` process that
started them (`die_with_parent`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import ipaddress
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.errors import BadInput, BoardUnreachable
from planner.runtime.libraries import load_openblas

if TYPE_CHECKING:
    from tvm.support.popen_pool import PopenWorker

RESET_PEAK = "planner.board.reset_peak"
PEAK_RSS = "planner.board.peak_rss"
RSS = "planner.board.rss"
BOARD_ID = "planner.board.id"
HEAP = "planner.board.heap_in_use"  # the C heap in use, -1 where unreadable (`heap_in_use`)
TIMED_INVOKE = "planner.board.timed_invoke"  # (vm module, function) -> seconds of one stateful call, on the board


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


@functools.cache
def _mallinfo2():
    """glibc's `mallinfo2`, or None where the C library has none (musl, macOS, glibc < 2.33)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).mallinfo2 if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.restype = _MallInfo2
    return fn


def heap_in_use() -> int | None:
    """Bytes of the C heap in use now: chunks in use in the main arena plus mmapped chunks (TVM's
    large tensors); None where it cannot be read. A board serves it over RPC (`HEAP`);
    `planner run` checks a plan's memory with it (`selfcheck`)."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks + info.hblkhd)


def _heap() -> int:
    held = heap_in_use()
    return -1 if held is None else held


def _timed_invoke(vm, name: str) -> float:
    start = time.perf_counter()
    vm["invoke_stateful"](name)
    return time.perf_counter() - start


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    return _status_bytes("VmRSS")


def register_memory_probes() -> None:
    """Make the probes callable over RPC (in the server's worker process; its sessions inherit them)."""
    import tvm

    tvm.register_global_func(RESET_PEAK, _reset_peak, override=True)
    tvm.register_global_func(PEAK_RSS, lambda: _status_bytes("VmHWM"), override=True)
    tvm.register_global_func(RSS, lambda: _status_bytes("VmRSS"), override=True)
    tvm.register_global_func(HEAP, _heap, override=True)
    tvm.register_global_func(TIMED_INVOKE, _timed_invoke, override=True)
    # sessions run in a child of the serving process: its pid tells boards on one host apart
    tvm.register_global_func(BOARD_ID, lambda: f"{socket.gethostname()}/{os.getppid()}", override=True)


def check_bind_host(host: str, allow_remote: bool) -> str | None:
    """None if `host` is a loopback address; otherwise the warning to print when `allow_remote`,
    and BadInput without it.

    TVM RPC executes any code it is sent (and the tracker hands boards to anyone who asks), so a
    server others can reach is remote code execution for them: reaching a board from elsewhere
    must be a decision, not a default. Any name but `localhost` counts as remote: it may resolve
    to a public address."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() == "localhost"
    if loopback:
        return None
    if not allow_remote:
        raise BadInput(
            f"`host` {host!r} is not a loopback address, and TVM RPC executes any code it is sent: "
            "a server others can reach is remote code execution for them; bind 127.0.0.1 and tunnel "
            "to it over SSH, or pass `allow_remote` to accept that risk on a trusted private network"
        )
    return (
        f"`allow_remote`: {host!r} is not loopback; anyone who can reach this port can run any "
        "code on this machine through TVM RPC (keep it on a private network or behind an SSH tunnel)"
    )


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux).

    TVM runs the tracker and the RPC server in a child process (`PopenWorker`): a
    `python -m tvm.exec.popen_worker` that serves in a non-daemon thread, so when `planner board`
    is killed (kill -9, the OOM killer) the worker's main thread sees the pipe close and returns,
    and the serving thread keeps the process — and the port — alive. Nothing in Python runs in a
    process killed with SIGKILL, so the kernel has to do it: PR_SET_PDEATHSIG.

    The signal fires when the *thread* that forked this process exits, not the process: the
    worker must be started by a thread that lives as long as the service (the CLI's main
    thread). It is not inherited across fork, so each generation arms its own (`_arm_sessions`).
    The parent may have died before the call; then this process is already an orphan and no
    signal will come, which `getppid()` tells."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


_forking_pid = 0  # set just before each fork, read in the child: its parent's pid


def _note_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _arm_sessions() -> None:
    """Make every process forked from here die with its parent.

    TVM's server forks a process per RPC session (`multiprocessing`, fork start method) from its
    listening thread. The session process holds the client's connection (and a copy of the
    listening socket): orphaned, it keeps running the trial, and the port keeps accepting."""
    os.register_at_fork(before=_note_forking_pid, after_in_child=lambda: die_with_parent(_forking_pid))


def _init_server(parent_pid: int) -> None:
    """`server_init_callback`: TVM calls it in the server's worker process before it binds."""
    die_with_parent(parent_pid)
    _arm_sessions()
    register_memory_probes()
    load_openblas()  # before the sessions fork: the steps they load may need it


@dataclass
class TrackerProcess:
    """A TVM RPC tracker in a worker process: where it listens, and how to stop it."""

    port: int
    worker: PopenWorker

    def terminate(self) -> None:
        """Kill the worker (its sockets close with it). TVM's `Tracker.terminate()` first sends a
        stop message to 127.0.0.1, which is refused when the tracker is bound to another address."""
        self.worker.kill()


def start_tracker(host: str, port: int, port_end: int | None = None) -> TrackerProcess:
    """A TVM RPC tracker in a worker process that dies with this one (`die_with_parent`; call it
    from a thread that outlives the tracker).

    This is `tvm.rpc.tracker.Tracker()` with an initializer for its worker: `Tracker` has no hook
    there, and arming the worker after `Tracker()` returns would leave it serving if this process
    died in between. The initializer runs before the tracker binds."""
    from tvm.rpc.tracker import _popen_start_tracker_server
    from tvm.support.popen_pool import PopenWorker

    worker = PopenWorker(initializer=die_with_parent, initargs=(os.getpid(),))
    worker.send(_popen_start_tracker_server, [host, port, port_end or port + 100, True])
    return TrackerProcess(port=worker.recv()[0], worker=worker)  # recv: (port, stop key)


def serve(tracker: tuple[str, int], key: str, host: str, port: int, port_end: int | None = None):
    """TVM's RPC server registered with `tracker` under `key`; returns the `tvm.rpc.Server`.

    Its worker and every session process die with this process (`_init_server`): call it from a
    thread that outlives the server."""
    from tvm import rpc

    return rpc.Server(
        host,
        port=port,
        port_end=port_end or port + 100,
        tracker_addr=tracker,
        key=key,
        silent=True,
        server_init_callback=functools.partial(_init_server, os.getpid()),
    )


@dataclass(frozen=True)
class KeyStatus:
    total: int
    free: int
    pending: int


def key_status(tracker: tuple[str, int], key: str) -> KeyStatus:
    """How many boards the tracker knows under `key`, and how many are free now."""
    from tvm import rpc

    try:
        socket.create_connection(tracker, timeout=5).close()  # TVM itself retries for a minute
        summary = rpc.connect_tracker(*tracker).summary()
    except (OSError, RuntimeError) as exc:
        raise BoardUnreachable(f"cannot reach the RPC tracker at {tracker[0]}:{tracker[1]}: {exc}") from None
    total = sum(1 for s in summary.get("server_info", []) if s.get("key") == f"server:{key}")
    queue = summary.get("queue_info", {}).get(key, {})
    return KeyStatus(total=total, free=int(queue.get("free", 0)), pending=int(queue.get("pending", 0)))
