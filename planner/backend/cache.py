"""The content-addressed build cache both back ends keep their artifacts in.

An entry's name is a digest of everything that decides its bytes (`entry_key`: the model's
sha256, the candidate, the target's build settings, the versions of planner, its code and TVM),
so a candidate is never built twice, in one run or across runs. Entries are written to a
temporary folder and renamed into place, so a killed build leaves nothing half-written; an entry
is verified before it is used (`planner.cachefile`): a damaged one is a miss, removed and built
again. Failures of the cache's own files are `EnvironmentFailure`, never a failed trial.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import tvm

from planner import __version__, cachefile
from planner.errors import EnvironmentFailure, reason
from planner.inputs.model import Model
from planner.types import Precision

META_NAME = "train_step.json"  # the cache entry's record, never part of the artifact


def check_cache_dir(path: str | Path) -> Path:
    """`path`, created when missing, once a file could be written in it: a file given as the
    cache, a read-only directory or file system, or a full disk is one `EnvironmentFailure` line
    naming the directory, before any trial runs instead of in every one."""
    path = Path(path)
    hint = "set PLANNER_CACHE_DIR to a writable directory"
    if path.exists() and not path.is_dir():
        raise EnvironmentFailure(f"cannot use the compile cache {path}: it is a file, not a directory ({hint})")
    try:
        path.mkdir(parents=True, exist_ok=True)
        # root ignores permission bits: only a real write tells whether writing works
        with tempfile.TemporaryFile(dir=path, prefix=".probe-", buffering=0) as probe:
            probe.write(b"planner")
    except OSError as exc:
        raise EnvironmentFailure(f"cannot use the compile cache {path}: {reason(exc)} ({hint})") from None
    return path


@functools.cache
def code_id() -> str:
    """A hash of the source of the back ends (a board's C runtime and linker script included), the
    runtime they build for, and the modes and tasks that hand the step's graph its parts (a weight
    rebuilt from a mode's parts, a task's loss): a changed graph builder, memory model, weight
    layout, loss or C kernel must not reuse entries built by the old one, even within one
    released version."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    sources = [here, *(here.parent / part for part in ("runtime", "modes", "tasks"))]
    for path in sorted(p for folder in sources for p in folder.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
        h.update(path.relative_to(here.parent).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


_SOURCE_SUFFIXES = frozenset({".py", ".c", ".h", ".ld", ".S"})


def entry_key(model: Model, candidate: dict, build: dict) -> str:
    """The name of a cache entry: a digest of the model, the candidate (as it decides the
    artifact's bytes: `Candidate.to_json`, less what the step takes as an input), the build
    settings of the target that decide them, and the versions of planner, its code and TVM."""
    blob = json.dumps(
        {
            "model": model.key_for(Precision(candidate.get("precision", "fp32"))),
            "candidate": candidate,
            "build": build,
            "versions": {"planner": __version__, "code": code_id(), "tvm": tvm.__version__},
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


T = TypeVar("T")


def cached_build(entry: Path, make: Callable[[Path], dict], load: Callable[[Path, dict, bool], T]) -> T:
    """The artifact in the cache entry `entry`, built by `make(tmp)` when it is not there whole.

    `make` writes the artifact's files into the empty folder `tmp` and returns the entry's record,
    whose `files` maps each of them to its digest; the folder is renamed into place, so a killed
    build leaves nothing half-written. `load(entry, record, cached)` makes the artifact. Workers
    of one study share the cache: whoever builds a candidate first, the others wait for it and
    load the result instead of building it again."""
    if (step := _cached(entry, load)) is not None:
        return step
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with open(entry.parent / f"{entry.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (step := _cached(entry, load)) is not None:
                return step
            _discard(entry)
            tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
            try:
                meta = make(tmp)
                cachefile.write_json(tmp / META_NAME, meta, entry.name)
                tmp.rename(entry)  # under the lock, after `_discard`: no other entry is there
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            return load(entry, meta, False)
    except OSError as exc:  # the cache's own files: its folders, the lock, the entry's metadata
        raise EnvironmentFailure(f"cannot write the compile cache {entry.parent.parent}: {reason(exc)}") from None


def _cached(entry: Path, load: Callable[[Path, dict, bool], T]) -> T | None:
    """The entry's artifact when its metadata verifies and every file is the one the metadata
    hashed; None (a miss) for a missing, partial, damaged or edited entry. Nothing may load a
    library before this check: dlopen of a truncated one is a SIGBUS, not an exception."""
    meta = cachefile.read_json(entry / META_NAME, entry.name)
    if meta is None or not isinstance(meta.get("files"), dict) or not meta["files"]:
        return None
    if not all(cachefile.matches(entry / name, digest) for name, digest in meta["files"].items()):
        return None
    try:
        return load(entry, meta, True)
    except (KeyError, TypeError, ValueError):  # a field missing or of the wrong kind
        return None


def _discard(entry: Path) -> None:
    """Removes a bad entry (if there is one): renamed aside first, so no reader ever sees it
    half-deleted, then deleted."""
    bad = entry.with_name(f".bad-{entry.name}-{secrets.token_hex(4)}")
    try:
        entry.rename(bad)
    except FileNotFoundError:
        return
    shutil.rmtree(bad, ignore_errors=True)
