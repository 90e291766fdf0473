"""Parsing planner's TVMScript kernels without paying for the caller's stack.

TVMScript's parser reads frames of the stack that calls it, source lines included: `inspect.stack()`
once a kernel (`T.prim_func`), and `inspect.getouterframes` at every macro call (`T.macro`,
`T.inline`) only to find the parser object in some frame's globals. A frame whose file is not a
module's (`<ast>`: the parser's own evaluated expressions, nested at every macro) costs
`inspect.getmodule` a scan of all of `sys.modules`, 1-2 ms with TVM and torch imported. From
pytest's stack (~80 frames) a MobileNetV3 step's 95 kernels took 57 s to parse, from a thread of
their own (a dozen frames) 10 s; with macros finding their parser by walking frames, a cold
MobileNetV2 compile legalized in 8.3 s instead of 12.8 s (docs/benchmarks.md, "CI").
"""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

from tvm.script.parser.core.parser import ScriptMacro

T = TypeVar("T")


def parsed(make: Callable[..., T], *args: Any) -> T:
    """`make(*args)` (a function whose body parses TVMScript) on a thread of its own, where the
    parser's stack is a dozen frames whatever the caller's depth. A fresh thread each time: one
    kept in a pool would not survive a fork."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="planner-tvmscript") as parser:
        return parser.submit(make, *args).result()


def _find_parser_def(self: ScriptMacro) -> Any:
    """TVM's `ScriptMacro._find_parser_def` (the nearest frame whose globals hold the current
    parser), walking frames rather than building `inspect.FrameInfo`s with their source."""
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        found = frame.f_globals.get(ScriptMacro.parser_object_name)
        if found is not None:
            return found
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


# TVM 0.27's lookup, replaced by the same lookup without the source reads (a method of that name
# and meaning; a TVM without it keeps its own)
if callable(getattr(ScriptMacro, "_find_parser_def", None)):
    ScriptMacro._find_parser_def = _find_parser_def
