"""The kernel library a step may call (OpenBLAS), found and loaded wherever the step runs.

Dense convolutions call OpenBLAS's `sgemm` (see `planner.backend.gemm`), from the
`scipy-openblas32` wheel: a dependency of planner, built for x86-64 and AArch64 alike. The step's
library does not contain OpenBLAS (27 MB, no static archive in the wheel): it names
`libscipy_openblas.so` as a needed library (`link_options`), so the loader either finds that
library already loaded in the process — `load` does so in every planner session, `planner run`
and `planner board serve` — or on its search path (`LD_LIBRARY_PATH`, for a board served by
TVM's own `python -m tvm.exec.rpc_server`). Without it, loading the step fails at once with the
library's name, never at the first call.

This module imports only the standard library: the board side loads it too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SONAME = "libscipy_openblas.so"
PACKAGE = "scipy-openblas32"
INSTALL_HINT = f"pip install {PACKAGE} where the step runs, or set `kernels: tvm` in the hardware target"


@functools.cache
def load_openblas() -> str | None:
    """OpenBLAS loaded into this process (its path), single-threaded, or None when
    `scipy-openblas32` is not installed. Single-threaded because every call already runs on one
    of TVM's pool threads: OpenBLAS's own threads beside TVM's spinning pool made both slower."""
    try:
        import scipy_openblas32
    except ImportError:
        return None
    path = os.path.join(scipy_openblas32.get_lib_dir(), SONAME)
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    lib.scipy_openblas_set_num_threads(1)
    return path


def missing_library(message: str) -> bool:
    """Whether a failure to load a step is OpenBLAS missing where it runs."""
    return SONAME in message and ("cannot open shared object" in message or "No such file" in message)


def link_options(compiler: str, cache_dir: Path) -> list[str]:
    """Linker options that make a step need `libscipy_openblas.so`, for a library linked by
    `compiler` (the target's cross compiler or the host's). The link needs only the name: an
    empty library with OpenBLAS's soname, built once per compiler in the cache, stands in for it,
    so a cross link needs no AArch64 OpenBLAS on the planning machine. `--no-as-needed`: the
    stand-in defines nothing the step uses, and `--as-needed` (the default on Ubuntu) would drop
    it."""
    tag = hashlib.sha256(f"{compiler}|{shutil.which(compiler)}".encode()).hexdigest()[:16]
    directory = cache_dir / "link" / tag
    stub = directory / SONAME
    if not stub.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            source = Path(tmp) / "empty.c"
            source.write_text("")
            built = Path(tmp) / SONAME
            subprocess.run(
                [compiler, "-shared", "-nostdlib", f"-Wl,-soname,{SONAME}", "-x", "c", str(source), "-o", str(built)],
                check=True,
                capture_output=True,
            )
            built.rename(stub)  # atomic: parallel compiles keep one of identical files
    return [f"-L{directory}", "-Wl,--no-as-needed", "-lscipy_openblas"]
