"""A text corpus for next-token training (`causal-lm`): a `.txt`, or JSON Lines of `{"text"}`,
made token ids by the user's tokenizer and cut into chunks of the model's length.

On-device language-model personalisation trains on the user's own text, which has no labels:
each token's target is the token after it. The whole corpus is tokenised once (without the
special tokens a tokenizer adds around one text, and without truncation or padding: a chunk is
always full), cut into consecutive windows of the model's length plus one — the window's first
`length` ids are the input, its last `length` the targets — and the last fifth of the windows is
val, so val is text the fine-tune never read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from planner.errors import BadInput
from planner.inputs.data._base import VAL_FRACTION, Dataset, Progress, Split, check_train_labels, embeddings
from planner.inputs.model import Model
from planner.tasks import TASKS

CAUSAL_LM = TASKS["causal-lm"]


def corpus_texts(path: Path) -> list[str]:
    """The texts of a corpus: a `.txt` whole, or the `"text"` of each line of JSON Lines."""
    try:
        raw = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: not a readable text file ({exc})") from None
    if path.suffix.lower() != ".jsonl":
        return [raw]
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise BadInput(f"{path}: line {n} is not JSON ({exc})") from None
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise BadInput(f'{path}: line {n} has no "text" string; a corpus line is {{"text": ...}}')
        texts.append(item["text"])
    return texts


def is_corpus(path: Path) -> bool:
    """A `.txt`, or JSON Lines whose first object has a text and no label."""
    if path.suffix.lower() == ".txt":
        return True
    try:
        with open(path, encoding="utf-8-sig") as f:
            first = next((line for line in f if line.strip()), "")
        item = json.loads(first)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(item, dict) and "text" in item and "label" not in item


def load_corpus(path: Path, model: Model, spec, progress: Progress = None) -> Dataset:
    """The corpus at `path` in chunks of the model's length (`spec`: the `Tokenization`)."""
    from planner.inputs.data._text import TEXT, TEXT_INPUTS, TokenRows

    if (why := CAUSAL_LM.refuses(model.output, model.inputs)) is not None:
        raise BadInput(f"{path} is a corpus for next-token training, but {model.path.name} cannot be trained so: {why}")
    length = spec.max_length
    tok, _ = spec.raw_tokenizer()
    ids: list[int] = []
    texts = corpus_texts(path)
    for k, text in enumerate(texts):
        ids += tok.encode(text, add_special_tokens=False).ids
        if progress is not None:
            progress(k + 1, len(texts))
    n = (len(ids) - 1) // length  # windows of length + 1 tokens, consecutive: the last id of one starts the next
    if n < 2:
        raise BadInput(
            f"{path}: the corpus is {len(ids)} tokens, {'less than one chunk' if n < 1 else 'one chunk'} of the model's "
            f"{length} and one more: next-token training needs two chunks at the least (one to train, one to judge), "
            f"{2 * length + 1} tokens"
        )
    flat = np.asarray(ids[: n * length + 1], np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(flat, length + 1)[::length]
    made = {
        "input_ids": windows[:, :-1],
        "attention_mask": np.ones((n, length), np.int64),
        "token_type_ids": np.zeros((n, length), np.int64),
    }
    targets = windows[:, 1:].copy()
    table = embeddings(model).get("input_ids")
    if table is not None:
        table.check(path, "the tokenised corpus", flat)
    n_val = max(1, int(round(n * VAL_FRACTION)))
    digest = hashlib.sha256(json.dumps([str(TEXT), "corpus", {**spec.to_json(), "source": None}]).encode())
    digest.update(flat.tobytes())
    splits = {}
    for s, rows in (("train", slice(0, n - n_val)), ("val", slice(n - n_val, n))):
        arrays = [made[i.name][rows].astype(i.dtype) for i in model.inputs if i.name in TEXT_INPUTS]
        splits[s] = Split(TokenRows(arrays), targets[rows])
    check_train_labels(path, splits["train"], splits["val"], CAUSAL_LM)
    return Dataset(
        source=path.resolve(),
        sha256=digest.hexdigest(),
        format=TEXT,
        train=splits["train"],
        val=splits["val"],
        n_classes=model.n_classes,
        split=f"the corpus in {n} chunks of {length} + 1 tokens; the last {n_val} as val",
        tokenizer=spec,
        task=CAUSAL_LM,
    )
