"""The code passes the project's lint (pyproject.toml `[tool.ruff]`): CI runs the suite, so CI lints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="the test extra installs ruff")
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 0, res.stdout + res.stderr
