"""The stored form of a step's weights: how a step takes them as inputs (int8 frozen weights with
their scales, the parts a mode splits a weight into) and gives them back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner import modes
from planner.modes import Layout

QMAX = 127  # symmetric int8: -127..127, so that negating a weight cannot overflow


def int8(name: str) -> str:
    """The int8 values of a weight stored quantized (frozen, or trained by an int8 candidate)."""
    return f"{name}@int8"


def scale(name: str) -> str:
    """The per-output-channel fp32 scales of a weight stored quantized."""
    return f"{name}@scale"


def origin(stored: str) -> str:
    """The initializer a step input stands for (`c.w@head` -> `c.w`, `c.w@head@int8` -> `c.w`)."""
    for part in ("int8", "scale", *modes.stored_suffixes()):
        if stored.endswith(f"@{part}"):
            return origin(stored[: -len(part) - 1])
    return stored


def scale_shape(shape: Sequence[int], axis: int) -> tuple[int, ...]:
    """One scale per output channel, shaped to broadcast against the weight."""
    return tuple(d if i == axis else 1 for i, d in enumerate(shape))


def quantize(weight: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8: `weight ≈ q * s`, |q| <= 127, the channel's largest |w| exact."""
    others = tuple(i for i in range(weight.ndim) if i != axis)
    peak = np.abs(weight).max(axis=others, keepdims=True).astype(np.float32)
    # an all-zero channel (a classifier initialised to zero): the least scale, so that a trained
    # weight's first update sets its own (`requantized` grows a scale, never shrinks it)
    s = np.where(peak > 0, peak / QMAX, np.finfo(np.float32).tiny).astype(np.float32)
    q = np.clip(np.rint(weight / s), -QMAX, QMAX).astype(np.int8)
    return q, s


def to_step(weights: dict[str, np.ndarray], layouts: dict[str, Layout], quantized: dict[str, int]) -> dict[str, np.ndarray]:
    """Initializers as the step takes them: each weight a mode reshapes as its parts (`layouts`,
    `planner.modes`), then each weight stored int8 (`quantized`: weight or part -> axis)."""
    out = dict(weights)
    for name, layout in layouts.items():
        if name in out:
            parts = modes.MODES[layout.mode].to_step(layout, name, out)
            del out[name]
            out.update(parts)
    for name, axis in quantized.items():
        if name in out:
            out[int8(name)], out[scale(name)] = quantize(out.pop(name), axis)
    return out


def from_step(parts: dict[str, np.ndarray], layouts: dict[str, Layout], quantized: dict[str, int]) -> dict[str, np.ndarray]:
    """The inverse of `to_step`: initializers by ONNX name, int8 weights as the values they stand
    for, reshaped weights made whole (adapters merged into their weights)."""
    out = dict(parts)
    for name in quantized:
        out[name] = out.pop(int8(name)).astype(np.float32) * out.pop(scale(name))
    for name, layout in layouts.items():
        mode = modes.MODES[layout.mode]
        weight = mode.from_step(layout, name, out)
        for part in mode.parts(layout, name, weight.shape):
            del out[part.name]
        out[name] = weight
    return out
