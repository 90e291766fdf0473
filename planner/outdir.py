"""The output directory: usable before any trial runs, and a full disk is one line, not a traceback.

Root ignores permission bits and a disk fills up mid-run, so the only honest checks are real
writes; failures anywhere (the plan files, the study's SQLite file) become `OutputUnwritable`.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import closing, contextmanager, suppress
from pathlib import Path

from .errors import OutputUnwritable


def prepare_out_dir(out: str | Path, create: bool = True) -> Path:
    """`out` once a file could be written in it (created when `create`; else its nearest existing
    parent is probed and nothing is made). A file given as --out, a read-only directory or file
    system is one `OutputUnwritable` line, before any trial runs."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputUnwritable(f"--out {out} is a file, not a directory; give a directory for the plan")
    try:
        if create:
            out.mkdir(parents=True, exist_ok=True)
        probe = out if create else next(p for p in (out, *out.absolute().parents) if p.exists())
        if not probe.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(probe))
        with tempfile.TemporaryFile(dir=probe, prefix=".planner-probe-"):
            pass  # root ignores permission bits: only a real file tells whether writing works
    except OSError as exc:
        raise OutputUnwritable(f"cannot write the plan into {out}: {reason(exc)}") from None
    return out


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
        found = _disk_problem(exc)
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
                if out is not None and Path(out).is_dir() and not any(Path(out).iterdir()):
                    with suppress(OSError):
                        Path(out).rmdir()
            else:
                tail = f"; the trials finished so far stay in {db.name}: make room and rerun the same command to resume"
        place = f"into {where.parent}: {reason} ({where.name})" if where is not None else f"{storage_url}: {reason}"
        raise OutputUnwritable(f"cannot write the study storage {place}{tail}") from None


_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (over the file size limit, see `ulimit -f`)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def reason(exc: OSError) -> str:
    return _REASONS.get(exc.errno) or (exc.strerror or str(exc)).lower()


def _disk_problem(exc: BaseException | None) -> tuple[str, str | None] | None:
    """(reason, file or None) when a write failed for want of room or write access, found
    anywhere along `exc`'s chain (Optuna and SQLAlchemy wrap SQLite's own error); else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _REASONS:
            return _REASONS[exc.errno], exc.filename if isinstance(exc.filename, str) else None
        if isinstance(exc, sqlite3.Error):
            message = str(exc)
            if "database or disk is full" in message:
                return _REASONS[errno.ENOSPC], None
            if "readonly database" in message:
                return _REASONS[errno.EROFS], None
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
