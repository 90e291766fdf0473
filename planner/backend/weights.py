"""How a step stores weights: ratio-split weights, and int8 frozen weights.

A step does not always take an ONNX initializer as it is. A weight updated by `ratio:r` arrives as
two tensors, its trainable head (first k output channels) and its frozen tail, concatenated inside
the graph. A frozen Conv/Gemm/MatMul weight of a candidate with `frozen_weights: int8` arrives as
int8 values plus one fp32 scale per output channel, dequantized inside the graph, so it occupies a
quarter of the board's RAM. This module is the one place that maps initializers to the step's
inputs and back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

QMAX = 127  # symmetric int8: -127..127, so that negating a weight cannot overflow


def head(name: str) -> str:
    """The trainable first channels of a ratio-updated weight."""
    return f"{name}@head"


def tail(name: str) -> str:
    """The frozen remaining channels of a ratio-updated weight."""
    return f"{name}@tail"


def int8(name: str) -> str:
    """The int8 values of a frozen weight stored quantized."""
    return f"{name}@int8"


def scale(name: str) -> str:
    """The per-output-channel fp32 scales of a frozen weight stored quantized."""
    return f"{name}@scale"


def origin(stored: str) -> str:
    """The initializer a step input stands for (`c.w@head` -> `c.w`)."""
    for part in ("@head", "@tail", "@int8", "@scale"):
        if stored.endswith(part):
            return stored[: -len(part)]
    return stored


def scale_shape(shape: Sequence[int], axis: int) -> tuple[int, ...]:
    """One scale per output channel, shaped to broadcast against the weight."""
    return tuple(d if i == axis else 1 for i, d in enumerate(shape))


def quantize(weight: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8: `weight ≈ q * s`, |q| <= 127, the channel's largest |w| exact."""
    others = tuple(i for i in range(weight.ndim) if i != axis)
    peak = np.abs(weight).max(axis=others, keepdims=True).astype(np.float32)
    s = np.where(peak > 0, peak / QMAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(weight / s), -QMAX, QMAX).astype(np.int8)
    return q, s


def to_step(
    weights: dict[str, np.ndarray], splits: dict[str, tuple[int, int]], quantized: dict[str, int]
) -> dict[str, np.ndarray]:
    """Initializers as the step takes them (`splits`: weight -> (axis, k); `quantized`: weight -> axis)."""
    out = dict(weights)
    for name, (axis, k) in splits.items():
        if name in out:
            out[head(name)], out[tail(name)] = np.split(out.pop(name), [k], axis=axis)
    for name, axis in quantized.items():
        if name in out:
            out[int8(name)], out[scale(name)] = quantize(out.pop(name), axis)
    return out


def from_step(
    parts: dict[str, np.ndarray], splits: dict[str, tuple[int, int]], quantized: dict[str, int]
) -> dict[str, np.ndarray]:
    """The inverse of `to_step`: initializers by ONNX name, int8 weights as the values they stand for."""
    out = dict(parts)
    for name, (axis, _) in splits.items():
        out[name] = np.concatenate([out.pop(head(name)), out.pop(tail(name))], axis=axis)
    for name in quantized:
        out[name] = out.pop(int8(name)).astype(np.float32) * out.pop(scale(name))
    return out
