"""Text as people keep it — a CSV of `text,label` rows or JSON Lines — made token ids by the
user's own tokenizer.

Which ids a text becomes is fixed by the tokenizer the model was trained with, so planner never
splits words itself: it loads the user's `tokenizer.json` with Hugging Face `tokenizers` (the
library that wrote it, and that a board runs too) and sets only what the model fixes — every text
truncated and padded to the model's sequence length. What that takes (the file by its sha256,
the length, the padding and truncation sides, the pad id) is a `Tokenization`: recorded in
plan.json, and applied again by `planner run` with the plan's own copy of the file, so new text
becomes ids exactly as the measured text did.

A CSV is text data when its header names a `text` column (an image CSV's is `path,label`, or
none). Texts are few bytes next to images: all are tokenised once, up front, and kept as arrays.
"""

from __future__ import annotations

import csv
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import numpy as np
from tokenizers import Tokenizer

from planner.errors import BadInput, first_line
from planner.inputs.data._base import (
    STRATIFIED,
    Dataset,
    Format,
    PreprocessSpec,
    Progress,
    Rows,
    Samples,
    Split,
    check_train_labels,
    classes_only,
    csv_labels,
    embeddings,
    stratified_val,
)
from planner.inputs.data._corpus import CAUSAL_LM, is_corpus, load_corpus
from planner.inputs.model import Model
from planner.tasks import Task

TEXT_SUFFIXES = (".jsonl", ".txt")  # JSON Lines and corpora: text data by their name; a .csv is text data by its header
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # the names tokenizers gives what it makes
PAD_TOKENS = ("[PAD]", "<pad>")  # BERT's and SentencePiece models' padding tokens
ENCODE_CHUNK = 256  # texts tokenised between progress reports
Side = Literal["left", "right"]


@dataclass(frozen=True)
class Tokenization:
    """How a text becomes token ids: the tokenizer file (its sha256), truncating and padding every
    text to `max_length` tokens on the given sides, padding with `pad_id` (`pad_token`)."""

    path: Path
    sha256: str
    max_length: int
    padding: Side
    truncation: Side
    pad_id: int
    pad_token: str

    def to_json(self) -> dict:
        return {
            "source": str(self.path),
            "sha256": self.sha256,
            "max_length": self.max_length,
            "padding": self.padding,
            "truncation": self.truncation,
            "pad_id": self.pad_id,
            "pad_token": self.pad_token,
        }

    @classmethod
    def of_file(cls, path: str | Path, max_length: int | None, padded: bool = True) -> Tokenization:
        """The tokenizer at `path`, for texts of `max_length` tokens (None: a model of any length,
        and the tokenizer's own max length): its own padding and truncation sides when it sets
        them (else the right), its padding config's pad token, else its `[PAD]` or `<pad>`; none
        for a corpus (not `padded`: its chunks are always full), recorded as id 0 and token ""."""
        path = Path(path)
        tokenizer, sha256 = _read(path, None)
        padding, truncation = tokenizer.padding or {}, tokenizer.truncation or {}
        if max_length is None:
            if not truncation:
                raise BadInput(
                    f"{path}: the model takes texts of any length and the tokenizer sets no max length, so none fixes "
                    "the length the step is built for: set one (tokenizer.enable_truncation(max_length=...), then tokenizer.save)"
                )
            max_length = int(truncation["max_length"])
        if padding:
            pad_id, pad_token = int(padding["pad_id"]), str(padding["pad_token"])
        elif not padded:
            pad_id, pad_token = 0, ""
        else:
            found = [(i, t) for t in PAD_TOKENS if (i := tokenizer.token_to_id(t)) is not None]
            if not found:
                raise BadInput(
                    f"{path}: the tokenizer has no padding token ({' or '.join(PAD_TOKENS)}) and no padding config, and "
                    "every text must be padded to the model's length: add one (tokenizer.enable_padding(pad_id=..., "
                    "pad_token=...), then tokenizer.save)"
                )
            pad_id, pad_token = found[0]
        return cls(
            path=path,
            sha256=sha256,
            max_length=max_length,
            padding=cast(Side, padding.get("direction", "right")),
            truncation=cast(Side, truncation.get("direction", "right")),
            pad_id=pad_id,
            pad_token=pad_token,
        )

    @classmethod
    def from_json(cls, raw: dict, path: Path) -> Tokenization:
        """A recorded tokenization (plan.json's `dataset.tokenizer`), its file at `path`: the
        plan's own copy, checked against the recorded sha256 when it is read."""
        return cls(
            path=path,
            sha256=raw["sha256"],
            max_length=raw["max_length"],
            padding=raw["padding"],
            truncation=raw["truncation"],
            pad_id=raw["pad_id"],
            pad_token=raw["pad_token"],
        )

    def raw_tokenizer(self) -> tuple[Tokenizer, str]:
        """The file's tokenizer as it is (checked to be the one with this sha256) and its sha256."""
        return _read(self.path, self.sha256)

    def tokenizer(self) -> Tokenizer:
        """The file's tokenizer, checked to be the one with this sha256, set to make every text
        exactly `max_length` ids (its post-processor's special tokens included)."""
        tokenizer, _ = _read(self.path, self.sha256)
        tokenizer.enable_truncation(self.max_length, direction=self.truncation)
        tokenizer.enable_padding(direction=self.padding, pad_id=self.pad_id, pad_token=self.pad_token, length=self.max_length)
        return tokenizer


