"""The code passes the project's checks (pyproject.toml `[tool.ruff]`, `[tool.mypy]`, also
`.pre-commit-config.yaml`): CI runs the suite, so CI lints, checks formatting and type-checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT)


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="the test extra installs ruff")
    res = _run("ruff", "check", "--no-cache", str(ROOT))
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_code_is_formatted():
    pytest.importorskip("ruff", reason="the test extra installs ruff")
    res = _run("ruff", "format", "--check", "--no-cache", str(ROOT))
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow  # about a minute on 2 cores: mypy reads TVM's and Optuna's sources
def test_the_type_checker_finds_nothing(tmp_path):
    pytest.importorskip("mypy", reason="the test extra installs mypy")
    res = _run("mypy", "--cache-dir", str(tmp_path / "mypy-cache"))
    assert res.returncode == 0, res.stdout + res.stderr
