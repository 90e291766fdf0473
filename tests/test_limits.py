"""Size limits that keep modules readable: no module over 500 lines, no function over 80 lines of
code (its docstring aside) or over 10 parameters — the CLI's command functions, whose parameters
are its flag lists, excepted.

The modules and functions over a limit today are listed with their present size, a ceiling that
may only come down: a listed one that grows fails, and so does one that shrinks under the limit
and is still listed (take it off the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "planner"
MODULE_LINES, FUNCTION_LINES, PARAMETERS = 500, 80, 10

# over a limit today: path -> lines; (path, function) -> (lines, parameters)
MODULES_OVER: dict[str, int] = {}
FUNCTIONS_OVER: dict[tuple[str, str], tuple[int, int]] = {}


def _is_command(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Typer command (`@app.command()`, `@targets_app.command("list")`): its parameters are flags."""
    for d in node.decorator_list:
        call = d.func if isinstance(d, ast.Call) else d
        if isinstance(call, ast.Attribute) and call.attr in ("command", "callback"):
            return True
    return False


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    assert node.end_lineno is not None
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        assert first.end_lineno is not None
        lines -= first.end_lineno - first.lineno + 1
    return lines


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"]))


def _sizes() -> tuple[dict[str, int], dict[tuple[str, str], tuple[int, int]]]:
    modules, functions = {}, {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        source = path.read_text()
        modules[rel] = len(source.splitlines())
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_command(node):
                functions[(rel, node.name)] = max(functions.get((rel, node.name), (0, 0)), (_code_lines(node), _parameters(node)))
    return modules, functions


def test_no_module_grows_past_500_lines():
    modules, _ = _sizes()
    over = {m: n for m, n in modules.items() if n > MODULE_LINES}
    grown = {m: (n, MODULES_OVER.get(m)) for m, n in over.items() if n > MODULES_OVER.get(m, MODULE_LINES)}
    assert not grown, f"modules over {MODULE_LINES} lines (now, listed ceiling): {grown}"
    stale = sorted(m for m in MODULES_OVER if modules.get(m, 0) <= MODULE_LINES)
    assert not stale, f"within the limit now, take them off MODULES_OVER: {stale}"


def test_no_function_grows_past_80_lines_or_10_parameters():
    _, functions = _sizes()
    over = {f: s for f, s in functions.items() if s[0] > FUNCTION_LINES or s[1] > PARAMETERS}
    ceiling = (FUNCTION_LINES, PARAMETERS)
    grown = {
        f: (s, FUNCTIONS_OVER.get(f)) for f, s in over.items() if any(a > b for a, b in zip(s, FUNCTIONS_OVER.get(f, ceiling)))
    }
    assert not grown, f"functions over {FUNCTION_LINES} lines or {PARAMETERS} parameters (now, listed ceiling): {grown}"
    stale = sorted(f for f in FUNCTIONS_OVER if f not in over)
    assert not stale, f"within the limits now, take them off FUNCTIONS_OVER: {stale}"
