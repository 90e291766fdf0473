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

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from planner.cachefile import default_cache_dir
from planner.errors import BadInput
from planner.inputs.data._arrays import load_arrays
from planner.inputs.data._base import DataFormat, Dataset, Rows, Split
from planner.inputs.data._images import load_images
from planner.inputs.data._text import TEXT_SUFFIXES, Tokenization, is_text_csv, load_text
from planner.inputs.model import Model
from planner.inputs.preprocess import Preprocess, Step, parse_spec

__all__ = ["DataFormat", "Dataset", "Rows", "Split", "Tokenization", "bind_lengths", "data_format", "load_dataset"]


def data_format(path: str | Path) -> DataFormat:
    """What `path` holds, by what it is: a folder of `.npy` arrays or of images, JSON Lines of text,
    a CSV of texts or of images (by its header), else a `.npz`."""
    path = Path(path)
    if path.is_dir():
        return DataFormat.NPY if any((path / f"{x}.npy").is_file() for x in ("x", "x_train")) else DataFormat.IMAGES
    if path.suffix.lower() in TEXT_SUFFIXES:
        return DataFormat.TEXT
    if path.suffix.lower() == ".csv":
        return DataFormat.TEXT if is_text_csv(path) else DataFormat.CSV
    return DataFormat.NPZ


def load_dataset(
    path: str | Path,
    model: Model,
    *,
    preprocess: str | Path | Sequence[Step] | Preprocess | None = None,
    tokenizer: str | Path | Tokenization | None = None,
    classes: Sequence[str] | None = None,
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Dataset:
    """The dataset at `path`, checked against `model`.

    - `preprocess`: for images, the spec (its text, a YAML path, steps, or a completed
      `Preprocess` as a plan records it); what it leaves open is completed from the model.
    - `tokenizer`: for text, the tokenizer.json (Hugging Face tokenizers) that makes it token ids,
      or the `Tokenization` a plan records.
    - `classes`: the class names a plan was made with, so that names map to the same indices.
    - `cache_dir`: where a compressed `.npz` is unpacked to be read by position.
    - `progress(done, total)`: samples checked so far (every sample is read once: values
      checked, images decoded), for a dataset that takes a while.
    """
    path = Path(path)
    if not path.exists():
        raise BadInput(f"dataset not found: {path}")
    kind = data_format(path)
    known = tuple(classes) if classes is not None else None
    if kind is DataFormat.TEXT:
        if preprocess is not None:
            raise BadInput(f"{path}: a preprocessing spec applies to images; text is made token ids by its `tokenizer`")
        if tokenizer is None:
            raise BadInput(
                f"{path} holds text: give the `tokenizer` that makes it the model's token ids (the tokenizer.json "
                "of Hugging Face tokenizers the model was trained with)"
            )
        return load_text(path, model, tokenizer, known, progress)
    if tokenizer is not None:
        raise BadInput(
            f"{path} holds {kind.description}, not text: a `tokenizer` applies to text (a CSV with a text,label "
            "header, or .jsonl)"
        )
    if path.suffix.lower() == ".npy":
        raise BadInput(
            f"{path} holds one array; planner needs samples and labels: give the folder holding it with "
            "y.npy beside x.npy (or x_train.npy, y_train.npy, x_val.npy, y_val.npy), or np.savez('data.npz', x=x, y=y)"
        )
    if kind.arrays:
        if preprocess is not None:
            raise BadInput(f"{path}: a preprocessing spec applies to images; arrays are the model's input as they are")
        return load_arrays(path, model, known, cache_dir or default_cache_dir(), progress)
    if isinstance(preprocess, str | Path):
        steps = parse_spec(preprocess)
    else:
        steps = list(preprocess.steps if isinstance(preprocess, Preprocess) else preprocess or [])
    where = "--preprocess" if not isinstance(preprocess, Preprocess) else "the recorded preprocessing"
    return load_images(path, model, Preprocess.complete(steps, model.image_shape, where), known, progress)


def bind_lengths(model: Model, dataset: Dataset) -> Model:
    """`model` with its dynamic lengths (a sequence length) set to those of `dataset`'s samples
    (`Model.bind`): a step is built for fixed shapes, as it is for a fixed batch."""
    if not model.unbound or not len(dataset.train):
        return model
    sample, _ = dataset.train.batch(np.arange(1))
    arrays = [sample] if isinstance(sample, np.ndarray) else list(sample)
    return model.bind([a.shape[1:] for a in arrays], str(dataset.source))
