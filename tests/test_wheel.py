"""planner as users install it: a wheel, in a fresh virtual environment, run from another directory.

An editable install in the checkout finds the shipped targets, spaces and the bundled example at
the top of the repository; a wheel must carry them. The fresh venv gets the wheel without its
dependencies and borrows them from this environment (a `.pth` line), so the test costs a build,
not a download: the planner it runs is the wheel's, never this checkout's.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds the wheel and installs it into a fresh venv

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The `bin/` of a fresh venv holding planner's wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    build = None
    for isolation in (["--no-build-isolation"], []):  # this environment's setuptools, else pip brings one
        build = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp / "dist"), str(ROOT)],
            capture_output=True,
            text=True,
        )
        if build.returncode == 0:
            break
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp / "dist").glob("planner-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    bin_dir = env_dir / "bin"
    (purelib,) = (env_dir / "lib").glob("python3*/site-packages")
    # the dependencies, from this environment's site-packages (never its planner: an editable
    # install's finder lives in a .pth that is not processed from a path added this way)
    (purelib / "borrowed-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(purelib), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    script = bin_dir / "planner"
    script.write_text(f"#!{bin_dir / 'python'}\nfrom planner.cli import main\nmain()\n")
    script.chmod(0o755)
    return bin_dir


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_the_wheel_carries_targets_spaces_and_the_example_and_plans_from_anywhere(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    python, planner = installed / "python", installed / "planner"
    where = _run(python, "-c", "import planner, sys; print(planner.__file__); print('tvm' in sys.modules)", cwd=elsewhere)
    assert where.returncode == 0, where.stderr
    module, tvm_loaded = where.stdout.split()
    assert not Path(module).is_relative_to(ROOT), f"the checkout's planner ran, not the wheel's: {module}"
    assert tvm_loaded == "False", "importing planner must not import TVM"

    # the emulated board's start-up, semihosting server and sgemm: package data a firmware links
    runtime = _run(
        python,
        "-c",
        "from planner.backend.mcu._firmware import RUNTIME; print(sorted(p.name for p in RUNTIME.iterdir()))",
        cwd=elsewhere,
    )
    assert runtime.returncode == 0, runtime.stderr
    assert runtime.stdout.strip() == str(sorted(p.name for p in (ROOT / "planner" / "backend" / "mcu" / "runtime").iterdir()))
    assert "dwconv.c" in runtime.stdout and "sgemm.c" in runtime.stdout

    targets = _run(planner, "targets", "list", "--json", cwd=elsewhere)
    assert targets.returncode == 0, targets.stderr
    shipped = {p.stem for p in (ROOT / "hw_targets").glob("*.yaml")}
    assert {t["name"] for t in json.loads(targets.stdout)} == shipped

    out = elsewhere / "plan"
    res = _run(
        planner, "plan", "--trials", "2", "--accuracy-steps", "10", "--space", "bias-only", "--out", out, "--json", cwd=elsewhere
    )
    assert res.returncode in (0, 4), res.stderr  # a plan written (4: it learned nothing in ten steps)
    plan = json.loads(res.stdout)
    assert Path(plan["model"]["path"]).parent.parent.name == "examples"  # the bundled example, from the wheel
    assert not Path(plan["model"]["path"]).is_relative_to(ROOT)
    run = _run(planner, "run", out, "--steps", "5", cwd=elsewhere)
    assert run.returncode == 0, run.stderr
