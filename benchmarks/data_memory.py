"""Memory of `planner plan` and `planner run` against the dataset's size: streamed against loaded whole.

    python benchmarks/data_memory.py [--sizes-mb 100,400,1600] [--baseline-ref 1284607]

For each size, a `.npz` of the bundled digits task (its train split repeated to the size, float32,
uncompressed as `np.savez` writes it; val as shipped) is planned (`--trials 1 --accuracy-steps
50`, the hand-made last-layer scheme) and run (`--steps 50`), each in a fresh process whose peak
RSS (`ru_maxrss`) and wall time are measured. The same commands run side by side on planner at
`--baseline-ref` (a git worktree; that ref read the `.npz` whole), so the two columns differ only
in how the data is read. Each process also holds TVM, the compiled step and its weights: the
floor is that, not zero. One compressed `.npz` (`np.savez_compressed`) at the middle size shows
the cost of unpacking it once into the cache.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MEASURE = (
    "import resource, subprocess, sys, time\n"
    "t = time.perf_counter(); code = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "print(code.returncode, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)\n"
    "sys.stderr.write(code.stderr)\n"
)


def measured(args: list[str], source: Path, cache: Path) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of `planner ARGS` run from `source`, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(source), "PLANNER_CACHE_DIR": str(cache)}
    # run from the temporary directory: `python -m` puts its working directory first on the
    # path, and from a checkout that would import the checkout's planner, not `source`'s
    res = subprocess.run(
        [sys.executable, "-c", MEASURE, sys.executable, "-m", "planner", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cache.parent,
    )
    code, seconds, rss = res.stdout.split()
    if code != "0":
        raise SystemExit(f"planner {' '.join(args)} failed: {res.stderr.strip().splitlines()[-1:]}")
    return float(seconds), int(rss)


def dataset(path: Path, size_mb: int, compressed: bool = False) -> Path:
    with np.load(ROOT / "examples" / "digits" / "digits.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    reps = max(1, size_mb * 10**6 // arrays["x_train"].nbytes)
    arrays["x_train"] = np.tile(arrays["x_train"], (reps, 1, 1, 1))
    arrays["y_train"] = np.tile(arrays["y_train"], reps)
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", default="100,400,1600")
    parser.add_argument("--baseline-ref", default="1284607", help="planner before streaming (reads the .npz whole)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        baseline = tmp / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(baseline), args.baseline_ref], check=True
        )
        try:
            rows = []
            cases = [(mb, False) for mb in sizes] + [(sizes[len(sizes) // 2], True)]
            for mb, compressed in cases:
                data = dataset(tmp / f"d{mb}{'c' if compressed else ''}.npz", mb, compressed)
                row = [f"{data.stat().st_size / 1e6:,.0f} MB{' compressed' if compressed else ''}"]
                for name, source in (("baseline", baseline), ("now", ROOT)):
                    cache = tmp / f"cache-{name}"
                    out = tmp / f"plan-{name}-{mb}{compressed}"
                    plan = ["plan", "--data", str(data), "--trials", "1", "--accuracy-steps", "50", "--out", str(out)]
                    p_s, p_rss = measured(plan, source, cache)
                    r_s, r_rss = measured(["run", str(out), "--steps", "50"], source, cache)
                    row += [f"{p_rss / 2**20:,.0f} MiB, {p_s:.0f} s", f"{r_rss / 2**20:,.0f} MiB, {r_s:.0f} s"]
                rows.append(row)
                print(" | ".join(row), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], check=False)
    print()
    print(f"| dataset | plan at {args.baseline_ref} | run at {args.baseline_ref} | plan now | run now |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\n({time.perf_counter() - t0:.0f} s)")
