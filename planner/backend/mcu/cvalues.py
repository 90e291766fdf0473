"""How a value and its type are written in the C a step is emitted as: one place for the driver,
the firmware's weights file and the emulated board's wire (a label's type)."""

from __future__ import annotations

import math


def ctype(dtype: str) -> str:
    return {
        "float32": "float",
        "float64": "double",
        "int64": "int64_t",
        "int32": "int32_t",
        "int8": "int8_t",
        "uint8": "uint8_t",
        "uint16": "uint16_t",
        "uint32": "uint32_t",
        "bool": "uint8_t",
    }[dtype]


def label_dtype(n_classes: int) -> str:
    """The smallest unsigned type that holds a class index: what a board's label buffer is (a
    label of 8 bytes would cost a batch of them 8x the SRAM for nothing)."""
    return "uint8" if n_classes <= 2**8 else "uint16" if n_classes <= 2**16 else "uint32"


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
