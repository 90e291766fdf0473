"""Where the files planner ships live: the targets, the search spaces and the bundled example.

In a checkout (and an editable install of it) they sit at the top of the repository, where users
look for them and edit them; a wheel carries the same files inside the package, as
`planner/_data/` (see pyproject.toml), so an installed planner finds them wherever it runs.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # planner/


def shipped(name: str) -> Path:
    """The shipped directory `name` (`hw_targets`, `search_spaces`, `examples/digits`)."""
    installed = _PACKAGE / "_data" / name
    return installed if installed.is_dir() else _PACKAGE.parent / name
