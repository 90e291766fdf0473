from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# One TVM pool thread per test process (planner would size pools to the cores): pytest-xdist runs
# a process per core, and pools of spinning threads on shared cores slow every step many times
# over. tests/test_threads.py checks planner's own sizing in processes of its own.
os.environ.setdefault("TVM_NUM_THREADS", "1")

from builders import blobs, free_port, tiny_cnn  # noqa: E402


def pytest_collection_modifyitems(items):
    """The slow tier first, each tier in its own order: pytest-xdist's workers then take the
    minutes-long tests while there is plenty left to run beside them, and finish on short ones
    (last, a minute's test could hold the run up after every other test had ended)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With PLANNER_TEST_NO_SKIP set (.ci/run sets it, after preparing PostgreSQL, Chromium, the
    cross toolchain and the emulated board), a skipped test is a failed one: CI must not turn a
    test environment it failed to prepare into a quiet skip and stay green."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("PLANNER_TEST_NO_SKIP") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, but PLANNER_TEST_NO_SKIP promises every test environment here: {reason}"


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """One compile cache for the whole run, never the user's; with pytest-xdist (`-n 2`), one for
    all its workers (planner's cache is safe across processes), so none compiles what another has."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.getbasetemp()
    path = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "planner-cache"
    path.mkdir(exist_ok=True)
    _share_kernels(path)
    mp.setenv("PLANNER_CACHE_DIR", str(path))
    yield path
    mp.undo()


def _share_kernels(cache: Path) -> None:
    """With PLANNER_TEST_KERNEL_STORE (CI keeps one between runs, as it keeps the emulated board),
    the run's cache takes its compiled kernel objects and parsed OpenBLAS kernels from that
    folder, as ccache would: both are named by a digest of all that makes their bytes (a
    kernel's TIR, the target, TVM's version and code generation flags; a kernel module's
    source), so a kernel no run compiled before is compiled, and one it did is linked as it
    was. Steps, plans and accuracies are never shared: every test still builds, links and
    runs each step itself. A test with a cache of its own compiles everything, as before."""
    store = os.environ.get("PLANNER_TEST_KERNEL_STORE")
    if not store:
        return
    for part in ("kernels", "kernels-tir"):
        kept = Path(store) / part
        kept.mkdir(parents=True, exist_ok=True)
        try:
            (cache / part).symlink_to(kept, target_is_directory=True)
        except FileExistsError:  # another xdist worker linked it first
            pass


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_cnn(tmp_path_factory.mktemp("model") / "tiny.onnx")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return blobs(tmp_path_factory.mktemp("data") / "blobs.npz")


def _postgres_bindir() -> Path | None:
    """The newest Debian PostgreSQL server (/usr/lib/postgresql/N/bin), else one on PATH."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/postgres")]
    if found:
        return max(found, key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0)
    postgres = shutil.which("postgres")
    return Path(postgres).parent if postgres else None


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL database URL for study storage: $PLANNER_TEST_POSTGRES when set, else a
    throwaway server started for this test run (127.0.0.1 only, its files in a temporary folder,
    run as the `postgres` user when the tests run as root: the server refuses root) and stopped
    after it. Skips, saying why, only when no server can be had."""
    import sqlalchemy

    try:
        sqlalchemy.create_engine("postgresql://")  # loads SQLAlchemy's driver for such URLs
    except ImportError as exc:
        pytest.skip(f"no PostgreSQL driver ({exc.name}): pip install -e '.[test]'")
    if url := os.environ.get("PLANNER_TEST_POSTGRES"):
        yield url
        return
    bindir = _postgres_bindir()
    if bindir is None or not (bindir / "initdb").exists():
        pytest.skip("no PostgreSQL server (Debian: apt-get install postgresql) and PLANNER_TEST_POSTGRES unset")
    as_user: dict = {}
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root, and no 'postgres' user to run a PostgreSQL server as")
        as_user = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}

    base = Path(tempfile.mkdtemp(prefix="planner-pg-"))  # not pytest's tmp: the postgres user must reach it
    data, sock, pwfile, log_path = base / "data", base / "sock", base / "pw", base / "server.log"
    sock.mkdir()
    pwfile.write_text("planner\n")
    if as_user:
        for path in (base, sock, pwfile):
            os.chown(path, as_user["user"], as_user["group"])
    server = None
    try:
        init = subprocess.run(
            [
                bindir / "initdb",
                "-D",
                data,
                "-U",
                "planner",
                "--pwfile",
                pwfile,
                "-E",
                "UTF8",
                "--no-sync",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
            ],
            capture_output=True,
            text=True,
            **as_user,
        )
        if init.returncode != 0:
            pytest.skip(f"initdb failed: {init.stderr.strip()[-500:]}")
        # setpriv: the server gets SIGQUIT (immediate shutdown) should this test process die first
        guard = ["setpriv", "--pdeathsig", "QUIT", "--"] if shutil.which("setpriv") else []
        for _ in range(3):  # the free port may be taken before the server binds it
            port = free_port()
            with open(log_path, "w") as log:
                server = subprocess.Popen(
                    [
                        *guard,
                        bindir / "postgres",
                        "-D",
                        data,
                        "-h",
                        "127.0.0.1",
                        "-p",
                        str(port),
                        "-k",
                        sock,
                        "-c",
                        "fsync=off",
                        "-c",
                        "synchronous_commit=off",
                        "-c",
                        "full_page_writes=off",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    **as_user,
                )
            admin = sqlalchemy.create_engine(
                f"postgresql://planner:planner@127.0.0.1:{port}/postgres",
                isolation_level="AUTOCOMMIT",
                connect_args={"connect_timeout": 2},
                poolclass=sqlalchemy.pool.NullPool,
            )
            deadline = time.time() + 30
            while server.poll() is None and time.time() < deadline:
                try:
                    with admin.connect() as conn:
                        conn.execute(sqlalchemy.text("CREATE DATABASE planner"))
                    break
                except sqlalchemy.exc.OperationalError:
                    time.sleep(0.2)
            else:
                if server.poll() is None:
                    server.kill()
                server.wait()
                continue
            break
        else:
            pytest.skip(f"the PostgreSQL server did not start: {log_path.read_text().strip()[-500:]}")
        yield f"postgresql://planner:planner@127.0.0.1:{port}/planner"
    finally:
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGINT)  # fast shutdown: disconnects clients, then stops
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def rpc_tracker() -> Iterator[str]:
    """A real TVM RPC tracker on 127.0.0.1 with no board registered: `HOST:PORT`."""
    from planner.measurement.board import start_tracker

    tracker = start_tracker("127.0.0.1", free_port())
    try:
        yield f"127.0.0.1:{tracker.port}"
    finally:
        tracker.terminate()


def _can_mount() -> str | None:
    """Why this process cannot mount a tmpfs (None: it can)."""
    if os.environ.get("PLANNER_TEST_NO_MOUNT"):
        return "PLANNER_TEST_NO_MOUNT is set"
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "mounting a tmpfs needs root and mount(8)"
    return None


@pytest.fixture
def tmpfs(tmp_path) -> Iterator:
    """`tmpfs(options)`: a fresh directory with a tmpfs mounted on it (`size=64k`: a disk that
    fills up for real; `ro`: a read-only file system), unmounted after the test — or None when
    this process cannot mount one (not root, no CAP_SYS_ADMIN, or PLANNER_TEST_NO_MOUNT set)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path | None:
        if _can_mount() is not None:
            return None
        path = tmp_path / f"tmpfs-{len(mounted)}"
        path.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
        if res.returncode != 0:  # e.g. a container without CAP_SYS_ADMIN
            return None
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
