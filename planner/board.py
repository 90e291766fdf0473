"""The board side: a TVM RPC tracker, and TVM's RPC server with planner's memory probes.

`planner board serve` is TVM's own RPC server (a user can equally run
`python -m tvm.exec.rpc_server`) plus three functions registered in every session process, so a
measurement can read the board's real memory use:

- `planner.board.reset_peak()` resets the session process's peak RSS and returns its RSS;
- `planner.board.peak_rss()` returns the peak RSS since then (Linux `VmHWM`);
- `planner.board.rss()` returns the current RSS;
- `planner.board.id()` names the board: `HOST/PID` of the server process.

TVM RPC runs whatever code it is sent: both servers bind to loopback unless told otherwise.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from .errors import BoardUnreachable

RESET_PEAK = "planner.board.reset_peak"
PEAK_RSS = "planner.board.peak_rss"
RSS = "planner.board.rss"
BOARD_ID = "planner.board.id"


def parse_host_port(value: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port)."""
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not HOST:PORT: {value!r}")
    return host, int(port)


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
    """Server init callback: make the probes callable over RPC (runs in the server process)."""
    import tvm

    tvm.register_global_func(RESET_PEAK, _reset_peak, override=True)
    tvm.register_global_func(PEAK_RSS, lambda: _status_bytes("VmHWM"), override=True)
    tvm.register_global_func(RSS, lambda: _status_bytes("VmRSS"), override=True)
    # sessions run in a child of the serving process: its pid tells boards on one host apart
    tvm.register_global_func(BOARD_ID, lambda: f"{socket.gethostname()}/{os.getppid()}", override=True)


def start_tracker(host: str, port: int, port_end: int | None = None):
    """A TVM RPC tracker (in a worker process); returns the `tvm.rpc.tracker.Tracker`."""
    from tvm.rpc.tracker import Tracker

    return Tracker(host, port=port, port_end=port_end or port + 100, silent=True)


def serve(tracker: tuple[str, int], key: str, host: str, port: int, port_end: int | None = None):
    """TVM's RPC server registered with `tracker` under `key`; returns the `tvm.rpc.Server`."""
    from tvm import rpc

    return rpc.Server(
        host, port=port, port_end=port_end or port + 100, tracker_addr=tracker, key=key, silent=True,
        server_init_callback=register_memory_probes,
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
