"""planner as a process, the way users run it: the command, and boards behind a tracker.

The one place tests start `python -m planner ...`: a command to completion (`planner`), or the
board side (`start`, `kill`, `Boards`) for the tests that measure over TVM RPC.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from builders import free_port
from planner.measurement.board import key_status


def planner(
    *args: str | Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """`planner ARGS` run to completion, output captured; `env` adds to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "planner", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **env} if env else None,
        preexec_fn=preexec_fn,
    )


def start(*args: str) -> subprocess.Popen:
    """A `planner board ...` process in its own process group (so a kill takes its workers too)."""
    return subprocess.Popen(
        [sys.executable, "-m", "planner", "board", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Boards:
    """A tracker and `n` boards under `key`, all on 127.0.0.1, registered before this returns."""

    def __init__(self, key: str, n: int):
        self.key = key
        port = free_port()
        self.tracker = f"127.0.0.1:{port}"
        self.tracker_proc = start("tracker", "--port", str(port), "--port-end", str(port + 1))
        self.servers = [start("serve", "--tracker", self.tracker, "--key", key, "--port", str(free_port())) for _ in range(n)]
        self.wait_for(n)

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if key_status(("127.0.0.1", int(self.tracker.rsplit(":", 1)[1])), self.key).total == n:
                    return
            except Exception:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{n} boards did not register with {self.tracker}")

    def close(self) -> None:
        for proc in [*self.servers, self.tracker_proc]:
            kill(proc)
