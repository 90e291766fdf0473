"""Image datasets as people keep them: a folder per class, or a CSV of `path,label` rows.

The folder layout and its class order are torchvision's `ImageFolder`'s (class = subfolder,
sorted by name; files found by `os.walk`, sorted; the same extensions), so a head trained with
ImageFolder keeps its class indices. `DIR/train` and `DIR/val` are used as the splits when both
exist; otherwise 20 % of each class, drawn with a fixed seed, is val. Images are decoded with
Pillow and converted to RGB as torchvision's loader does, then preprocessed by the spec.

Every image is read once before any trial: its bytes go into the dataset's hash and it is
decoded and preprocessed, so a corrupt file or one the spec cannot bring to the model's size is
one line naming it, never a failure in the middle of a search. Preprocessed samples are kept in
a bounded cache (val first: it is evaluated by every trial); the rest are decoded per batch.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from planner.errors import BadInput
from planner.inputs.data._base import (
    STRATIFIED,
    Dataset,
    Format,
    PreprocessSpec,
    Progress,
    Rows,
    Split,
    check_train_labels,
    class_indices,
    classes_only,
    csv_labels,
    stratified_val,
)
from planner.inputs.model import Model
from planner.inputs.preprocess import Preprocess, parse_spec
from planner.tasks import Task

if TYPE_CHECKING:
    from planner.inputs.data._text import Tokenization

EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's
CACHE_BYTES = 64 << 20  # preprocessed samples kept in memory, per dataset
Image.MAX_IMAGE_PIXELS = 1 << 28  # Pillow's guard against decompression bombs, at 268 MP (its default warns at 89)


def decode(path: Path, data: bytes | None = None) -> Image.Image:
    """An RGB image (torchvision's `pil_loader`); anything Pillow cannot read is one BadInput line."""
    try:
        with Image.open(io.BytesIO(data) if data is not None else path) as image:
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise BadInput(f"{path}: not a readable image ({exc})") from None


class _Cache:
    """Preprocessed samples up to a byte budget, filled in order and never evicted: a fixed set
    stays hot (evicting under random access only thrashes), and memory stays bounded."""

    def __init__(self, budget: int) -> None:
        self.budget, self.used = budget, 0
        self.items: dict[tuple[str, int], np.ndarray] = {}

    def put(self, key: tuple[str, int], value: np.ndarray) -> None:
        if self.used + value.nbytes <= self.budget:
            self.items[key] = value
            self.used += value.nbytes


class _ImageRows(Rows):
    def __init__(self, name: str, files: list[Path], preprocess: Preprocess, shape: tuple[int, ...], cache: _Cache) -> None:
        self.name, self.files, self.preprocess, self.shape, self.cache = name, files, preprocess, shape, cache

    def __len__(self) -> int:
        return len(self.files)

    def sample(self, i: int, rng: np.random.Generator | None, data: bytes | None = None) -> np.ndarray:
        x = self.preprocess.apply(decode(self.files[i], data), rng)
        if x.shape != self.shape:
            h, w = x.shape[1:]
            raise BadInput(
                f"{self.files[i]}: preprocessed to {h}x{w}, the model takes {self.shape[1]}x{self.shape[2]}; "
                f"end the steps with CenterCrop({list(self.shape[1:])})"
            )
        return x

    def take(self, index: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        augment = rng is not None and self.preprocess.augments
        out = np.empty((len(index), *self.shape), np.float32)
        for k, i in enumerate(np.asarray(index).tolist()):
            cached = None if augment else self.cache.items.get((self.name, i))
            out[k] = cached if cached is not None else self.sample(i, rng if augment else None)
        return out


def _folder(root: Path) -> list[tuple[Path, str]]:
    """(file, class) as torchvision's ImageFolder finds them: classes sorted, files walked sorted."""
    try:
        classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    except OSError as exc:
        raise BadInput(f"cannot read the folder {root}: {exc.strerror}") from None
    if not classes:
        raise BadInput(f"{root} has no class folders: an image dataset is one subfolder of images per class")
    found, seen = [], set()
    for name in classes:
        walked = []
        for entry in os.walk(root / name, followlinks=True):  # a link back up the tree would list images again
            real = os.path.realpath(entry[0])
            if real in seen:
                raise BadInput(f"{entry[0]} is a folder already read ({real}): a symbolic link loops or repeats a folder")
            seen.add(real)
            walked.append(entry)
        walked.sort()  # as ImageFolder walks: sorted(os.walk(...))
        files = [Path(dirpath) / f for dirpath, _, names in walked for f in sorted(names) if f.lower().endswith(EXTENSIONS)]
        if not files:
            raise BadInput(
                f"{root / name} holds no images ({', '.join(e[1:] for e in EXTENSIONS)}); every class folder needs some"
            )
        found += [(f, name) for f in files]
    return found


def _csv(path: Path) -> tuple[list[tuple[Path, str]], list[str] | None]:
    """Rows `path,label` (a header row `path,label` is optional; a third column `split` of train/val
    chooses the split). Paths are relative to the CSV's folder."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = [r for r in csv.reader(f) if r and any(c.strip() for c in r)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise BadInput(f"{path}: not a readable CSV ({exc})") from None
    if rows and [c.strip().lower() for c in rows[0]] in (["path", "label"], ["path", "label", "split"]):
        rows = rows[1:]
    if not rows:
        raise BadInput(f"{path} lists no images: it needs rows path,label")
    width = len(rows[0])
    found, splits = [], []
    for line, row in enumerate(rows, 1):
        if len(row) != width or width not in (2, 3):
            raise BadInput(f"{path}: row {line} has {len(row)} columns; every row is path,label (or path,label,split)")
        file = Path(row[0].strip())
        file = file if file.is_absolute() else path.parent / file
        if not file.is_file():
            raise BadInput(f"{path}: row {line} names {row[0].strip()}, not found")
        found.append((file, row[1].strip()))
        if width == 3:
            if row[2].strip().lower() not in ("train", "val"):
                raise BadInput(f"{path}: row {line}'s split is {row[2].strip()!r}; use train or val")
            splits.append(row[2].strip().lower())
    return found, splits or None


def load_images(
    path: Path, model: Model, spec: Preprocess, classes: tuple[str, ...] | None, progress: Progress = None
) -> Dataset:
    """An image folder (or a CSV of `path,label`), listed, checked, hashed and decoded once."""
    if path.is_dir():
        kind: Format = IMAGES
        if (path / "train").is_dir() and (path / "val").is_dir():
            parts = {"train": _folder(path / "train"), "val": _folder(path / "val")}
            split = "train/ and val/ folders"
        else:
            listed = _folder(path)
            parts, split = {"all": listed}, ""
    else:
        kind = CSV
        listed, chosen = _csv(path)
        if chosen is not None:
            parts = {s: [item for item, c in zip(listed, chosen) if c == s] for s in ("train", "val")}
            split = "the CSV's split column"
        else:
            parts, split = {"all": listed}, ""
    names = [c for items in parts.values() for _, c in items]
    if kind is CSV:
        labels, named = csv_labels(path, names, classes, model.n_classes)
    else:
        labels, named = class_indices(path, names, classes, model.n_classes)
    if "all" in parts:
        val = stratified_val(labels)
        files = [f for f, _ in parts["all"]]
        index = {"train": np.flatnonzero(~val), "val": np.flatnonzero(val)}
        split = split or STRATIFIED
        groups = {s: ([files[i] for i in index[s]], labels[index[s]]) for s in index}
    else:
        n_train = len(parts["train"])
        groups = {
            "train": ([f for f, _ in parts["train"]], labels[:n_train]),
            "val": ([f for f, _ in parts["val"]], labels[n_train:]),
        }
    cache = _Cache(CACHE_BYTES)
    digest = hashlib.sha256(json.dumps([str(kind), spec.to_json()]).encode())
    splits, done, total = {}, 0, sum(len(files) for files, _ in groups.values())
    for s in ("val", "train"):  # val first: its samples are the ones every trial evaluates
        files, y = groups[s]
        rows = _ImageRows(s, files, spec, model.image_shape, cache)
        for i, file in enumerate(files):
            try:
                data = file.read_bytes()
            except OSError as exc:
                raise BadInput(f"{file}: cannot read it ({exc.strerror})") from None
            rel = os.path.relpath(file, path if path.is_dir() else path.parent)
            digest.update(json.dumps([s, rel, int(y[i]), hashlib.sha256(data).hexdigest()]).encode())
            cache.put((s, i), rows.sample(i, None, data))
            done += 1
            if progress is not None and (done % 64 == 0 or done == total):
                progress(done, total)
        splits[s] = Split(rows, y)
    check_train_labels(path, splits["train"], splits["val"])
    return Dataset(
        source=path.resolve(),
        sha256=digest.hexdigest(),
        format=kind,
        train=splits["train"],
        val=splits["val"],
        n_classes=model.n_classes,
        classes=named,
        preprocess=spec,
        split=split,
    )


class _Images(Format):
    """Image files, made the model's input by a preprocessing spec (what it leaves open completed
    from the model)."""

    preprocessed = True

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
        if isinstance(preprocess, str | Path):
            steps = parse_spec(preprocess)
        else:
            steps = list(preprocess.steps if isinstance(preprocess, Preprocess) else preprocess or [])
        where = "--preprocess" if not isinstance(preprocess, Preprocess) else "the recorded preprocessing"
        classes_only(path, "an image dataset", task)
        return load_images(path, model, Preprocess.complete(steps, model.image_shape, where), classes, progress)


class ImageFolder(_Images):
    """A folder of images, one subfolder per class: any folder the `.npy` arrays' format does not take."""

    name = "images"
    description = "an image folder"

    def detect(self, path: Path) -> bool:
        return path.is_dir()


class ImageCsv(_Images):
    """A CSV of `path,label` rows naming images: any `.csv` that is not text data."""

    name = "csv"
    description = "images listed in a CSV"

    def detect(self, path: Path) -> bool:
        return path.suffix.lower() == ".csv"


IMAGES, CSV = ImageFolder(), ImageCsv()
