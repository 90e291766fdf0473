"""sha256 of files, read in chunks: a dataset or model larger than RAM is hashed in bounded memory."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
