"""Cache files that carry their own sha256: written atomically, verified on every read.

The threat is accidental damage: a write killed halfway or cut short by a full disk, bit rot, a
file edited by hand. A damaged entry must read as a miss, to be rebuilt, and never be used: a
truncated shared library kills the process that dlopens it (SIGBUS, not an exception), an edited
number silently becomes a wrong plan. It is no defence against an attacker: whoever can write the
cache can as well write a matching hash (or replace planner itself).

A JSON file is `{"sha256": ..., "body": ...}`, the hash taken over the body's canonical JSON and
the cache key it is stored under, so an entry copied to another key does not verify either. A
binary file (a library, an object) is verified against the `digest` its JSON recorded for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from planner.digest import file_sha256


def default_cache_dir() -> Path:
    """`$PLANNER_CACHE_DIR`, else `~/.cache/planner`."""
    env = os.environ.get("PLANNER_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "planner"


def write_bytes(path: Path, data: bytes) -> None:
    """`data` as `path`, whole or not at all: written to a temporary name in the same directory
    and renamed over `path`, so a killed or failed write leaves no partial file under its name.
    An OSError (a full disk, a read-only file system) reaches the caller."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: Path, body: dict, key: str) -> None:
    """`body` as `path` (atomically, see `write_bytes`), with the hash `read_json` verifies."""
    write_bytes(path, json.dumps({"sha256": _json_hash(body, key), "body": body}, indent=1).encode())


def read_json(path: Path, key: str) -> dict | None:
    """The body `write_json` stored under `key` at `path`; None when it is missing, unreadable,
    not such JSON, or its hash does not match (a truncated or edited file)."""
    try:
        stored = json.loads(path.read_bytes())
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(stored, dict) or not isinstance(stored.get("body"), dict):
        return None
    return stored["body"] if stored.get("sha256") == _json_hash(stored["body"], key) else None


def digest(path: Path) -> dict:
    """What `matches` checks the file at `path` against later: its size and sha256."""
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def matches(path: Path, expected: object) -> bool:
    """Whether the file at `path` is the one whose `digest` is `expected` (False when it is
    missing or unreadable, or `expected` is no digest). The size is compared first: a truncated
    file is told without reading it."""
    if not isinstance(expected, dict):  # no digest
        return False
    try:
        return path.stat().st_size == expected["size"] and digest(path) == expected
    except (OSError, KeyError):  # KeyError: `expected` is no digest
        return False


def _json_hash(body: dict, key: str) -> str:
    canonical = json.dumps([key, body], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
