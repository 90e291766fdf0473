"""What every dataset format becomes: two splits of samples read on demand, and their labels.

A dataset is never held whole in memory: a split holds its labels (one int64 per sample) and a
`Rows` that reads the samples a batch asks for — rows of an array file by position, or images
decoded and preprocessed. The fine-tune, the evaluation and `planner run` only ever ask for a
batch, so memory stays a few batches whatever the dataset's size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from planner.errors import BadInput
from planner.inputs.preprocess import Preprocess

Progress = Callable[[int, int], None] | None  # (samples checked, of how many)
VAL_FRACTION = 0.2
SPLIT_SEED = 0  # the stratified split of a folder without train/ and val/: fixed, so `run` redraws it


class DataFormat(StrEnum):
    NPZ = "npz"  # arrays: the model's input as it is
    NPY = "npy"  # the same arrays as .npy files in a folder (an unzipped .npz)
    IMAGES = "images"  # one folder per class
    CSV = "csv"  # path,label rows next to the images

    @property
    def description(self) -> str:
        """What the format is, as a report says it."""
        return _DESCRIPTIONS[self]

    @property
    def arrays(self) -> bool:
        """Samples stored as the model's input, not images made into it by a preprocessing spec."""
        return self in (DataFormat.NPZ, DataFormat.NPY)


_DESCRIPTIONS = {
    DataFormat.NPZ: "arrays",
    DataFormat.NPY: "arrays in .npy files",
    DataFormat.IMAGES: "an image folder",
    DataFormat.CSV: "images listed in a CSV",
}


# A batch of samples: one array for a model of one input, else a tuple of one per input.
Samples = np.ndarray | tuple[np.ndarray, ...]


class Rows(ABC):
    """The samples of one split, read by index; each a model input (or one per input)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def take(self, index: np.ndarray, rng: np.random.Generator | None = None) -> Samples:
        """Samples `index`, in that order, in the model inputs' dtypes; `rng` draws the training
        view's augmentation (formats without augmentation ignore it)."""


@dataclass(frozen=True)
class Split:
    rows: Rows
    labels: np.ndarray  # one class index per sample, in the smallest unsigned type that holds them

    def __post_init__(self) -> None:
        # a byte per sample, not eight: the labels are the one part of a split held whole
        top = int(self.labels.max()) if len(self.labels) else 0
        object.__setattr__(self, "labels", self.labels.astype(np.min_scalar_type(top)))

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, index: np.ndarray, augment: Sequence[int] | None = None) -> tuple[Samples, np.ndarray]:
        """Samples and labels `index`; `augment` (seed, step) seeds the training view's random steps,
        so a fine-tune draws the same augmentation whenever it is rerun or trained on."""
        rng = np.random.default_rng(list(augment)) if augment is not None else None
        return self.rows.take(index, rng), self.labels[index].astype(np.int64)

    def chunks(self, size: int) -> Iterator[tuple[Samples, np.ndarray]]:
        """The whole split in file order, `size` samples at a time (evaluation's view)."""
        for start in range(0, len(self), size):
            yield self.batch(np.arange(start, min(start + size, len(self))))


@dataclass(frozen=True)
class Dataset:
    """A checked dataset. `sha256` covers what the model is trained on — the file(s), the labels
    and the preprocessing — so caches keyed by it are reused exactly when that is unchanged."""

    source: Path
    sha256: str
    format: DataFormat
    train: Split
    val: Split
    n_classes: int
    classes: tuple[str, ...] | None = None  # class names by index, when the data names them
    preprocess: Preprocess | None = None  # images only: how a file becomes the model's input
    split: str = ""  # how train and val were drawn

    def to_json(self) -> dict:
        return {
            "source": str(self.source),
            "format": str(self.format),
            "n_train": len(self.train),
            "n_val": len(self.val),
            "n_classes": self.n_classes,
            "classes": list(self.classes) if self.classes is not None else None,
            "preprocess": self.preprocess.to_json() if self.preprocess is not None else None,
            "split": self.split,
        }


def class_indices(
    where: str | Path, names: Sequence[str], known: Sequence[str] | None, n_outputs: int
) -> tuple[np.ndarray, tuple[str, ...]]:
    """Class names per sample -> (indices, classes). New data sorts its names as torchvision's
    ImageFolder does, so a head trained with it keeps its order; data for a plan uses the plan's
    names, so index k means the class it meant when the plan was measured."""
    if known is None:
        classes = tuple(sorted(set(names)))
    else:
        classes = tuple(known)
        unknown = sorted(set(names) - set(classes))
        if unknown:
            raise BadInput(
                f"{where}: class {unknown[0]!r} is not one the plan was made with ({', '.join(classes[:10])}"
                f"{', ...' if len(classes) > 10 else ''})"
            )
    if len(classes) > n_outputs:
        raise BadInput(f"{where}: {len(classes)} classes, but the model has {n_outputs} outputs")
    lookup = {c: i for i, c in enumerate(classes)}
    return np.fromiter((lookup[n] for n in names), np.int64, len(names)), classes


def check_train_labels(where: str | Path, train: Split, val: Split) -> None:
    if len(train) == 0 or len(val) == 0:
        raise BadInput(f"{where}: train and val splits must both be non-empty")
    if len(np.unique(train.labels)) < 2:
        raise BadInput(
            f"{where}: every train label is {int(train.labels[0])}: with a single class, fine-tuning learns nothing and "
            "accuracy cannot rank candidates"
        )
