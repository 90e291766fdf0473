"""`planner board`: the board side, a TVM RPC tracker and servers (loopback unless told otherwise)."""

from __future__ import annotations

from typing import Annotated

import typer

from planner.cli._app import app
from planner.cli._errors import fail, guard
from planner.cli._output import note

board_app = typer.Typer(
    help="Run the board side: a TVM RPC tracker, and RPC servers that register boards with it. "
    "TVM RPC executes any code it is sent: both bind to 127.0.0.1, and a --host other than "
    "loopback needs --allow-remote. Their TVM worker processes die with them, even on kill -9.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(board_app, name="board")


HostOpt = Annotated[str, typer.Option(help="address to bind")]
PortEndOpt = Annotated[int | None, typer.Option(help="last port to try [default: port+100]")]
AllowRemoteOpt = Annotated[
    bool,
    typer.Option("--allow-remote", help="bind a --host other than loopback: anyone who can reach the port can run code here"),
]


def _checked_bind(host: str, allow_remote: bool) -> None:
    """Refuse (exit 2) or warn about a non-loopback `host`: TVM RPC runs any code it is sent."""
    from planner.errors import BadInput
    from planner.measurement.board import check_bind_host

    try:
        warning = check_bind_host(host, allow_remote)
    except BadInput as exc:
        raise fail(exc, 2) from None
    if warning:
        note(f"warning: {warning}")


@board_app.command("tracker")
def board_tracker(
    host: HostOpt = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port (the next free one up to --port-end is taken)")] = 9190,
    port_end: PortEndOpt = None,
    allow_remote: AllowRemoteOpt = False,
) -> None:
    """Start a TVM RPC tracker and keep it running until Ctrl-C."""
    from planner.measurement.board import start_tracker

    _checked_bind(host, allow_remote)
    tracker = start_tracker(host, port, port_end)
    note(f"tracker listening on {host}:{tracker.port} (Ctrl-C stops it)")
    _wait(tracker.terminate)


@board_app.command("serve")
def board_serve(
    tracker: Annotated[str, typer.Option(help="HOST:PORT of the tracker to register with")],
    key: Annotated[str, typer.Option(help="board key, e.g. raspberry-pi-4 (boards of one kind share it)")],
    host: HostOpt = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port (the next free one up to --port-end is taken)")] = 9090,
    port_end: PortEndOpt = None,
    allow_remote: AllowRemoteOpt = False,
) -> None:
    """Serve this machine as a board: TVM's RPC server, registered under KEY, until Ctrl-C."""
    from planner.inputs.addresses import parse_host_port
    from planner.measurement.board import serve
    from planner.runtime.libraries import PACKAGE, load_openblas

    try:
        addr = parse_host_port(tracker)
    except ValueError as exc:
        raise fail(exc, 2) from None
    _checked_bind(host, allow_remote)
    # checked here, where a wrong OpenBLAS can stop the board with one line, not in its worker
    if guard(load_openblas) is None:
        note(f"no {PACKAGE} here: steps built with `kernels: openblas` (the default) will not load")
    server = serve(addr, key, host, port, port_end)
    note(f"board '{key}' serving on {host}:{server.port}, registered with {tracker} (Ctrl-C stops it)")
    _wait(server.terminate)


def _wait(stop) -> None:
    """Block until Ctrl-C or SIGTERM, then stop the service. Both handlers are installed here, as
    `planner plan` installs its own: a process started where SIGINT is ignored (a script's
    background job) inherits the ignoring, and Python then leaves Ctrl-C without effect."""
    import signal
    import threading

    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        done.wait()
    finally:
        stop()
