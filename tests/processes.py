"""planner as a process, the way users run it: the command, and boards behind a tracker.

The one place tests start `python -m planner ...`: a command to completion (`planner`), or the
board side (`start`, `kill`, `Boards`) for the tests that measure over TVM RPC.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from builders import free_port
from planner.measurement.board import key_status

# the exit codes of a `planner plan` that wrote its plan: 0, or 4 when the plan learned nothing
# (a test's few fine-tuning steps on a tiny model may not beat its start; README's exit codes)
PLANNED = (0, 4)


def planner(
    *args: str | Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """`planner ARGS` run to completion, output captured; `env` adds to this process's environment.

    A child of this test process's fork server (`forkserver.py`: the imports done once), or, for a
    `preexec_fn` (which must run in a child of this process) or while the server is busy, a fresh
    `python -m planner`."""
    command = [sys.executable, "-m", "planner", *map(str, args)]
    full_env = {**os.environ, **env} if env else dict(os.environ)
    if preexec_fn is None and _FORKS.lock.acquire(blocking=False):
        try:
            return _FORKS.run(command, [str(a) for a in args], Path(cwd or os.getcwd()), full_env, timeout)
        finally:
            _FORKS.lock.release()
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env, preexec_fn=preexec_fn)


class _ForkServer:
    """This process's `forkserver.py`, started on first use and stopped with the process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="planner-forks-"))
        self._pending = b""
        atexit.register(shutil.rmtree, self._dir, True)

    def _server(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._pending = b""
            with (self._dir / "server.err").open("wb") as log:
                self._proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name("forkserver.py"))],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    bufsize=0,
                    cwd=self._dir,
                )
            atexit.register(self._proc.kill)
            self._reply(120)  # {"ready": pid}, once its imports are done
            self._preamble = (self._dir / "server.err").read_text()  # what they printed, as each command would
        return self._proc

    def _reply(self, timeout: float) -> dict:
        """The server's next line; TimeoutError when it says nothing for `timeout` seconds."""
        assert self._proc is not None and self._proc.stdout is not None
        fd, deadline = self._proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._pending:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                err = (self._dir / "server.err").read_text()[-3000:]
                raise RuntimeError(f"the fork server stopped: {err}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, command: list[str], args: list[str], cwd: Path, env: dict[str, str], timeout: float):
        proc = self._server()
        out, err = self._dir / "stdout", self._dir / "stderr"
        request = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        pid = self._reply(60)["pid"]
        try:
            returncode = self._reply(timeout)["returncode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._reply(60)
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text()) from None
        return subprocess.CompletedProcess(command, returncode, out.read_text(), self._preamble + err.read_text())


_FORKS = _ForkServer()


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
