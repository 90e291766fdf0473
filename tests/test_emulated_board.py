"""A cross-compiled plan trains on AArch64: an emulated Raspberry Pi (qemu-user) serving TVM RPC.

The board is built by tests/emulated_board/build.sh (.ci/run does it); without it these tests skip.
Timings under emulation mean nothing; what is checked is that the AArch64 build really runs there
and trains exactly like the host build.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from builders import free_port
from planner import api
from planner.measurement.board import key_status
from planner.plans.directory import read_plan
from processes import kill, start

EMU = Path(os.environ.get("PLANNER_EMU_DIR", Path.home() / ".cache" / "planner" / "aarch64-board"))
REPO = Path(__file__).resolve().parent.parent
KEY = "pi-emulated"

pytestmark = [
    pytest.mark.slow,  # TVM imported and a step trained under qemu: minutes
    pytest.mark.skipif(
        not (EMU / "ready").is_file() or not Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists(),
        reason=f"no emulated AArch64 board in {EMU} (build it with tests/emulated_board/build.sh, as root)",
    ),
]


def _board_env(cpu: str | None) -> dict[str, str]:
    """The board's environment: this one's, less what belongs to this machine's CPU. The board is
    another machine: an x86 OpenBLAS setting (`OPENBLAS_CORETYPE=Haswell`, set on some hosts)
    would choose the AArch64 OpenBLAS's kernels too, not the board's CPU (`cpu`, QEMU's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBLAS_") and k != "QEMU_CPU"}
    env |= {"QEMU_LD_PREFIX": str(EMU / "root"), "PYTHONPATH": f"{EMU / 'site'}:{REPO}"}
    return env | ({"QEMU_CPU": cpu} if cpu else {})


@pytest.fixture(scope="module")
def pi():
    port = free_port()
    tracker = f"127.0.0.1:{port}"
    tracker_proc = start("tracker", "--port", str(port), "--port-end", str(port + 1))
    board = subprocess.Popen(
        [
            str(EMU / "root/usr/bin/python3.11"),
            "-m",
            "planner",
            "board",
            "serve",
            "--tracker",
            tracker,
            "--key",
            KEY,
            "--port",
            str(free_port()),
        ],
        env=_board_env("cortex-a72"),  # a Raspberry Pi 4's CPU: OpenBLAS picks its Cortex-A kernels
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300  # importing TVM under emulation takes a while
    while time.time() < deadline:
        try:
            if key_status(("127.0.0.1", port), KEY).total == 1:
                break
        except Exception:
            pass
        time.sleep(1)
    else:
        kill(board)
        kill(tracker_proc)
        pytest.fail("the emulated board did not register with the tracker")
    yield tracker
    kill(board)
    kill(tracker_proc)


def test_plan_for_raspberry_pi_4_is_measured_on_aarch64(pi, tiny_model, tiny_data, tmp_path):
    result = api.plan(
        model=tiny_model,
        data=tiny_data,
        target="raspberry-pi-4",
        out=tmp_path / "p",
        trials=2,
        accuracy_steps=10,
        latency_repeats=3,
        tracker=pi,
        key=KEY,
    )
    assert result.plan.target.device == f"rpc:{KEY}"
    assert all(t.complete for t in result.trials), [t.fail_reason for t in result.trials]
    elf = (tmp_path / "p" / "train_step.so").read_bytes()[:20]
    assert int.from_bytes(elf[18:20], "little") == 183  # EM_AARCH64


def test_cross_compiled_step_trains_like_the_host_build(pi, tiny_model, tiny_data, tmp_path):
    api.plan(model=tiny_model, data=tiny_data, out=tmp_path / "host", trials=1, accuracy_steps=5, latency_repeats=3)
    api.compile(tmp_path / "host", target="raspberry-pi-4", out=tmp_path / "pi")
    assert read_plan(tmp_path / "pi").target.toolchain == "aarch64-linux-gnu-g++"
    local = api.run(tmp_path / "host", steps=15, out=tmp_path / "local", shuffle=False)
    remote = api.run(tmp_path / "pi", steps=15, out=tmp_path / "arm", shuffle=False, target="raspberry-pi-4", tracker=pi, key=KEY)
    assert remote.device == f"rpc:{KEY}"
    with np.load(tmp_path / "local" / "weights.npz") as a, np.load(tmp_path / "arm" / "weights.npz") as b:
        for k in a.files:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-5)
    assert remote.after["accuracy"] == local.after["accuracy"]


def test_a_board_whose_openblas_computes_wrong_refuses_to_serve():
    """qemu's default CPU has SME, where this OpenBLAS's kernels compute small products wrong:
    the board stops with one line saying so (and the fix), before any step can train wrong."""
    proc = subprocess.run(
        [str(EMU / "root/usr/bin/python3.11"), "-m", "planner", "board", "serve", "--tracker", "127.0.0.1:9", "--key", "k"],
        env=_board_env(None),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "OpenBLAS's sgemm computes wrong results on this CPU" in proc.stderr
    assert "OPENBLAS_CORETYPE" in proc.stderr and "Traceback" not in proc.stderr
