"""The kernel library a step may call (OpenBLAS), found and loaded wherever the step runs.

Dense convolutions call OpenBLAS's `sgemm` (see `planner.backend.sgemm.gemm`), from the
`scipy-openblas32` wheel: a dependency of planner, built for x86-64 and AArch64 alike. The step's
library does not contain OpenBLAS (27 MB, no static archive in the wheel): it names
`libscipy_openblas.so` as a needed library (`link_options`), so the loader either finds that
library already loaded in the process — `load` does so in every planner session, `planner run`
and `planner board serve` — or on its search path (`LD_LIBRARY_PATH`, for a board served by
TVM's own `python -m tvm.exec.rpc_server`). Without it, loading the step fails at once with the
library's name, never at the first call.

This module imports only the standard library (and numpy, to check OpenBLAS): the board side
loads it too.
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

from planner.errors import EnvironmentFailure

SONAME = "libscipy_openblas.so"
PACKAGE = "scipy-openblas32"
INSTALL_HINT = f"pip install {PACKAGE} where the step runs, or set `kernels: tvm` in the hardware target"


class WrongResults(EnvironmentFailure):
    """This machine's OpenBLAS computes sgemm wrong (checked when it is loaded)."""


@functools.cache
def load_openblas() -> str | None:
    """OpenBLAS loaded into this process (its path), single-threaded and checked, or None when
    `scipy-openblas32` is not installed. Single-threaded because every call already runs on one
    of TVM's pool threads: OpenBLAS's own threads beside TVM's spinning pool made both slower.

    OpenBLAS picks its kernels for the CPU it finds, and some of them have computed wrong results
    (its SME kernels, on an emulated Armv9 CPU here and on Apple M4 in OpenBLAS's own tracker): a
    wrong product would be a silently wrong gradient, so every shape and transpose the
    convolutions use is checked against numpy first (`WrongResults`). Once per process, which the
    loaded library then belongs to: the cache holds that one path."""
    try:
        import scipy_openblas32
    except ImportError:
        return None
    path = os.path.join(scipy_openblas32.get_lib_dir(), SONAME)
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    lib.scipy_openblas_set_num_threads(1)
    _check(lib)
    return path


def _check(lib: ctypes.CDLL) -> None:
    import numpy as np

    lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
    rng = np.random.default_rng(0)
    for m, n, k in ((2, 16, 2), (1, 16, 3), (5, 49, 27), (16, 7, 64), (33, 100, 70)):
        for ta, tb in ((False, False), (False, True), (True, False)):
            a = rng.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
            b = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
            c = np.full((m, n), np.nan, np.float32)  # beta 0 must overwrite, NaN included
            lib.scipy_cblas_sgemm(
                101,  # row major
                112 if ta else 111,
                112 if tb else 111,
                m,
                n,
                k,
                ctypes.c_float(1.0),
                ctypes.c_void_p(a.ctypes.data),
                a.shape[1],
                ctypes.c_void_p(b.ctypes.data),
                b.shape[1],
                ctypes.c_float(0.0),
                ctypes.c_void_p(c.ctypes.data),
                n,
            )
            want = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
            if not np.allclose(c, want, rtol=1e-4, atol=1e-4 * np.sqrt(k)):
                core = lib.scipy_openblas_get_corename().decode()
                raise WrongResults(
                    f"OpenBLAS's sgemm computes wrong results on this CPU (OpenBLAS core {core}, "
                    f"{m}x{n}x{k}): set OPENBLAS_CORETYPE to an older core (e.g. ARMV8, HASWELL) "
                    "where the step runs, or `kernels: tvm` in the hardware target"
                )


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
