"""Network addresses as users write them. Standard library only: the board side (`planner board
serve`, on a Raspberry Pi with only TVM's runtime beside planner) imports it too."""

from __future__ import annotations


def parse_host_port(value: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port)."""
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not HOST:PORT: {value!r}")
    return host, int(port)
