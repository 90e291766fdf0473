"""What every dataset format becomes: two splits of samples read on demand, and their labels.

A dataset is never held whole in memory: a split holds its labels (one int64 per sample) and a
`Rows` that reads the samples a batch asks for — rows of an array file by position, or images
decoded and preprocessed. The fine-tune, the evaluation and `planner run` only ever ask for a
batch, so memory stays a few batches whatever the dataset's size.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import onnx

from planner.errors import BadInput
from planner.inputs.model import Model
from planner.inputs.preprocess import Preprocess, Step
from planner.tasks import CLASSIFICATION, Task

if TYPE_CHECKING:
    from planner.inputs.data._text import Tokenization

Progress = Callable[[int, int], None] | None  # (samples checked, of how many)
VAL_FRACTION = 0.2
SPLIT_SEED = 0  # the stratified split of a folder without train/ and val/: fixed, so `run` redraws it
# a preprocessing spec as `load_dataset` takes it: its text, a YAML path, steps, or a recorded `Preprocess`
PreprocessSpec = str | Path | Sequence[Step] | Preprocess | None
STRATIFIED = f"stratified: {VAL_FRACTION:.0%} of each class as val (seed {SPLIT_SEED})"


class Format(ABC):
    """A dataset format: how planner recognises a path as one (`detect`) and reads it (`load`).

    To add a format, write one module, `planner/inputs/data/_NAME.py`, holding a subclass of
    `Format` (its `name`, `description`, which samples it holds: `tokenized`, `preprocessed` or
    neither, and `detect` and `load`) and one instance of it; then add that instance, as one line,
    to `FORMATS` in `planner/inputs/data/__init__.py`. Detection tries `FORMATS` in order and the
    first whose `detect` accepts the path is its format, so place it before any format that would
    also take its paths. `name` is what plan.json records as `dataset.format`: never change one
    (plans on disk hold it), and give a new one to `DatasetInfo.format` (planner/plans/schema.py,
    then `python -m planner.plans.schema > docs/plan.schema.json`), which validates what a plan
    reads. Reports, `planner run` and the checks in `load_dataset` read only these attributes.
    """

    name: ClassVar[str]  # what plan.json records (`dataset.format`), and the dataset's hash covers
    description: ClassVar[str]  # what the format is, as a report says it
    tokenized: ClassVar[bool] = False  # text, made token ids by the user's tokenizer
    preprocessed: ClassVar[bool] = False  # images, made the model's input by a preprocessing spec

    @property
    def arrays(self) -> bool:
        """Samples stored as the model's input, neither tokenised nor preprocessed into it."""
        return not (self.tokenized or self.preprocessed)

    @abstractmethod
    def detect(self, path: Path) -> bool:
        """Whether `path` (which exists) holds this format, given no format before it in `FORMATS` does."""

    @abstractmethod
    def load(
        self,
        path: Path,
        model: Model,
        *,
        preprocess: PreprocessSpec,
        tokenizer: str | Path | Tokenization | None,
        classes: tuple[str, ...] | None,
        cache_dir: Path | None,
        progress: Progress,
        task: Task | None = None,
    ) -> Dataset:
        """The dataset at `path`, checked against `model` (the arguments of `load_dataset`; a
        `tokenizer` is given only to a `tokenized` format; `task` when the user named one)."""

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<data format {self.name}>"


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
    # each sample's target as its task reads it (`planner.tasks`): a class index (in the smallest
    # unsigned type that holds them), a 0/1 row, floats, a class per token; None where the inputs
    # are the targets (an autoencoder's reconstruction)
    labels: np.ndarray | None

    def __post_init__(self) -> None:
        # a byte per sample, not eight: the labels are the one part of a split held whole
        y = self.labels
        if y is not None and y.ndim == 1 and y.dtype.kind in "iu" and (not len(y) or y.min() >= 0):
            object.__setattr__(self, "labels", y.astype(np.min_scalar_type(int(y.max()) if len(y) else 0)))

    def __len__(self) -> int:
        return len(self.rows) if self.labels is None else len(self.labels)

    def batch(self, index: np.ndarray, augment: Sequence[int] | None = None) -> tuple[Samples, np.ndarray]:
        """Samples and targets `index`; `augment` (seed, step) seeds the training view's random steps,
        so a fine-tune draws the same augmentation whenever it is rerun or trained on."""
        rng = np.random.default_rng(list(augment)) if augment is not None else None
        x = self.rows.take(index, rng)
        if self.labels is None:
            return x, np.array(x, np.float32)  # a reconstruction's target: the input itself
        y = self.labels[index]
        return x, y.astype(np.int64) if y.dtype.kind in "iu" else y.astype(np.float32)

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
    format: Format
    train: Split
    val: Split
    n_classes: int
    classes: tuple[str, ...] | None = None  # class names by index, when the data names them
    preprocess: Preprocess | None = None  # images only: how a file becomes the model's input
    split: str = ""  # how train and val were drawn
    tokenizer: Tokenization | None = None  # text only: how a text becomes the model's token ids
    task: Task = CLASSIFICATION  # what the labels are (`planner.tasks`): inferred, or named by the user

    @property
    def judged(self) -> int:
        """How many values the val metric averages over (samples; a tagger's counted tokens): what
        its noise shrinks with."""
        return self.task.judged(self.val.labels, len(self.val))

    def check_batch(self, batch_size: int, whose: str) -> None:
        """Refuse a batch larger than the train split: its first step would hold fewer samples
        than the compiled step takes (and a batch of repeats is not the batch that was planned)."""
        if batch_size > len(self.train):
            raise BadInput(
                f"{whose} trains on batches of {batch_size}, but the train split of {self.source.name} holds "
                f"{len(self.train)} samples: add data, or use a batch of at most {len(self.train)}"
            )

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
            "tokenizer": self.tokenizer.to_json() if self.tokenizer is not None else None,
            "task": self.task.name,
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


