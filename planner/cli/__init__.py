"""The command line: a thin shell over the public API (`planner.api`)."""

from planner.cli.app import main

__all__ = ["main"]
