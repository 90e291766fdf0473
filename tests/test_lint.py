"""The code passes the project's checks (pyproject.toml `[tool.ruff]`, `[tool.mypy]`,
`[tool.importlinter]`, also `.pre-commit-config.yaml`): CI runs the suite, so CI lints, checks
formatting, type-checks and holds the imports to docs/architecture.md's layering."""

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


def test_imports_keep_to_the_layering():
    """Each stage imports only the stages before it, only backend/ and measurement/ import TVM, a
    report loads none, and only search/, plans/ and reports/ import Optuna (the contracts of
    `[tool.importlinter]`; import-linter has no `python -m`)."""
    pytest.importorskip("importlinter", reason="the test extra installs import-linter")
    lint_imports = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    res = subprocess.run([sys.executable, "-c", lint_imports, "--no-cache"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow  # about a minute on 2 cores: mypy reads TVM's and Optuna's sources
def test_the_type_checker_finds_nothing(tmp_path):
    pytest.importorskip("mypy", reason="the test extra installs mypy")
    res = _run("mypy", "--cache-dir", str(tmp_path / "mypy-cache"))
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_package_of_planner_is_in_the_wheel():
    """pyproject.toml lists the wheel's packages (the shipped data is mapped in beside them): a
    package missing from the list installs from a checkout and breaks from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "planner").rglob("__init__.py")}
    assert found - listed == set(), "add them to [tool.setuptools] packages"


def test_every_name_a_benchmark_takes_from_planner_exists():
    """benchmarks/ are scripts no test runs end to end (they take minutes to hours): each name they
    import from planner must still be there, so a moved or renamed function breaks here, not in
    the next person's benchmark run."""
    import ast
    import importlib

    missing = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "planner":
                module = importlib.import_module(node.module)
                missing += [
                    f"{script.name}: {node.module}.{a.name}"
                    for a in node.names
                    if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None
                ]
    assert missing == [], missing