def csv_labels(
    where: str | Path, names: Sequence[str], known: Sequence[str] | None, n_outputs: int
) -> tuple[np.ndarray, tuple[str, ...] | None]:
    """Labels as a CSV (or JSON Lines) holds them, all text: whole numbers throughout are class
    indices, as in a .npz (unless the plan names its classes); anything else is class names."""
    if known is None and all(re.fullmatch(r"\d+", n) for n in names):
        numbers = [int(n) for n in names]
        if numbers and max(numbers) >= n_outputs:
            raise BadInput(f"{where}: label {max(numbers)} is beyond the model's {n_outputs} outputs (0..{n_outputs - 1})")
        return np.array(numbers, np.int64), None
    return class_indices(where, names, known, n_outputs)


def stratified_val(labels: np.ndarray) -> np.ndarray:
    """Which samples are val: VAL_FRACTION of each class (at least one of a class with two or more),
    drawn with a fixed seed so every run of the same data draws the same."""
    rng = np.random.default_rng(SPLIT_SEED)
    val = np.zeros(len(labels), bool)
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        n = len(members)
        k = min(n - 1, max(1, int(round(n * VAL_FRACTION)))) if n > 1 else 0
        val[rng.permutation(members)[:k]] = True
    return val


# ops that carry token ids unchanged on their way to an embedding (GPT-2 reshapes them first)
_CARRY_IDS = frozenset({"Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})


@dataclass(frozen=True)
class Embedding:
    """The table an integer input indexes: a Gather of rows of an initializer, at the input's values."""

    table: str
    rows: int

    def check(self, where: str | Path, name: str, ids: np.ndarray) -> None:
        """Token ids `name` of `where` index rows of the table: 0 up to its row count."""
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.rows:
            raise BadInput(
                f"{where}: {name} holds token id {low if low < 0 else high}, outside the model's embedding table "
                f"'{self.table}' ({self.rows} rows: ids 0..{self.rows - 1}); these are not this model's token ids"
            )


def embeddings(model: Model) -> dict[str, Embedding]:
    """Each integer input that picks rows of a table (token ids: `Gather(embedding, input_ids)`),
    with the smallest such table. An id beyond it is no error to ONNX Runtime's or TVM's Gather,
    which read past the table or wrap a negative id, so data is checked against it here."""
    graph = model.proto.graph
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    users: dict[str, list[tuple[int, onnx.NodeProto]]] = defaultdict(list)
    for node in graph.node:
        for slot, name in enumerate(node.input):
            users[name].append((slot, node))
    found = {}
    for spec in (i for i in model.inputs if i.integer):
        tables: list[Embedding] = []
        carried, seen = [spec.name], {spec.name}
        while carried:
            for slot, node in users[carried.pop()]:
                table = node.input[0]
                if node.op_type == "Gather" and slot == 1 and table in shapes:
                    axis = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
                    tables.append(Embedding(table, int(shapes[table][axis])))
                elif node.op_type in _CARRY_IDS and slot == 0:
                    carried += [o for o in node.output if o not in seen]
                    seen.update(node.output)
        if tables:
            found[spec.name] = min(tables, key=lambda e: e.rows)
    return found


def check_train_labels(where: str | Path, train: Split, val: Split, task: Task = CLASSIFICATION) -> None:
    if len(train) == 0 or len(val) == 0:
        raise BadInput(f"{where}: train and val splits must both be non-empty")
    if train.labels is not None:
        task.check_train(str(where), train.labels)


def classes_only(where: str | Path, what: str, task: Task | None) -> None:
    """Refuse a task other than classification for data that holds class labels only."""
    if task is not None and task is not CLASSIFICATION:
        raise BadInput(
            f"{where}: {what} holds class labels; {task.name} reads a .npz (or a folder of .npy arrays) of its targets"
        )
