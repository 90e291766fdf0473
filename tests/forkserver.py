"""`python -m planner` without its imports each time: a server that imports what the command line
imports once, then forks a child per command (`processes.planner` starts and uses it).

Why: a command's own work in most CLI tests (a bad flag, a missing file, a one-trial plan) takes
well under a second, while importing TVM, ONNX and Optuna takes 2-3 s; the suite runs hundreds
of commands. A forked child is still a process of its own — its own pid, environment, working
directory, exit code and output, its own state from then on — started from an interpreter in
which the modules are already loaded. Nothing else runs in the server before it forks: no
thread of its own, no kernel library, no command.

Protocol, one JSON line each way: a request {"args", "cwd", "env", "stdout", "stderr"} (the two
are files the child writes); replies {"pid"} as the child starts, then {"returncode"} (negative:
the signal that ended it, as `subprocess` says).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path


def _serve() -> None:
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    # what `python -m planner` imports before any command runs (first: it keeps PyTorch out, as the
    # command does), then what its commands import
    # isort: off
    import planner.cli  # noqa: F401
    import planner.api  # noqa: F401
    import planner.search.study  # noqa: F401
    import tvm.relax.frontend.onnx  # noqa: F401
    # isort: on

    # a fork keeps only the forking thread: another Python thread would be lost in the child (the
    # one native thread here, numpy's OpenBLAS pool, stops itself at a fork and restarts after)
    if threading.active_count() != 1:
        raise SystemExit(f"the fork server runs {threading.enumerate()} after its imports; it cannot fork safely")
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _child(request)  # never returns: the child exits as `python -m planner` would
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


def _child(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    import planner

    main_py = str(Path(planner.__file__).with_name("__main__.py"))
    sys.argv = [main_py, *request["args"]]
    sys.modules["__main__"].__package__ = "planner"  # usage lines say `python -m planner`, as they do there
    from planner.cli import main

    main()
    sys.exit(0)  # out of the server's loop: the interpreter ends as the command's would


if __name__ == "__main__":
    _serve()
