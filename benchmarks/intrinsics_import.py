"""Import time of TVM's tensor intrinsics: as MetaSchedule does it, and as planner does it.

    python benchmarks/intrinsics_import.py [--depth 0 30]

MetaSchedule imports `tvm.s_tir.tensor_intrin` in every process that tunes and in every builder
process (its pool restarts each round). Each of its TVMScript functions calls `inspect.stack()`,
whose per-frame module lookup scans `sys.modules`; `planner.tune.import_intrinsics` walks the
stack itself. Each way runs in a fresh process, at a call depth of `--depth` frames (a test run or
an application calls from deeper than a bare script); the two are timed side by side.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

PROBE = """
import sys, time
import tvm
from planner.backend.lower import tune
def call(depth):
    if depth:
        return call(depth - 1)
    t0 = time.perf_counter()
    if sys.argv[1] == "planner":
        tune.import_intrinsics()
    else:
        import tvm.s_tir.tensor_intrin
    return time.perf_counter() - t0
print(call(int(sys.argv[2])))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, nargs="+", default=[0, 30])
    args = ap.parse_args()
    print("| call depth | MetaSchedule's import, s | planner's, s | ratio |")
    print("|---|---|---|---|")
    for depth in args.depth:
        seconds = {}
        for way in ("tvm", "planner"):
            out = subprocess.run([sys.executable, "-c", PROBE, way, str(depth)], capture_output=True, text=True, check=True)
            seconds[way] = float(out.stdout.split()[-1])
        print(
            f"| {depth} | {seconds['tvm']:.1f} | {seconds['planner']:.1f} | {seconds['tvm'] / seconds['planner']:.1f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
