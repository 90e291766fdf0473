"""`.npz` datasets (and folders of `.npy` files), read in place: samples by file position, never
the whole array in memory.

`np.load` of an `.npz` reads every array whole (a 390 MB file cost 1.2 GB of RSS). Instead the
zip's own layout is used: an uncompressed member (`np.savez`) is a `.npy` at a known offset in
the file, so sample i is `row_bytes` at `offset + i * row_bytes`, read with `pread` when a batch
asks for it — no memory map either, whose address space a process memory limit counts in full.
A compressed member (`np.savez_compressed`) cannot be read by position: it is unpacked once,
streamed, into the cache (verified against the zip's CRC-32 when reused) and read from there.

Labels are read whole (one int per sample, an eighth of a float sample at the least) and may be
class indices or class names (`np.array(["cat", "dog", ...])`), which are mapped and recorded.
"""

from __future__ import annotations

import functools
import hashlib
import json
import lzma
import os
import shutil
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

import numpy as np

from planner.cachefile import default_cache_dir
from planner.digest import file_sha256
from planner.errors import BadInput, EnvironmentFailure
from planner.inputs.data._base import (
    VAL_FRACTION,
    Dataset,
    Embedding,
    Format,
    PreprocessSpec,
    Progress,
    Rows,
    Split,
    check_train_labels,
    class_indices,
    embeddings,
)
from planner.inputs.model import Model
from planner.tasks import CLASSIFICATION, TASKS, Task, infer_task
from planner.types import ModelInput

if TYPE_CHECKING:
    from planner.inputs.data._text import Tokenization

CHUNK_BYTES = 8 << 20  # what a validation or unpacking pass holds at a time
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip member's local file header (30 bytes)


@dataclass(frozen=True)
class _Array:
    """A `.npy` in a file: where its rows start, and their shape and type."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop), one read."""
        with open(self.path, "rb") as f:
            return self._pread(f, start, stop)

    def _pread(self, f: IO[bytes], start: int, stop: int) -> np.ndarray:
        n = (stop - start) * self.row_bytes
        buf = os.pread(f.fileno(), n, self.offset + start * self.row_bytes)
        if len(buf) != n:
            raise EnvironmentFailure(f"{self.path} became shorter while planner was reading it")
        return np.frombuffer(buf, self.dtype).reshape(stop - start, *self.shape[1:])