def _read(path: Path, sha256: str | None) -> tuple[Tokenizer, str]:
    """The tokenizer in `path` and the file's sha256 (read once: what is hashed is what is parsed)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"tokenizer file not found: {path}") from None
    except OSError as exc:
        raise BadInput(f"cannot read the tokenizer {path}: {exc.strerror or exc}") from None
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        raise BadInput(f"{path} is not the tokenizer the plan was made with (sha256 differs); re-copy or re-create the plan")
    try:
        return Tokenizer.from_str(data.decode()), digest
    except Exception as exc:  # tokenizers raises a bare Exception for anything it cannot parse
        raise BadInput(
            f"{path} is not a tokenizer file ({first_line(exc)}): give the tokenizer.json of Hugging Face tokenizers "
            "the model was trained with"
        ) from None


def is_text_csv(path: Path) -> bool:
    """Whether the CSV at `path` is text data: its header names a `text` column."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            for row in csv.reader(f):
                if any(c.strip() for c in row):
                    return "text" in (c.strip().lower() for c in row)
    except (OSError, UnicodeDecodeError, csv.Error):
        pass  # the image CSV's reader says what is wrong with the file
    return False


@dataclass(frozen=True)
class _Record:
    where: str  # "row 3", "line 3": how the user finds it in the file
    text: str
    label: str
    split: str | None  # lower case, as given (train, val, or what load_text refuses)


