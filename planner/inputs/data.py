"""Datasets: `.npz` files with train/val splits, checked against the model before any compile."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.digest import file_sha256
from planner.errors import BadInput
from planner.inputs.model import Model

VAL_FRACTION = 0.2


@dataclass(frozen=True)
class Dataset:
    source: Path
    sha256: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    n_classes: int

    def to_json(self) -> dict:
        return {
            "source": str(self.source),
            "n_train": int(len(self.y_train)),
            "n_val": int(len(self.y_val)),
            "n_classes": self.n_classes,
        }


def load_dataset(path: str | Path, model: Model) -> Dataset:
    """Load `x_train/y_train/x_val/y_val` as they are, or `x/y` with the last 20 % as val."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"dataset file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise BadInput(f"{path} is not a readable .npz dataset: {exc}") from None
    if {"x_train", "y_train", "x_val", "y_val"} <= arrays.keys():
        splits = [arrays[k] for k in ("x_train", "y_train", "x_val", "y_val")]
    elif {"x", "y"} <= arrays.keys():
        x, y = arrays["x"], arrays["y"]
        if y.ndim >= 1 and len(y) != len(x):
            raise BadInput(f"{path}: x holds {len(x)} samples but y holds {len(y)} labels")
        cut = len(x) - max(1, int(round(len(x) * VAL_FRACTION)))
        splits = [x[:cut], y[:cut], x[cut:], y[cut:]]
    else:
        raise BadInput(f"{path}: expected arrays x_train, y_train, x_val, y_val (or x, y); found {', '.join(arrays) or 'none'}")
    x_train, y_train, x_val, y_val = splits
    checked = []
    for name, x, y in (("train", x_train, y_train), ("val", x_val, y_val)):
        if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
            raise BadInput(f"{path}: {name} samples are {x.dtype}, not real numbers")
        if tuple(x.shape[1:]) != model.input_shape:
            raise BadInput(
                f"{path}: {name} samples have shape {tuple(x.shape[1:])}, the model's input "
                f"'{model.input_name}' needs {model.input_shape}"
            )
        y = _labels(path, name, x, y, model.n_classes)
        if not np.isfinite(x).all():
            raise BadInput(f"{path}: {name} samples contain NaN or Inf")
        with np.errstate(over="ignore"):
            x = x.astype(np.float32)  # what the model computes in
        if not np.isfinite(x).all():
            raise BadInput(f"{path}: {name} samples hold values beyond float32's range (about ±3.4e38)")
        checked += [x, y]
    x_train, y_train, x_val, y_val = checked
    if len(y_train) == 0 or len(y_val) == 0:
        raise BadInput(f"{path}: train and val splits must both be non-empty")
    if len(np.unique(y_train)) < 2:
        raise BadInput(
            f"{path}: every train label is {int(y_train[0])}: with a single class, fine-tuning learns nothing and "
            "accuracy cannot rank candidates"
        )
    return Dataset(
        source=path.resolve(),
        sha256=file_sha256(path),  # streamed: never a second copy of the file in memory
        x_train=x_train,
        y_train=y_train,
        x_val=x_val,
        y_val=y_val,
        n_classes=model.n_classes,
    )


def _labels(path: Path, name: str, x: np.ndarray, y: np.ndarray, n_classes: int) -> np.ndarray:
    """One class index per sample, as int64: integers, or floats that are whole numbers (labels
    often arrive as floats from pandas or MATLAB); anything else is one line saying what is wrong."""
    if y.ndim == 2 and len(y) == len(x) and y.shape[1] == n_classes:
        raise BadInput(
            f"{path}: {name} labels have shape {y.shape}, one-hot or scores; planner needs one class index "
            "per sample (store y.argmax(axis=1))"
        )
    if y.ndim != 1:
        raise BadInput(f"{path}: {name} labels have shape {y.shape}; planner needs one class index per sample, shape ({len(x)},)")
    if len(y) != len(x):
        raise BadInput(f"{path}: {name} has {len(x)} samples but {len(y)} labels")
    if np.issubdtype(y.dtype, np.floating):
        whole = np.isfinite(y) & (y == np.round(y))
        if not whole.all():
            i = int(np.argmin(whole))
            raise BadInput(f"{path}: {name} labels must be whole class indices; label {i} is {float(y[i]):g}")
    elif not np.issubdtype(y.dtype, np.integer):
        raise BadInput(f"{path}: {name} labels are {y.dtype}; planner needs class indices 0..{n_classes - 1} (integers)")
    if len(y) and (y.min() < 0 or y.max() >= n_classes):
        raise BadInput(
            f"{path}: {name} labels must lie in [0, {n_classes - 1}] for a model with "
            f"{n_classes} outputs; found {int(y.min())}..{int(y.max())}"
        )
    return y.astype(np.int64)
