"""The command line's options for planner's settings, derived from `planner.Settings`: a setting
declared there (its type, default, check, help and flag) is an option of `planner plan` with no
word written here (and `_errors.FLAGS` names its flag in error messages)."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any

import typer

from planner.inputs.settings import Settings
from planner.search.samplers import SAMPLERS

# the `--sampler` choices: every sampler registered by name
SamplerName = StrEnum("SamplerName", {name: name for name in SAMPLERS})  # type: ignore[misc]  # members from the registry


def _budgets(text: str | None) -> list[str] | None:
    return None if text is None else [b for b in text.split(",") if b.strip()]


# settings whose command-line form differs from the API's: (its type there, its help, to the API's value)
_FORMS: dict[str, tuple[Any, str | None, Callable[[Any], Any]]] = {
    "sampler": (SamplerName, "; ".join(f"{name}: {s.help}" for name, s in SAMPLERS.items()), lambda v: v.value),
    "budgets": (str | None, None, _budgets),
}


def info(name: str) -> Any:
    """Setting `name`'s Typer option (`Annotated[TYPE, info(name)]` in a command's signature)."""
    field = Settings.model_fields[name]
    flag = Settings.flag(name)
    assert flag is not None, f"setting {name} has no flag"
    help_ = _FORMS[name][1] if name in _FORMS else None
    derived = f"--{name.replace('_', '-')}"  # (a bool keeps Typer's --NAME/--no-NAME pair)
    names = [] if flag == derived else [flag]
    shown = field.default is not None  # a None default's meaning is in its help
    return typer.Option(*names, help=help_ or field.description, show_default=shown)


def option(name: str) -> Any:
    """Setting `name` as a Typer option: `Annotated[type, typer.Option(...)]`, its type the
    command line's form of it."""
    kind = _FORMS[name][0] if name in _FORMS else Settings.model_fields[name].annotation
    return Annotated[kind, info(name)]


def default(name: str) -> Any:
    value = Settings.model_fields[name].default
    return SamplerName(value) if name == "sampler" else value


def cli_settings() -> tuple[str, ...]:
    """Every setting the command line sets."""
    return tuple(n for n in Settings.model_fields if Settings.flag(n) is not None)


def with_settings(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command`, whose last parameter is `settings: dict`, taking every setting of
    `cli_settings()` as an option instead and given them as that dict, in the API's form."""
    names = cli_settings()
    signature = inspect.signature(command)
    hints = typing.get_type_hints(command, include_extras=True)  # (a module's postponed annotations, evaluated)
    kept = [p.replace(annotation=hints[p.name]) for p in signature.parameters.values() if p.name != "settings"]
    added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=default(n), annotation=option(n)) for n in names]

    @functools.wraps(command)
    def run(**given: Any) -> Any:
        settings = {n: _FORMS[n][2](given.pop(n)) if n in _FORMS else given.pop(n) for n in names}
        return command(settings=settings, **given)

    params = sorted([*kept, *added], key=lambda p: p.kind)  # (keyword-only after the rest)
    run.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run
