"""Boards for real: a TVM tracker and RPC servers on 127.0.0.1, started with `planner board`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import optuna
import pytest

from builders import free_port

from planner import api
from planner.board import key_status
from planner.errors import NoFeasiblePlan
from planner.plan import read_plan
from planner.search import to_record


def start(*args: str) -> subprocess.Popen:
    """A `planner board ...` process in its own process group (so a kill takes its workers too)."""
    return subprocess.Popen(
        [sys.executable, "-m", "planner", "board", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Boards:
    def __init__(self, key: str, n: int):
        self.key = key
        port = free_port()
        self.tracker = f"127.0.0.1:{port}"
        self.tracker_proc = start("tracker", "--port", str(port), "--port-end", str(port + 1))
        self.servers = [start("serve", "--tracker", self.tracker, "--key", key, "--port", str(free_port())) for _ in range(n)]
        self.wait_for(n)

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if key_status(("127.0.0.1", int(self.tracker.rsplit(":", 1)[1])), self.key).total == n:
                    return
            except Exception:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{n} boards did not register with {self.tracker}")

    def close(self) -> None:
        for proc in [*self.servers, self.tracker_proc]:
            kill(proc)


@pytest.fixture(scope="module")
def boards():
    b = Boards("test-board", 2)
    yield b
    b.close()


@pytest.fixture
def doomed_boards():
    """Boards of their own, for a test that kills one."""
    b = Boards("doomed-board", 2)
    yield b
    b.close()


def test_search_measures_on_the_boards_in_parallel(boards, tiny_model, tiny_data, tmp_path):
    result = api.plan(model=tiny_model, data=tiny_data, out=tmp_path / "p", trials=6, accuracy_steps=20,
                      latency_repeats=5, tracker=boards.tracker, key=boards.key)
    assert result.plan.target.device == f"rpc:{boards.key}"
    done = [t for t in result.trials if t.complete]
    assert sum(t.state in ("COMPLETE", "FAIL") for t in result.trials) == 6
    assert all(t.complete or "freezes every layer" in t.fail_reason for t in result.trials)
    assert all(t.latency.device == f"rpc:{boards.key}" for t in done)
    assert len({t.board for t in done}) == 2, "both boards should have measured candidates"
    # the board reports its own memory use through planner's probes
    assert all(t.board_memory["peak_rss_growth_bytes"] > 0 for t in done)
    assert "host" in result.plan.measurement["accuracy"]


def test_a_killed_board_costs_at_most_its_in_flight_trial(doomed_boards, tiny_model, tiny_data, tmp_path):
    boards = doomed_boards
    killed = threading.Event()

    def on_trial(rec, done, total):
        if done == 1 and not killed.is_set():
            kill(boards.servers[0])
            killed.set()

    result = api.plan(model=tiny_model, data=tiny_data, out=tmp_path / "p", trials=6, accuracy_steps=20,
                      latency_repeats=5, tracker=boards.tracker, key=boards.key, on_trial=on_trial)
    assert killed.is_set()
    finished = [t for t in result.trials if t.state in ("COMPLETE", "FAIL")]
    failed = [t for t in finished if t.state == "FAIL"]
    assert len(finished) == 6
    assert len(failed) <= 1, [t.fail_reason for t in failed]
    assert all("board lost" in t.fail_reason for t in failed)


def test_session_timeout_is_a_board_lost_trial_not_a_dead_study(boards, tiny_model, tiny_data, tmp_path):
    target = tmp_path / "slow.yaml"
    target.write_text(
        "tvm_target: {kind: llvm}\nram_budget_bytes: 1GiB\nrunner: rpc\n"
        f"rpc: {{tracker: '{boards.tracker}', key: {boards.key}, session_timeout_s: 0.05}}\n"
    )
    with pytest.raises(NoFeasiblePlan):
        api.plan(model=tiny_model, data=tiny_data, target=str(target), out=tmp_path / "p", trials=2, accuracy_steps=5)
    study = optuna.load_study(study_name="planner", storage=f"sqlite:///{tmp_path / 'p' / 'study.db'}")
    trials = [to_record(t) for t in study.trials]
    assert [t.state for t in trials] == ["FAIL", "FAIL"]
    assert all(t.fail_reason.startswith("board lost") for t in trials)


def test_run_over_rpc_equals_a_local_run(boards, tiny_model, tiny_data, tmp_path):
    api.plan(model=tiny_model, data=tiny_data, out=tmp_path / "p", trials=2, accuracy_steps=10, latency_repeats=3)
    local = api.run_plan(tmp_path / "p", steps=40, out=tmp_path / "local", shuffle=False)
    remote = api.run_plan(tmp_path / "p", steps=40, out=tmp_path / "remote", shuffle=False, tracker=boards.tracker, key=boards.key)
    assert remote.device == f"rpc:{boards.key}" and local.device == "local"
    with np.load(tmp_path / "local" / "weights.npz") as a, np.load(tmp_path / "remote" / "weights.npz") as b:
        for k in a.files:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-5)
    assert remote.after["loss"] == pytest.approx(local.after["loss"], abs=1e-5)


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None, reason="needs g++-aarch64-linux-gnu (.ci/run installs it)")
def test_compile_emits_an_aarch64_library_for_raspberry_pi_4(tiny_model, tiny_data, tmp_path):
    api.plan(model=tiny_model, data=tiny_data, out=tmp_path / "p", trials=1, accuracy_steps=5, latency_repeats=3)
    res = subprocess.run([sys.executable, "-m", "planner", "compile", str(tmp_path / "p"), "--target", "raspberry-pi-4",
                          "--out", str(tmp_path / "pi")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    elf = (tmp_path / "pi" / "train_step.so").read_bytes()[:20]
    assert elf[:4] == b"\x7fELF" and elf[4] == 2  # 64-bit
    assert int.from_bytes(elf[18:20], "little") == 183  # e_machine EM_AARCH64
    plan = read_plan(tmp_path / "pi")
    assert plan.target.name == "raspberry-pi-4" and plan.target.device == "rpc:raspberry-pi-4"


def _planner(*args):
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, timeout=300)


# An unreachable tracker and a tracker without boards of the key: tests/test_cli_errors.py (exit 3).


def test_targets_check_counts_the_boards_of_the_key(boards):
    check = _planner("targets", "check", "host", "--tracker", boards.tracker, "--key", boards.key, "--json")
    assert check.returncode == 0, check.stderr
    assert "2 under key" in check.stdout