class _ArrayRows(Rows):
    """Rows [start, stop) of an `_Array`, as `dtype` (the model input's): a batch is its runs of
    consecutive rows."""

    def __init__(self, array: _Array, start: int, stop: int, dtype: str = "float32") -> None:
        self.array, self.start, self.stop, self.dtype = array, start, stop, dtype

    def __len__(self) -> int:
        return self.stop - self.start

    def take(self, index: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        index = np.asarray(index, np.int64)
        out = np.empty((len(index), *self.array.shape[1:]), self.dtype)
        if not len(index):
            return out
        order = np.argsort(index, kind="stable")
        rows = index[order] + self.start
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1  # runs of consecutive rows: one read each
        with open(self.array.path, "rb") as f:
            for run_pos, run in zip(np.split(np.arange(len(rows)), breaks), np.split(rows, breaks)):
                out[order[run_pos]] = self.array._pread(f, int(run[0]), int(run[-1]) + 1)
        return out


class _InputRows(Rows):
    """The rows of a model with several inputs: one `_ArrayRows` per input, taken together."""

    def __init__(self, parts: list[_ArrayRows]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return len(self.parts[0])

    def take(self, index: np.ndarray, rng: np.random.Generator | None = None) -> tuple[np.ndarray, ...]:
        return tuple(p.take(index) for p in self.parts)


def _npy_at(f: IO[bytes], path: Path, offset: int, name: str) -> _Array:
    f.seek(offset)
    try:
        version = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = header(f)
    except ValueError as exc:
        raise BadInput(f"{path}: {name} is not a readable array ({exc})") from None
    if dtype.hasobject:
        raise BadInput(
            f"{path}: {name} holds Python objects; store numbers, or labels as fixed-width strings (np.array(names, dtype=str))"
        )
    if fortran and len(shape) > 1:
        raise BadInput(f"{path}: {name} is stored column-major; save it with np.ascontiguousarray({name})")
    return _Array(path, f.tell(), tuple(shape), dtype)


LABELS = ("y", "y_train", "y_val")


def sample_names(model: Model) -> tuple[str, ...]:
    """The arrays that hold a model's samples: `x` for a model of one input, else one per input,
    named as the input (`input_ids`, `attention_mask`); each also as NAME_train and NAME_val.
    These and `LABELS` are the arrays read; others are ignored."""
    return ("x",) if len(model.inputs) == 1 else tuple(i.name for i in model.inputs)


def _wanted(model: Model) -> tuple[str, ...]:
    return (*(f"{n}{s}" for n in sample_names(model) for s in ("", "_train", "_val")), *LABELS)


# what zipfile and its decompressors raise on members they cannot read: damaged data, an
# encrypted member (RuntimeError), a method or flag it does not implement (Deflate64, patched data)
UNREADABLE = (zipfile.BadZipFile, zlib.error, lzma.LZMAError, EOFError, RuntimeError, NotImplementedError)


def _unpack(zf: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, into: Path) -> Path:
    """A compressed member as `into/NAME.npy` (streamed; `name` is one of `sample_names`, never the
    member's own path, which may climb out of the cache), reused when its CRC-32 still holds."""
    into.mkdir(parents=True, exist_ok=True)
    path = into / f"{name}.npy"
    if path.is_file() and path.stat().st_size == info.file_size:
        crc = 0
        with open(path, "rb") as f:
            while block := f.read(CHUNK_BYTES):
                crc = zlib.crc32(block, crc)
        if crc == info.CRC:
            return path
    fd, tmp = tempfile.mkstemp(dir=into, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as out, zf.open(info) as member:  # zipfile checks the CRC as it reads
            shutil.copyfileobj(member, out, CHUNK_BYTES)
        os.replace(tmp, path)
    except OSError as exc:
        raise EnvironmentFailure(f"cannot unpack {info.filename} into the cache {into}: {exc.strerror or exc}") from None
    except UNREADABLE as exc:
        raise BadInput(f"{zf.filename}: {info.filename} cannot be unpacked ({type(exc).__name__}: {exc})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _zipped(
    path: Path, scratch: Path, wanted: tuple[str, ...]
) -> tuple[dict[str, _Array], dict[str, np.ndarray], str, list[str]]:
    """A `.npz`: its sample arrays located (compressed ones unpacked into `scratch`), its label
    arrays read whole, the file's sha256, and the names of all its arrays."""
    sha256 = file_sha256(path)  # streamed: never a copy of the file in memory
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise BadInput(f"{path} is not a readable .npz dataset: {exc}") from None
    arrays, labels, names = {}, {}, []
    with zf, open(path, "rb") as raw:
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                continue
            name = info.filename[:-4]
            names.append(name)
            if name not in wanted:
                continue
            if info.flag_bits & 0x1:
                raise BadInput(f"{path}: {name} is encrypted; save the arrays with np.savez")
            if name in LABELS:
                labels[name] = _whole(path, name, functools.partial(zf.open, info))
            elif info.compress_type == zipfile.ZIP_STORED:
                raw.seek(info.header_offset)
                fields = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
                if fields[0] != 0x04034B50:
                    raise BadInput(f"{path} is not a readable .npz dataset: {info.filename}'s header is damaged")
                start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
                arrays[name] = _complete(path, name, _npy_at(raw, path, start, name), start + info.file_size)
            else:
                unpacked = _unpack(zf, info, name, scratch / "data" / sha256[:32])
                with open(unpacked, "rb") as f:
                    arrays[name] = _complete(path, name, _npy_at(f, unpacked, 0, name), unpacked.stat().st_size)
    return arrays, labels, sha256, names


def _unzipped(path: Path, wanted: tuple[str, ...]) -> tuple[dict[str, _Array], dict[str, np.ndarray], str, list[str]]:
    """A folder of `.npy` files, read as `_zipped` reads a `.npz`; its sha256 is of the name and
    sha256 of every array it reads."""
    arrays, labels, digest = {}, {}, hashlib.sha256()
    names = sorted(f.stem for f in path.glob("*.npy") if not f.name.startswith("."))
    for name in (n for n in names if n in wanted):
        file = path / f"{name}.npy"
        try:
            digest.update(json.dumps([name, file_sha256(file)]).encode())
            if name in LABELS:
                labels[name] = _whole(file, name, _reopener(file))
            else:
                with open(file, "rb") as f:
                    arrays[name] = _complete(file, name, _npy_at(f, file, 0, name), file.stat().st_size)
        except OSError as exc:
            raise BadInput(f"cannot read {file}: {exc.strerror or exc}") from None
    return arrays, labels, digest.hexdigest(), names


def _reopener(file: Path) -> Callable[[], IO[bytes]]:
    return lambda: open(file, "rb")


def _complete(path: Path, name: str, array: _Array, end: int) -> _Array:
    """`array`, checked to lie whole before `end`, where its file (or zip member) ends."""
    if array.offset + int(np.prod(array.shape, dtype=np.int64)) * array.dtype.itemsize > end:
        raise BadInput(f"{path}: {name} is cut short: its header promises more than the file holds")
    return array


def _whole(path: Path, name: str, opener: Callable[[], IO[bytes]]) -> np.ndarray:
    """The array `opener` opens, read whole (labels: a number or a name per sample)."""
    try:
        with opener() as f:
            _npy_at(f, path, 0, name)  # the header's checks, with their messages
        with opener() as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    except (OSError, ValueError, *UNREADABLE) as exc:
        raise BadInput(f"{path}: {name} is not a readable array ({exc})") from None


def load_arrays(
    path: Path,
    model: Model,
    classes: tuple[str, ...] | None,
    scratch: Path,
    progress: Progress = None,
    requested: Task | None = None,
) -> Dataset:
    """`x_train/y_train/x_val/y_val` as they are, or `x/y` with the last 20 % as val: the members
    of a `.npz`, or the `.npy` files of a folder. A model of several inputs takes one array per
    input instead of `x`, named as the input (`input_ids_train`, `attention_mask_train`, ...).
    Without labels (no `y`), the inputs are their own targets: an autoencoder's data; with `y_val`
    alone, 0/1 flags of the anomalous val samples (task `anomaly`: judged by ROC AUC). The labels
    say the task unless the user `requested` one (`planner.tasks.infer_task`)."""
    folder = path.is_dir()
    keys = sample_names(model)
    arrays, found_ys, sha256, names = _unzipped(path, _wanted(model)) if folder else _zipped(path, scratch, _wanted(model))
    found = arrays.keys() | found_ys.keys()
    xs: dict[str, list[tuple[_Array, int, int]]]  # split -> each input's (array, first row, end row)
    given = {f"{k}_{s}" for k in keys for s in ("train", "val")}
    # data without labels is an autoencoder's, or a model's that computes its own loss: for a model
    # that can be one (or is told it is)
    unlabelled = not found_ys and any(
        not t.labelled and (t is requested or (requested is None and t.refuses(model.output, model.inputs) is None))
        for t in TASKS.values()
    )
    flagged = given <= found and set(found_ys) == {"y_val"}  # normal train samples, val ones flagged
    if given | {"y_train", "y_val"} <= found or (given <= found and unlabelled) or flagged:
        xs = {s: [(a, 0, a.shape[0] if a.shape else 0) for a in (arrays[f"{k}_{s}"] for k in keys)] for s in ("train", "val")}
        ys = {s: found_ys[f"y_{s}"] for s in ("train", "val") if f"y_{s}" in found_ys}
        split = f"{keys[0]}_train/{keys[0]}_val as given"
        requested = requested or (TASKS["anomaly"] if flagged else None)
    elif {*keys, "y"} <= found or (keys[0] in found and unlabelled):
        y = found_ys.get("y", np.zeros(arrays[keys[0]].shape[:1]))
        n = arrays[keys[0]].shape[0] if arrays[keys[0]].shape else 0
        if y.ndim == 0:
            raise BadInput(f"{path}: y has shape (); planner needs one label per sample, shape ({n},)")
        if len(y) != n:
            raise BadInput(f"{path}: {keys[0]} holds {n} samples but y holds {len(y)} labels")
        cut = n - max(1, int(round(n * VAL_FRACTION)))
        xs = {"train": [(arrays[k], 0, cut) for k in keys], "val": [(arrays[k], cut, n) for k in keys]}
        ys = {"train": y[:cut], "val": y[cut:]} if "y" in found_ys else {}
        split = f"the last {VAL_FRACTION:.0%} of {keys[0]} as val"
    else:
        what = ".npy files" if folder else "arrays"
        wanted = ", ".join([*(f"{k}_train" for k in keys), "y_train", *(f"{k}_val" for k in keys), "y_val"])
        raise BadInput(f"{path}: expected {what} {wanted} (or {', '.join(keys)}, y); found {', '.join(names) or 'none'}")
    task = infer_task(str(path), ys.get("train"), model.output, model.inputs, requested.name if requested else None)
    named = [ys[s].dtype.kind in "US" and task is CLASSIFICATION for s in ys]
    if any(named):  # class names: mapped over both splits together, so an index means one class
        if not all(named):
            raise BadInput(f"{path}: one split's labels are names and the other's are numbers; use one kind")
        for s, [(_, start, stop), *_] in xs.items():
            if ys[s].shape != (stop - start,):
                raise BadInput(f"{path}: {s} labels have shape {ys[s].shape}; planner needs one class name per sample")
        both = [*_as_text(path, ys["train"]), *_as_text(path, ys["val"])]
        indices, classes = class_indices(path, both, classes, model.n_classes)
        ys = {"train": indices[: len(ys["train"])], "val": indices[len(ys["train"]) :]}
    splits, done, total = {}, 0, sum(stop - start for parts in xs.values() for _, start, stop in parts)
    tables = embeddings(model)
    for s, parts in xs.items():
        rows = []
        for key, spec, (array, start, stop) in zip(keys, model.inputs, parts):
            where = s if len(keys) == 1 else f"{key} ({s})"
            _check_samples(path, where, array, spec, parts[0][2] - parts[0][1], stop - start)
            for checked in _check_values(path, where, array, spec, start, stop, tables.get(spec.name)):
                done += checked
                if progress is not None:
                    progress(done, total)
            rows.append(_ArrayRows(array, start, stop, spec.dtype))
        labels = _labels(path, s, len(rows[0]), ys[s], model.output, task) if s in ys else task.unlabelled(len(rows[0]))
        splits[s] = Split(rows[0] if len(rows) == 1 else _InputRows(rows), labels)
    check_train_labels(path, splits["train"], splits["val"], task)
    return Dataset(
        source=path.resolve(),
        sha256=sha256,
        format=NPY if folder else NPZ,
        train=splits["train"],
        val=splits["val"],
        n_classes=model.n_classes,
        classes=classes,
        split=split,
        task=task,
    )


def _as_text(path: Path, names: np.ndarray) -> list[str]:
    """Class names as text: `U` arrays as they are, `S` (bytes) arrays decoded as UTF-8."""
    if names.dtype.kind == "U":
        return names.tolist()
    try:
        return [b.decode() for b in names.tolist()]
    except UnicodeDecodeError:
        raise BadInput(
            f"{path}: class names stored as bytes that are not UTF-8; store them as str (np.array(names, dtype=str))"
        ) from None


def _check_samples(path: Path, name: str, array: _Array, spec: ModelInput, n: int, count: int) -> None:
    """An input's array against the input it feeds (`n`: the samples the first input holds,
    `count`: this array's)."""
    if spec.integer and not np.issubdtype(array.dtype, np.integer) and array.dtype != np.bool_:
        raise BadInput(
            f"{path}: {name} samples are {array.dtype}; the model's input '{spec.name}' takes {spec.dtype} (ids, masks)"
        )
    if not np.issubdtype(array.dtype, np.number) and array.dtype != np.bool_ or np.issubdtype(array.dtype, np.complexfloating):
        raise BadInput(f"{path}: {name} samples are {array.dtype}, not real numbers")
    if len(array.shape) != 1 + len(spec.shape) or any(isinstance(d, int) and d != n for d, n in zip(spec.shape, array.shape[1:])):
        raise BadInput(
            f"{path}: {name} samples have shape {tuple(array.shape[1:])}, the model's input '{spec.name}' needs {spec.shape}"
        )
    if count != n:
        raise BadInput(f"{path}: {name} holds {count} samples, the first input's array {n}")


def _check_values(
    path: Path, name: str, array: _Array, spec: ModelInput, start: int, stop: int, embedding: Embedding | None = None
) -> Iterator[int]:
    """Every value finite and within float32 (what the model computes in) or, for an integer
    input, within its type and, for token ids, within the `embedding` table they index (a
    Gather reads past it or wraps a negative id, silently); a chunk at a time; yields the samples
    of each chunk checked."""
    step = max(1, CHUNK_BYTES // max(1, array.row_bytes))
    for lo in range(start, stop, step):
        chunk = array.read(lo, min(lo + step, stop))
        if spec.integer:
            if chunk.size and spec.dtype != "bool" and not np.can_cast(chunk.dtype, spec.dtype):
                info = np.iinfo(spec.dtype)
                if chunk.min() < info.min or chunk.max() > info.max:
                    raise BadInput(f"{path}: {name} holds values beyond {spec.dtype}, which the input '{spec.name}' takes")
            if embedding is not None and chunk.size:
                embedding.check(path, name, chunk)
            yield len(chunk)
            continue
        if not np.isfinite(chunk).all():
            raise BadInput(f"{path}: {name} samples contain NaN or Inf")
        with np.errstate(over="ignore"):
            if not np.isfinite(chunk.astype(np.float32)).all():
                raise BadInput(f"{path}: {name} samples hold values beyond float32's range (about ±3.4e38)")
        yield len(chunk)


def _labels(path: Path, name: str, n: int, y: np.ndarray, output: ModelInput, task: Task) -> np.ndarray:
    """The `name` split's labels as `task`'s targets: one line saying what is wrong otherwise."""
    if y.ndim == 0 or len(y) != n:
        raise BadInput(f"{path}: {name} has {n} samples but {len(y) if y.ndim else 'a scalar of'} labels")
    return task.targets(f"{path}: {name}", y, output)


class _Arrays(Format):
    """Arrays that are the model's input as they are: no preprocessing, no tokenizer."""

    description = "arrays"

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
        if preprocess is not None:
            raise BadInput(f"{path}: a preprocessing spec applies to images; arrays are the model's input as they are")
        return load_arrays(path, model, classes, cache_dir or default_cache_dir(), progress, task)


class NpyFolder(_Arrays):
    """A folder of `.npy` arrays (an unzipped `.npz`): one holding `x.npy` or `x_train.npy`."""

    name = "npy"
    description = "arrays in .npy files"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and any((path / f"{x}.npy").is_file() for x in ("x", "x_train"))


class Npz(_Arrays):
    """A `.npz` of arrays: any file no other format takes (last in `FORMATS`)."""

    name = "npz"

    def detect(self, path: Path) -> bool:
        return True

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
        if path.suffix.lower() == ".npy":
            raise BadInput(
                f"{path} holds one array; planner needs samples and labels: give the folder holding it with "
                "y.npy beside x.npy (or x_train.npy, y_train.npy, x_val.npy, y_val.npy), or np.savez('data.npz', x=x, y=y)"
            )
        return super().load(
            path,
            model,
            preprocess=preprocess,
            tokenizer=tokenizer,
            classes=classes,
            cache_dir=cache_dir,
            progress=progress,
            task=task,
        )


NPZ, NPY = Npz(), NpyFolder()
