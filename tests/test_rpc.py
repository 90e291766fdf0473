"""Boards for real: a TVM tracker and RPC servers on 127.0.0.1, started with `planner board`."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import optuna
import psutil
import pytest

from builders import free_port, token_bag
from planner import api
from planner.errors import BadInput, BoardLost, BoardUnreachable, NoFeasiblePlan
from planner.inputs.addresses import parse_host_port
from planner.measurement.board import RSS, check_bind_host, key_status
from planner.plans.directory import read_plan
from planner.search._attrs import record_of
from processes import Boards, kill, planner, start

pytestmark = pytest.mark.slow  # trackers and boards on 127.0.0.1, boards killed mid-study: minutes


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
    result = api.plan(
        model=tiny_model,
        data=tiny_data,
        out=tmp_path / "p",
        trials=6,
        accuracy_steps=20,
        latency_repeats=5,
        tracker=boards.tracker,
        key=boards.key,
    )
    assert result.plan.target.device == f"rpc:{boards.key}"
    done = [t for t in result.trials if t.complete]
    assert sum(t.state in ("COMPLETE", "FAIL") for t in result.trials) == 6
    assert all(t.complete or "freezes every layer" in t.fail_reason for t in result.trials)
    assert all(t.latency.device == f"rpc:{boards.key}" for t in done)
    assert len({t.board for t in done}) == 2, "both boards should have measured candidates"
    # the board reports its own memory use through planner's probes
    assert all(t.board_memory["peak_rss_growth_bytes"] > 0 for t in done)
    assert "host" in result.plan.measurement.accuracy


def test_a_killed_board_costs_at_most_its_in_flight_trial(doomed_boards, tiny_model, tiny_data, tmp_path):
    boards = doomed_boards
    killed = threading.Event()

    def on_trial(rec, done, total):
        if done == 1 and not killed.is_set():
            kill(boards.servers[0])
            killed.set()

    result = api.plan(
        model=tiny_model,
        data=tiny_data,
        out=tmp_path / "p",
        trials=6,
        accuracy_steps=20,
        latency_repeats=5,
        tracker=boards.tracker,
        key=boards.key,
        on_trial=on_trial,
    )
    assert killed.is_set()
    finished = [t for t in result.trials if t.state in ("COMPLETE", "FAIL")]
    # the trial in flight on the killed board is retried on the other one: nothing fails for it
    assert len(finished) == 6
    assert all(t.complete or "freezes every layer" in t.fail_reason for t in finished), [t.fail_reason for t in finished]


def test_losing_every_board_stops_exit_3_and_the_rerun_measures_exactly_the_missing_trials(tiny_model, tiny_data, tmp_path):
    """The only board dies mid-study: that is the environment's failure, not the candidates'. The
    trial it took is queued again, the study stops (exit 3), and once a board is back the same
    command measures exactly the missing trials."""
    boards = Boards("lone-board", 1)
    try:
        killed = threading.Event()

        def on_trial(rec, done, total):
            if done == 1 and not killed.is_set():
                kill(boards.servers[0])
                killed.set()

        kwargs = dict(
            model=tiny_model,
            data=tiny_data,
            out=tmp_path / "p",
            storage=api.default_storage(tmp_path / "p"),
            trials=4,
            accuracy_steps=20,
            latency_repeats=3,
            tracker=boards.tracker,
            key=boards.key,
        )
        with pytest.raises(BoardLost) as lost:
            api.plan(**kwargs, on_trial=on_trial)
        assert lost.value.exit_code == 3 and "rerun the same command" in str(lost.value)
        study = optuna.load_study(study_name="planner", storage=f"sqlite:///{tmp_path / 'p' / 'study.db'}")
        trials = [record_of(t) for t in study.trials]
        assert [t.state for t in trials].count("COMPLETE") + [t.state for t in trials].count("FAIL") == 1
        cut = [t for t in trials if t.state == "PRUNED"]
        assert len(cut) == 1 and cut[0].fail_reason.startswith("environment: ")
        boards.servers.append(start("serve", "--tracker", boards.tracker, "--key", boards.key, "--port", str(free_port())))
        boards.wait_for(1)
        result = api.plan(**kwargs)
        assert sum(t.state in ("COMPLETE", "FAIL") for t in result.trials) == 4
        again = [
            t
            for t in optuna.load_study(study_name="planner", storage=f"sqlite:///{tmp_path / 'p' / 'study.db'}").trials
            if t.user_attrs.get("requeued_from") == cut[0].number
        ]
        assert len(again) == 1 and again[0].state == optuna.trial.TrialState.COMPLETE
    finally:
        boards.close()


def test_a_session_timeout_is_a_failed_trial_not_a_dead_study(boards, tiny_model, tiny_data, tmp_path):
    target = tmp_path / "slow.yaml"
    target.write_text(
        "tvm_target: {kind: llvm}\nram_budget_bytes: 1GiB\nrunner: rpc\n"
        f"rpc: {{tracker: '{boards.tracker}', key: {boards.key}, session_timeout_s: 0.05}}\n"
    )
    with pytest.raises(NoFeasiblePlan):
        api.plan(
            model=tiny_model,
            data=tiny_data,
            target=str(target),
            out=tmp_path / "p",
            storage=api.default_storage(tmp_path / "p"),
            trials=2,
            accuracy_steps=5,
        )
    study = optuna.load_study(study_name="planner", storage=f"sqlite:///{tmp_path / 'p' / 'study.db'}")
    trials = [record_of(t) for t in study.trials]
    # the boards stay registered: their session died running the candidate (too slow for the
    # session budget), which is the candidate's failure, not the environment's
    assert [t.state for t in trials] == ["FAIL", "FAIL"]
    assert all(t.fail_reason.startswith("the board's session died running this candidate") for t in trials)


def test_run_over_rpc_equals_a_local_run(boards, tiny_model, tiny_data, tmp_path):
    api.plan(model=tiny_model, data=tiny_data, out=tmp_path / "p", trials=2, accuracy_steps=10, latency_repeats=3)
    local = api.run(tmp_path / "p", steps=40, out=tmp_path / "local", shuffle=False)
    remote = api.run(tmp_path / "p", steps=40, out=tmp_path / "remote", shuffle=False, tracker=boards.tracker, key=boards.key)
    assert remote.device == f"rpc:{boards.key}" and local.device == "local"
    with np.load(tmp_path / "local" / "weights.npz") as a, np.load(tmp_path / "remote" / "weights.npz") as b:
        for k in a.files:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-5)
    assert remote.after["loss"] == pytest.approx(local.after["loss"], abs=1e-5)
    # the board times its own steps and reads its own heap (`planner board serve`'s probes)
    assert remote.check is not None and remote.check.steps_timed == 40 and f"on rpc:{boards.key}" in remote.check.how
    assert remote.check.memory_bytes is not None and "not measured" not in remote.check.how
    # and the board is free again as soon as the work ends, not when its session times out: the
    # next trial's request would otherwise queue at the tracker for `session_timeout_s`
    tracker = parse_host_port(boards.tracker)
    _wait_until(lambda: key_status(tracker, boards.key).free == 2, 10, "a board stayed busy after its work ended")


def test_a_text_model_trains_over_rpc_as_it_does_locally(boards, tmp_path):
    """Token ids and an attention mask cross to the board as int64 and train there exactly as here."""
    model = token_bag(tmp_path / "bag.onnx")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 64, (60, 12))
    np.savez(tmp_path / "text.npz", input_ids=ids, attention_mask=np.ones((60, 12), np.int64), y=ids[:, 0] % 3)
    api.plan(model=model, data=tmp_path / "text.npz", out=tmp_path / "p", trials=2, accuracy_steps=10, latency_repeats=3)
    local = api.run(tmp_path / "p", steps=20, out=tmp_path / "local", shuffle=False)
    remote = api.run(tmp_path / "p", steps=20, out=tmp_path / "remote", shuffle=False, tracker=boards.tracker, key=boards.key)
    assert remote.device == f"rpc:{boards.key}"
    with np.load(tmp_path / "local" / "weights.npz") as a, np.load(tmp_path / "remote" / "weights.npz") as b:
        for k in a.files:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-5)
    assert remote.after["loss"] == pytest.approx(local.after["loss"], abs=1e-5)


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None, reason="needs g++-aarch64-linux-gnu (.ci/run installs it)")
def test_compile_emits_an_aarch64_library_for_raspberry_pi_4(tiny_model, tiny_data, tmp_path):
    api.plan(model=tiny_model, data=tiny_data, out=tmp_path / "p", trials=1, accuracy_steps=5, latency_repeats=3)
    res = planner("compile", tmp_path / "p", "--target", "raspberry-pi-4", "--out", tmp_path / "pi")
    assert res.returncode == 0, res.stderr
    elf = (tmp_path / "pi" / "train_step.so").read_bytes()[:20]
    assert elf[:4] == b"\x7fELF" and elf[4] == 2  # 64-bit
    assert int.from_bytes(elf[18:20], "little") == 183  # e_machine EM_AARCH64
    plan = read_plan(tmp_path / "pi")
    assert plan.target.name == "raspberry-pi-4" and plan.target.device == "rpc:raspberry-pi-4"


# An unreachable tracker and a tracker without boards of the key: tests/test_cli_errors.py (exit 3).


def test_targets_check_counts_the_boards_of_the_key(boards):
    check = planner("targets", "check", "host", "--tracker", boards.tracker, "--key", boards.key, "--json")
    assert check.returncode == 0, check.stderr
    assert "2 under key" in check.stdout


# A `planner board` process takes TVM's worker processes with it, however it stops (issue 14).

STOPS = pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=["kill-9", "SIGTERM", "Ctrl-C"])


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie nobody reaped has ended)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_until(condition, timeout: float, failure: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(failure)
        time.sleep(0.1)


def _registered(tracker: tuple[str, int], key: str) -> bool:
    try:
        return key_status(tracker, key).total == 1
    except BoardUnreachable:
        return False


def _stop_and_check_gone(proc: subprocess.Popen, sig: signal.Signals, port: int, workers: list[psutil.Process]) -> None:
    """Signal the `planner board` process alone (as `kill PID` and the OOM killer do; a terminal's
    Ctrl-C would reach its workers too), then: its port closes and none of its workers survives."""
    os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    _wait_until(
        lambda: not _accepts(port) and not _alive(workers),
        10,
        f"after {sig.name}: port {port} accepting={_accepts(port)}, still running: {_alive(workers)}",
    )


@STOPS
def test_a_stopped_board_takes_its_server_and_sessions_with_it(sig, rpc_tracker):
    from tvm import rpc

    tracker = parse_host_port(rpc_tracker)
    key, port = f"mortal-{sig.name}", free_port()
    board = start("serve", "--tracker", rpc_tracker, "--key", key, "--port", str(port), "--port-end", str(port + 1))
    try:
        _wait_until(lambda: _registered(tracker, key), 60, "the board did not register")
        session = rpc.connect_tracker(*tracker).request(key, session_timeout=120)
        assert session.get_function(RSS)() > 0  # runs in a session process the server forked
        workers = psutil.Process(board.pid).children(recursive=True)
        assert len(workers) >= 2, workers  # the RPC server process and the session's
        _stop_and_check_gone(board, sig, port, workers)
    finally:
        kill(board)


@STOPS
def test_a_stopped_tracker_takes_its_tracker_process_with_it(sig):
    port = free_port()
    tracker = start("tracker", "--port", str(port), "--port-end", str(port + 1))
    try:
        _wait_until(lambda: _accepts(port), 60, "the tracker did not start")
        workers = psutil.Process(tracker.pid).children(recursive=True)
        assert workers
        _stop_and_check_gone(tracker, sig, port, workers)
    finally:
        kill(tracker)


def _board_args(command: str, port: int) -> list[str]:
    args = [command, "--host", "0.0.0.0", "--port", str(port), "--port-end", str(port + 1)]
    if command == "serve":  # nothing at the tracker address: the server binds and listens all the same
        args += ["--tracker", f"127.0.0.1:{free_port()}", "--key", "exposed"]
    return args


@pytest.mark.parametrize("command", ["tracker", "serve"])
def test_a_non_loopback_host_needs_allow_remote(command):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "planner", "board", *_board_args(command, port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        kill(proc)
    assert proc.returncode == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "--allow-remote" in lines[0] and "code" in lines[0], err
    assert not _accepts(port)


@pytest.mark.parametrize("command", ["tracker", "serve"])
def test_allow_remote_binds_a_non_loopback_host_and_warns(command, tmp_path):
    port = free_port()
    log = tmp_path / "stderr"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "planner", "board", *_board_args(command, port), "--allow-remote"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    try:
        _wait_until(lambda: _accepts(port) and " on 0.0.0.0:" in log.read_text(), 60, f"it did not start: {log.read_text()}")
        warnings = [line for line in log.read_text().splitlines() if line.startswith("warning: ")]
        assert len(warnings) == 1 and "0.0.0.0" in warnings[0] and "code" in warnings[0], log.read_text()
        assert proc.poll() is None
    finally:
        kill(proc)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "localhost", "LOCALHOST"])
def test_loopback_hosts_need_no_flag(host):
    assert check_bind_host(host, allow_remote=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.10", "10.0.0.1", "board.example.com"])
def test_other_hosts_are_refused_without_allow_remote(host):
    with pytest.raises(BadInput, match="`allow_remote`"):  # the CLI shows it as --allow-remote
        check_bind_host(host, allow_remote=False)
    assert "any code" in check_bind_host(host, allow_remote=True)
