"""Update modes: how a layer trains, each mode one module, registered here.

`MODES` maps a mode's name to its `UpdateMode` (`_base.py`), in the order `--help`, errors and the
docs list them. A new mode is a module beside these and one line below; search spaces, schemes,
plans, the step's stored weights and the reports take it from here.
"""

from __future__ import annotations

from planner.modes._base import Argument, LayerLike, Layout, Part, UpdateMode
from planner.modes.lora import Lora
from planner.modes.plain import Bias, Frozen, Full, Weight
from planner.modes.ratio import Ratio

# in the order they are listed, and tried: a parameter list that is a layer's weight and bias is `full`, not
# `weight` for a layer without a bias
MODES: dict[str, UpdateMode] = {m.name: m for m in (Frozen(), Full(), Bias(), Weight(), Ratio(), Lora())}
FROZEN = "frozen"


def get(name: str) -> UpdateMode:
    """The mode called `name`, or ValueError listing the modes."""
    mode = MODES.get(str(name))
    if mode is None:
        raise ValueError(f"no update mode '{name}': the modes are {', '.join(MODES)}")
    return mode


def plain() -> list[UpdateMode]:
    """The modes that carry no number and train something: those one choice gives every layer."""
    return [m for m in MODES.values() if m.argument is None and m.name != FROZEN]


def stored_suffixes() -> tuple[str, ...]:
    """Every suffix a reshaped weight's parts carry (`w@head`)."""
    return tuple(s for m in MODES.values() for s in m.suffixes)


__all__ = ["FROZEN", "MODES", "Argument", "LayerLike", "Layout", "Part", "UpdateMode", "get", "plain", "stored_suffixes"]
