"""Kill points for the reliability tests: `PLANNER_KILL_AT=POINT[@N]` sends this process SIGKILL
the Nth time (default: the first) it reaches POINT; `PLANNER_DELAY_AT=POINT:MS` makes it wait MS
milliseconds each time (a step made slower than its plan, for `planner run`'s check).

planner promises that kill -9 at any instant loses nothing finished and leaves nothing
half-written; a test cannot hit "after the commit record, before the renames" by timing a kill
from outside, so the instants that matter are named here and the tests kill the real process
there. Unset — always, outside tests — a point costs one environment lookup.

Points: `trial-compile`, `trial-measure`, `trial-accuracy` (a search trial's stages),
`write-staged` (new files staged, not committed), `write-committed` (commit record written, no
file renamed), `write-renaming` (one file renamed), `step` (inside a timed training step).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

ENV, DELAY_ENV = "PLANNER_KILL_AT", "PLANNER_DELAY_AT"
_reached: Counter[str] = Counter()


def point(name: str) -> None:
    delay = os.environ.get(DELAY_ENV)
    if delay and delay.partition(":")[0] == name:
        time.sleep(float(delay.partition(":")[2]) / 1e3)
    spec = os.environ.get(ENV)
    if not spec:
        return
    where, _, nth = spec.partition("@")
    if where != name:
        return
    _reached[name] += 1
    if _reached[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