def _csv(path: Path) -> list[_Record]:
    """Rows under a header naming `text` and `label` (and `split`: train or val) columns; other
    columns are the user's and are not read."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = [r for r in csv.reader(f) if any(c.strip() for c in r)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise BadInput(f"{path}: not a readable CSV ({exc})") from None
    if not rows:
        raise BadInput(f"{path} holds no texts: it needs a header text,label and a row per text")
    header = [c.strip().lower() for c in rows[0]]
    missing = [c for c in ("text", "label") if c not in header]
    if missing:
        raise BadInput(f"{path}: no {missing[0]} column; a text CSV's header is text,label (and optionally split)")
    column = {name: header.index(name) for name in ("text", "label", "split") if name in header}
    records = []
    for n, row in enumerate(rows[1:], 1):
        if len(row) != len(header):
            raise BadInput(
                f'{path}: row {n} has {len(row)} columns, the header {len(header)}; quote a text that holds commas ("a, b")'
            )
        split = row[column["split"]].strip().lower() if "split" in column else None
        records.append(_Record(f"row {n}", row[column["text"]], row[column["label"]].strip(), split))
    return records


def _jsonl(path: Path) -> list[_Record]:
    """One object per line: `"text"`, `"label"` (a class name or index) and optionally `"split"`."""
    records = []
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = list(f)
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: not a readable JSON Lines file ({exc})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise BadInput(f"{path}: line {n} is not JSON ({exc})") from None
        if not isinstance(item, dict):
            raise BadInput(f'{path}: line {n} is not an object; each line is {{"text": ..., "label": ...}}')
        for key in ("text", "label"):
            if key not in item:
                raise BadInput(f'{path}: line {n} has no "{key}"; each line is {{"text": ..., "label": ...}}')
        text, label, split = item["text"], item["label"], item.get("split")
        if not isinstance(text, str):
            raise BadInput(f"{path}: line {n}'s text is {type(text).__name__}, not a string")
        if isinstance(label, bool) or not isinstance(label, str | int):
            raise BadInput(f"{path}: line {n}'s label is {json.dumps(label)}; a label is a class name or a class index")
        if split is not None and not isinstance(split, str):
            raise BadInput(f"{path}: line {n}'s split is {json.dumps(split)}; use train or val")
        records.append(_Record(f"line {n}", text, str(label).strip(), split.strip().lower() if split is not None else None))
    return records


class TokenRows(Rows):
    """Tokenised texts: one array of ids, masks or type ids per model input, held whole."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays[0])

    def take(self, index: np.ndarray, rng: np.random.Generator | None = None) -> Samples:
        picked = tuple(a[np.asarray(index, np.int64)] for a in self.arrays)
        return picked[0] if len(picked) == 1 else picked


def text_length(model: Model, where: str | Path) -> int | None:
    """The tokens per text the model takes: its `input_ids`' length (None: a dynamic length, which
    the tokenizer's max length sets), every text input checked to be one that a tokenizer makes
    (by name), integer, and as long."""
    names = {i.name: i for i in model.inputs}
    if "input_ids" not in names or not names.keys() <= set(TEXT_INPUTS):
        raise BadInput(
            f"{where} holds text, tokenised into {', '.join(TEXT_INPUTS)}; {model.path.name}'s inputs are "
            f"{', '.join(names)}: text feeds a model whose inputs are named so (as Hugging Face exports them)"
        )
    ids = names["input_ids"]
    if len(ids.shape) != 1:
        raise BadInput(f"{model.path.name}: input 'input_ids' takes shape {ids.shape}; tokenised text is one row of ids a text")
    for spec in names.values():
        if not spec.integer:
            raise BadInput(f"{model.path.name}: input '{spec.name}' is {spec.dtype}; a tokenizer's {spec.name} are integers")
        if spec.shape != ids.shape:
            raise BadInput(
                f"{model.path.name}: input '{spec.name}' takes shape {spec.shape}, but 'input_ids' {ids.shape}: "
                f"the tokenizer makes one {spec.name} entry per token"
            )
    return ids.shape[0] if isinstance(ids.shape[0], int) else None


