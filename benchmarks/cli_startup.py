"""What a planner command pays before it does anything: importing TVM with and without PyTorch.

TVM's FFI imports PyTorch eagerly whenever it is installed; `planner.cli` keeps it out. Each way
runs in a fresh process, alternating, `--repeats` times; medians side by side.

    python benchmarks/cli_startup.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = {
    "import tvm (PyTorch installed)": [sys.executable, "-c", "import tvm, tvm.relax.frontend.onnx"],
    "import tvm, PyTorch kept out": [
        sys.executable,
        "-c",
        "import sys; sys.modules['torch'] = None; import tvm, tvm.relax.frontend.onnx",
    ],
    "planner inspect (the command)": [
        sys.executable,
        "-m",
        "planner",
        "inspect",
        str(ROOT / "examples/digits/model.onnx"),
        "--json",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    for _ in range(args.repeats):
        for name, cmd in WAYS.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[next(iter(WAYS))])
    print(f"| way | median s (min-max, {args.repeats} runs) | vs importing with PyTorch |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} ({min(ts):.2f}-{max(ts):.2f}) | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
