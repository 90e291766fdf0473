"""How a value and its type are written in the C a step is emitted as: one place for the driver,
the firmware's weights file and the emulated board's wire (a label's type)."""

from __future__ import annotations

import math

import numpy as np

from planner.types import StepSignature


def ctype(dtype: str) -> str:
    return {
        "float32": "float",
        "float64": "double",
        "int64": "int64_t",
        "int32": "int32_t",
        "int16": "int16_t",
        "int8": "int8_t",
        "uint8": "uint8_t",
        "uint16": "uint16_t",
        "uint32": "uint32_t",
        "bool": "uint8_t",
    }[dtype]


def label_dtype(sig: StepSignature) -> str:
    """What a board's target buffer holds: a class index in the smallest unsigned type that holds
    it (a label of 8 bytes would cost a batch of them 8x the SRAM for nothing), a per-token label
    (-100 for padding) in 16 or 32 bits, float targets as the step takes them."""
    target = sig.target
    if not target.integer:
        return target.dtype
    n = sig.output_shape[-1]
    if sig.task == "classification":
        return "uint8" if n <= 2**8 else "uint16" if n <= 2**16 else "uint32"
    return "int16" if n < 2**15 else "int32"


def target_size(sig: StepSignature) -> int:
    """Elements of one sample's target."""
    return int(np.prod(sig.target.static, dtype=np.int64))


def output_size(sig: StepSignature) -> int:
    """Elements of one sample's output."""
    return int(np.prod(sig.output_shape, dtype=np.int64))


def literal(v: float | int, dtype: str) -> str:
    """A constant's element as C writes it exactly: a float in hexadecimal, an infinity or NaN
    (an attention mask's -inf) as C99's <math.h> macros: Python's `-inf` is no C."""
    if dtype.startswith("float"):
        x = float(v)
        if not math.isfinite(x):
            word = "NAN" if math.isnan(x) else "-INFINITY" if x < 0 else "INFINITY"
            return word if dtype == "float32" else f"((double){word})"
        return x.hex() + ("f" if dtype == "float32" else "")
    return str(int(v))