def load_text(
    path: Path, model: Model, tokenizer: str | Path | Tokenization, classes: tuple[str, ...] | None, progress: Progress = None
) -> Dataset:
    """A text CSV or JSON Lines file, checked, split and tokenised once (`tokenizer`: a
    tokenizer.json, or the `Tokenization` a plan records)."""
    length = text_length(model, path)
    spec = tokenizer if isinstance(tokenizer, Tokenization) else Tokenization.of_file(tokenizer, length)
    if length is not None and spec.max_length != length:
        raise BadInput(f"the recorded tokenization makes {spec.max_length} tokens a text; {model.path.name} takes {length}")
    tok = spec.tokenizer()
    table = embeddings(model).get("input_ids")
    vocabulary = tok.get_vocab_size(with_added_tokens=True)
    if table is not None and vocabulary > table.rows:
        raise BadInput(
            f"{spec.path}: the tokenizer's vocabulary has {vocabulary} tokens, but {model.path.name}'s embedding table "
            f"'{table.table}' has {table.rows} rows: it is not the tokenizer of this model"
        )
    records = _jsonl(path) if path.suffix.lower() == ".jsonl" else _csv(path)
    if not records:
        raise BadInput(f"{path} holds no texts: it needs rows text,label")
    for r in records:
        if not r.text.strip():
            raise BadInput(f"{path}: {r.where}'s text is empty")
        if not r.label:
            raise BadInput(f"{path}: {r.where} has no label")
    given = [r.split is not None for r in records]
    if any(given) and not all(given):
        first = records[given.index(False)]
        raise BadInput(f"{path}: {first.where} has no split, but others do; give every text a split (train or val), or none")
    for r in records:
        if r.split is not None and r.split not in ("train", "val"):
            raise BadInput(f"{path}: {r.where}'s split is {r.split!r}; use train or val")
    labels, named = csv_labels(path, [r.label for r in records], classes, model.n_classes)
    if all(given):
        val, split = np.array([r.split == "val" for r in records]), "the file's split column"
    else:
        val, split = stratified_val(labels), STRATIFIED

    made = {name: np.empty((len(records), spec.max_length), np.int64) for name in TEXT_INPUTS}
    for start in range(0, len(records), ENCODE_CHUNK):
        for i, r in enumerate(records[start : start + ENCODE_CHUNK], start):
            try:  # `encode`, not `encode_batch`: its thread pool would warn in every process planner forks later
                encoding = tok.encode(r.text)
            except Exception as exc:  # tokenizers raises a bare Exception (a length its special tokens do not fit)
                raise BadInput(
                    f"{path}: {r.where}: the tokenizer cannot make it {spec.max_length} tokens ({first_line(exc)})"
                ) from None
            made["input_ids"][i], made["attention_mask"][i] = encoding.ids, encoding.attention_mask
        if progress is not None:
            progress(min(start + ENCODE_CHUNK, len(records)), len(records))
    made["token_type_ids"][:] = 0  # one text, no pair: every token is of the first segment
    if table is not None:
        table.check(path, "the tokenised text", made["input_ids"])  # a padding id beyond the table

    digest = hashlib.sha256(json.dumps([str(TEXT), {**spec.to_json(), "source": None}]).encode())
    splits = {}
    for s, chosen in (("train", ~val), ("val", val)):
        index = np.flatnonzero(chosen)
        arrays = [made[i.name][index].astype(i.dtype) for i in model.inputs]
        digest.update(json.dumps([s, len(index)]).encode())
        for a in (*arrays, labels[index]):
            digest.update(a.tobytes())
        splits[s] = Split(TokenRows(arrays), labels[index])
    check_train_labels(path, splits["train"], splits["val"])
    return Dataset(
        source=path.resolve(),
        sha256=digest.hexdigest(),
        format=TEXT,
        train=splits["train"],
        val=splits["val"],
        n_classes=model.n_classes,
        classes=named,
        split=split,
        tokenizer=spec,
    )


class Text(Format):
    """JSON Lines, or a CSV whose header names a `text` column: made token ids by the user's tokenizer."""

    name = "text"
    description = "text"
    tokenized = True

    def detect(self, path: Path) -> bool:
        suffix = path.suffix.lower()
        return suffix in TEXT_SUFFIXES or suffix == ".csv" and is_text_csv(path)

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
            raise BadInput(f"{path}: a preprocessing spec applies to images; text is made token ids by its `tokenizer`")
        if tokenizer is None:
            raise BadInput(
                f"{path} holds text: give the `tokenizer` that makes it the model's token ids (the tokenizer.json "
                "of Hugging Face tokenizers the model was trained with)"
            )
        if task is CAUSAL_LM or (task is None and is_corpus(path)):
            length = text_length(model, path)
            spec = tokenizer if isinstance(tokenizer, Tokenization) else Tokenization.of_file(tokenizer, length, padded=False)
            return load_corpus(path, model, spec, progress)
        classes_only(path, "a text dataset", task)
        return load_text(path, model, tokenizer, classes, progress)


TEXT = Text()
