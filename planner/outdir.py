"""Output directories planner owns: checked before any trial, claimed, locked, replaced atomically.

Root ignores permission bits and a disk fills up mid-run, so the only honest checks are real
writes; failures anywhere (the plan files, the study's SQLite file) become `OutputUnwritable`.

Ownership: a directory planner writes into carries a `.planner` marker naming what it holds (a
plan, or a run's fine-tuned model). A directory that holds anything else is refused, never
overwritten: `--out ~/Documents` must not replace someone's `report.md`. The marker is also the
lock a writer holds, so two processes never write one directory at once.

Atomicity under kill -9 at any instant: the new files are staged in a hidden folder inside the
directory, then a commit record naming them is renamed into place (the instant the new contents
become the truth), then each file is renamed over its old version. Whoever next opens the
directory (a writer or a reader) finishes an interrupted roll-forward from the commit record, or
removes staged folders that never got one. So a reader sees the old files or the new ones, never
a mix, and nothing stale stays behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, suppress
from pathlib import Path
from typing import Literal

from . import faults
from .errors import BadInput, OutputUnwritable
from .urls import redact

MARKER = ".planner"
COMMIT = ".planner-commit"
STAGED_PREFIX = ".staged-"
Kind = Literal["plan", "run"]
_WHAT = {"plan": "a plan directory", "run": "fine-tuned weights"}


def _foreign(out: Path, kind: Kind) -> list[str]:
    """Entries of `out` that say planner did not make it for `kind` (empty: it may be used)."""
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return []
    marker = out / MARKER
    if marker.is_file():
        try:
            owner = json.loads(marker.read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            owner = None
        return [] if owner == kind else [f"{MARKER} (it holds {_WHAT.get(owner, 'something else')})"]
    return entries


def prepare_out_dir(out: str | Path, create: bool = True, kind: Kind = "plan") -> Path:
    """`out` once planner may write `kind` into it: new, empty, or marked as planner's `kind`.

    Created (with its marker) when `create`; else only checked (its nearest existing parent is
    probed, nothing is made). A file given as --out, a directory holding other files, a
    read-only directory or file system is one line, before any trial runs."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputUnwritable(f"--out {out} is a file, not a directory; give a directory for the {kind}")
    if out.is_dir():
        foreign = _foreign(out, kind)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", …" if len(foreign) > 3 else "")
            raise BadInput(
                f"--out {out} holds files planner did not write for {_WHAT[kind]} ({shown}); "
                "give a new or empty directory, so nothing of yours is overwritten"
            )
    try:
        if create:
            out.mkdir(parents=True, exist_ok=True)
        probe = out if create else next(p for p in (out, *out.absolute().parents) if p.exists())
        if not probe.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(probe))
        with tempfile.TemporaryFile(dir=probe, prefix=".planner-probe-"):
            pass  # root ignores permission bits: only a real file tells whether writing works
        if create and not (out / MARKER).is_file():
            _write_atomically(out / MARKER, json.dumps({"kind": kind, "written_by": "planner"}) + "\n")
    except OSError as exc:
        raise OutputUnwritable(f"cannot write the {kind} into {out}: {reason(exc)}") from None
    return out


def release_if_empty(out: Path) -> None:
    """Remove `out` when it holds nothing but planner's marker (a run that wrote nothing)."""
    with suppress(OSError):
        if {p.name for p in out.iterdir()} <= {MARKER}:
            (out / MARKER).unlink(missing_ok=True)
            out.rmdir()


_HELD: set[Path] = set()  # directories this process holds (re-entrant: `plan` holds, then writes)


@contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold `out` for this process: a second planner process writing into it (a second `plan`
    on the same --out) is refused with one line, instead of racing it (e.g. both creating the
    study database). The lock dies with the process, so kill -9 leaves no stale lock."""
    key = out.resolve()
    if key in _HELD:
        yield
        return
    marker = out / MARKER
    try:
        fd = os.open(marker, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise OutputUnwritable(f"cannot write into {out}: {reason(exc)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BadInput(f"another planner process is writing into {out}; wait for it, or give another --out") from None
        _HELD.add(key)
        try:
            yield
        finally:
            _HELD.discard(key)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def recover(out: Path) -> None:
    """Finish a replacement a killed process committed, and remove staged folders it never did.

    Idempotent, and safe to race: a file already moved is skipped."""
    commit = out / COMMIT
    if commit.is_file():
        try:
            record = json.loads(commit.read_text())
            staged, names, stale = out / record["staged"], list(record["files"]), list(record["remove"])
        except (OSError, ValueError, KeyError, TypeError):
            record = None  # torn before its rename: never committed
        if record is not None:
            for name in names:
                with suppress(FileNotFoundError):
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(staged / name, out / name)
                    faults.point("write-renaming")
            for name in stale:
                (out / name).unlink(missing_ok=True)
        commit.unlink(missing_ok=True)
    for leftover in out.glob(f"{STAGED_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in out.glob(f"{COMMIT}.tmp-*"):
        leftover.unlink(missing_ok=True)


def replace_files(out: Path, fill: Callable[[Path], None], last: str | None = None, remove: tuple[str, ...] = ()) -> None:
    """Replace files of `out` with those `fill(staging_dir)` writes, atomically (module docstring).

    `last` is renamed after every other file (a plan's plan.json: its presence marks a plan);
    `remove` are old files the new contents no longer have. Files of `out` that `fill` does not
    write (the study database, the marker) are kept. When writing fails (out of disk, a
    read-only file system, ...) `out` is left as it was and the failure is one
    `OutputUnwritable` line."""
    recover(out)
    staged = None
    try:
        staged = Path(tempfile.mkdtemp(dir=out, prefix=STAGED_PREFIX))
        fill(staged)
        names = sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file())
        for name in names:
            with open(staged / name, "rb") as f:
                os.fsync(f.fileno())
        names = [n for n in names if n != last] + [n for n in names if n == last]
        _fsync_dir(staged)
        faults.point("write-staged")
        _write_atomically(out / COMMIT, json.dumps({"staged": staged.name, "files": names, "remove": [r for r in remove if r not in names]}))
        faults.point("write-committed")
    except OSError as exc:
        failed = _newest(staged) if staged is not None else None  # the file being written when it failed
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        where = f" ({failed})" if failed else ""
        raise OutputUnwritable(f"cannot write into {out}: {reason(exc)}{where}; nothing was written") from None
    recover(out)  # renames within one directory: they need no space
    _fsync_dir(out)


def _newest(staged: Path) -> str | None:
    files = [p for p in staged.rglob("*") if p.is_file()]
    return str(max(files, key=lambda p: p.stat().st_mtime_ns).relative_to(staged)) if files else None


@contextmanager
def study_storage_writes(storage_url: str, out: str | Path | None = None) -> Iterator[None]:
    """Around opening and running a study whose storage may live in `out`: running out of disk
    (or a read-only file system) is one `OutputUnwritable` line naming the directory, not
    Optuna's traceback. A storage file this run created and that holds no finished trial is
    removed again (and `out`, the plan directory, if it is left empty); finished trials are
    kept, so the same command resumes the study once there is room.
    """
    db = _sqlite_file(storage_url)
    db_existed = db is not None and db.exists()
    try:
        yield
    except Exception as exc:
        found = disk_problem(exc)
        if found is None:
            raise
        reason, filename = found
        where = db if db is not None else (Path(storage_url) if "://" not in storage_url else None)
        if filename is not None and (where is None or Path(filename).parent != where.parent):
            raise OutputUnwritable(f"cannot write {filename}: {reason}") from None  # not the storage
        tail = ""
        if db is not None and db.exists():
            if not db_existed and _finished_trials(db) == 0:
                for path in (db, db.with_name(db.name + "-journal")):
                    path.unlink(missing_ok=True)
                if out is not None and Path(out).is_dir():
                    release_if_empty(Path(out))
            else:
                tail = f"; the trials finished so far stay in {db.name}: make room and rerun the same command to resume"
        place = f"into {where.parent}: {reason} ({where.name})" if where is not None else f"{redact(storage_url)}: {reason}"
        raise OutputUnwritable(f"cannot write the study storage {place}{tail}") from None


DISK_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (over the file size limit, see `ulimit -f`)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def reason(exc: OSError) -> str:
    return DISK_REASONS.get(exc.errno) or (exc.strerror or str(exc)).lower()


def disk_problem(exc: BaseException | None) -> tuple[str, str | None] | None:
    """(reason, file or None) when a write failed for want of room or write access, found
    anywhere along `exc`'s chain (Optuna and SQLAlchemy wrap SQLite's own error); else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_REASONS:
            return DISK_REASONS[exc.errno], exc.filename if isinstance(exc.filename, str) else None
        if isinstance(exc, sqlite3.Error):
            message = str(exc)
            if "database or disk is full" in message:
                return DISK_REASONS[errno.ENOSPC], None
            if "readonly database" in message:
                return DISK_REASONS[errno.EROFS], None
        exc = exc.__cause__ or exc.__context__
    return None


def _sqlite_file(storage_url: str) -> Path | None:
    """The file behind a `sqlite:///PATH` storage URL (None for any other storage)."""
    prefix = "sqlite:///"
    path = storage_url[len(prefix):].split("?", 1)[0] if storage_url.startswith(prefix) else ""
    return Path(path) if path and path != ":memory:" else None


def _finished_trials(db: Path) -> int | None:
    """Finished trials in an Optuna SQLite file, read read-only (None: unreadable, so keep it)."""
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "trials" not in tables:
                return 0
            return conn.execute("SELECT COUNT(*) FROM trials WHERE state IN ('COMPLETE', 'FAIL')").fetchone()[0]
    except sqlite3.Error:
        return None
