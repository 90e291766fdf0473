"""Datasets in the forms people keep them, checked against the model before any compile.

- a `.npz` of arrays, the model's input as it is: `x_train/y_train/x_val/y_val`, or `x/y` with the
  last 20 % as val; labels are class indices or class names; or a folder of the same arrays as
  `.npy` files (`x.npy`, `y.npy`, ...: what the `.npz` would zip), for arrays saved one by one;
- a folder of images, one subfolder per class (torchvision's ImageFolder), with `train/` and
  `val/` inside or a stratified split drawn for it;
- a CSV of `path,label` rows (optionally `,split`) naming images;
- text: a CSV with a `text,label` (optionally `,split`) header, or JSON Lines of the same keys.

Images become model inputs by a preprocessing spec (`planner.inputs.preprocess`), text by the
user's tokenizer file (`Tokenization`). Samples are read a batch at a time (`Split.batch`), never
the whole dataset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from planner.errors import BadInput
from planner.inputs.data._arrays import NPY, NPZ
from planner.inputs.data._base import Dataset, Format, PreprocessSpec, Rows, Split
from planner.inputs.data._images import CSV, IMAGES
from planner.inputs.data._text import TEXT, Tokenization
from planner.inputs.model import Model
from planner.tasks import task_named
from planner.types import Encoding

__all__ = [
    "FORMATS",
    "DataFormat",
    "Dataset",
    "Format",
    "Rows",
    "Split",
    "Tokenization",
    "bind_lengths",
    "input_encodings",
    "data_format",
    "format_named",
    "load_dataset",
]

# Every dataset format, in detection order: a path is the first whose `detect` takes it (a folder
# of `.npy` arrays before a folder of images, a text CSV before an image CSV, a `.npz` for the rest).
# A new format is one module and one line here (`Format`).
FORMATS: tuple[Format, ...] = (NPY, IMAGES, TEXT, CSV, NPZ)


def format_named(name: str) -> Format:
    """The format plan.json records as `name` (`dataset.format`)."""
    for f in FORMATS:
        if f.name == name:
            return f
    raise BadInput(f"unknown dataset format {name!r}; planner reads {', '.join(f.name for f in FORMATS)}")


class _Formats:
    """The registered formats by attribute (`DataFormat.TEXT`: upper-cased `name`) or by the name
    plan.json records (`DataFormat("text")`), for callers of the enum this once was."""

    def __call__(self, name: str) -> Format:
        return format_named(name)

    def __getattr__(self, attr: str) -> Format:
        for f in FORMATS:
            if f.name.upper() == attr:
                return f
        raise AttributeError(attr)

    def __iter__(self) -> Iterator[Format]:
        return iter(FORMATS)


DataFormat = _Formats()


def data_format(path: str | Path) -> Format:
    """What `path` holds, by what it is: the first of `FORMATS` that detects it (a folder of `.npy`
    arrays or of images, JSON Lines of text, a CSV of texts or of images by its header, else a `.npz`)."""
    path = Path(path)
    for f in FORMATS:
        if f.detect(path):
            return f
    raise BadInput(f"{path}: not a dataset planner reads ({', '.join(f.description for f in FORMATS)})")


def load_dataset(
    path: str | Path,
    model: Model,
    *,
    preprocess: PreprocessSpec = None,
    tokenizer: str | Path | Tokenization | None = None,
    classes: Sequence[str] | None = None,
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
    task: str | None = None,
) -> Dataset:
    """The dataset at `path`, checked against `model`, read by its format (`data_format`).

    - `preprocess`: for images, the spec (its text, a YAML path, steps, or a completed
      `Preprocess` as a plan records it); what it leaves open is completed from the model.
    - `tokenizer`: for text, the tokenizer.json (Hugging Face tokenizers) that makes it token ids,
      or the `Tokenization` a plan records.
    - `classes`: the class names a plan was made with, so that names map to the same indices.
    - `cache_dir`: where a compressed `.npz` is unpacked to be read by position.
    - `progress(done, total)`: samples checked so far (every sample is read once: values
      checked, images decoded), for a dataset that takes a while.
    - `task`: what the labels are for (`planner.tasks.TASKS`); None: inferred from the model's
      output and the labels.
    """
    path = Path(path)
    if not path.exists():
        raise BadInput(f"dataset not found: {path}")
    kind = data_format(path)
    if tokenizer is not None and not kind.tokenized:
        raise BadInput(
            f"{path} holds {kind.description}, not text: a `tokenizer` applies to text (a CSV with a text,label "
            "header, or .jsonl)"
        )
    known = tuple(classes) if classes is not None else None
    return kind.load(
        path,
        model.exported,  # data is what the ONNX file takes, whatever the step is given
        preprocess=preprocess,
        tokenizer=tokenizer,
        classes=known,
        cache_dir=cache_dir,
        progress=progress,
        task=task_named(task) if task is not None else None,
    )


def bind_lengths(model: Model, dataset: Dataset) -> Model:
    """`model` as `dataset` trains it: its dynamic lengths (a sequence length) set to those of the
    samples (`Model.bind`: a step is built for fixed shapes, as it is for a fixed batch), for the
    data's task."""
    model = model.with_task(dataset.task)
    if not model.unbound or not len(dataset.train):
        return model
    sample, _ = dataset.train.batch(np.arange(1))
    arrays = [sample] if isinstance(sample, np.ndarray) else list(sample)
    return model.bind([a.shape[1:] for a in arrays], str(dataset.source))


def input_encodings(model: Model, dataset: Dataset) -> dict[str, Encoding]:
    """How each float input of `model` is taken in 8 bits (`Model.encoded`): images as the pixels
    their preprocessing starts from (exact); arrays by the range of their training samples, one
    scale per input (a value outside it is clipped: the fine-tune measures what that costs), or as
    they are where they are 8-bit values saved as floats. A model computing its own loss takes its
    targets among its inputs: they stay float."""
    if not model.output.batched:
        return {}
    floats = [k for k, i in enumerate(model.inputs) if i.dtype == "float32" and i.batched and i.encoding is None]
    if dataset.preprocess is not None:
        spec = model.only_input
        return {spec.name: dataset.preprocess.pixel_encoding(int(spec.static[0]))} if floats else {}
    lo, hi, integral = {k: np.inf for k in floats}, {k: -np.inf for k in floats}, dict.fromkeys(floats, True)
    for x, _ in dataset.train.chunks(256) if floats else ():
        arrays = [x] if isinstance(x, np.ndarray) else list(x)
        for k in floats:
            lo[k], hi[k] = min(lo[k], float(arrays[k].min())), max(hi[k], float(arrays[k].max()))
            integral[k] = integral[k] and bool(np.all(arrays[k] == np.round(arrays[k])))
    return {model.inputs[k].name: Encoding.calibrated(lo[k], hi[k], integral[k]) for k in floats if lo[k] <= hi[k]}
