"""Text data: a CSV of `text,label` or JSON Lines, made token ids by the user's tokenizer.json.

The ids must be exactly those Hugging Face tokenizers makes when called directly with the same
length, sides and pad token (what a board running tokenizers would make); the split and the class
names follow the image CSV's rules; and a plan of text records its tokenizer, keeps a copy, and
`planner run` tokenises with that copy, reproducing the measured accuracy.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

import planner
from builders import KEYWORDS, keyword_texts, tiny_cnn, token_bag, word_tokenizer
from planner.errors import BadInput
from planner.inputs.data import DataFormat, data_format, load_dataset
from planner.inputs.defaults import DEFAULT_TARGET
from planner.inputs.model import load_model
from planner.plans.schema import SCHEMA_VERSION

LENGTH = 12  # token_bag's, and the PyTorch text families'


def _write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _direct(
    tokenizer: Path, texts: list[str], padding: str = "right", truncation: str = "right"
) -> tuple[np.ndarray, np.ndarray]:
    """What tokenizers itself makes of `texts` at the model's length: ids and attention masks."""
    tok = Tokenizer.from_file(str(tokenizer))
    tok.enable_truncation(LENGTH, direction=truncation)
    tok.enable_padding(length=LENGTH, pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]", direction=padding)
    encodings = [tok.encode(t) for t in texts]
    return np.array([e.ids for e in encodings]), np.array([e.attention_mask for e in encodings])


def _rows(n: int) -> list[dict]:
    """Keyword texts with an explicit split (every fifth is val), one of them holding a comma and
    quotes, which the CSV must quote and read back."""
    rows = [{"text": t, "label": c, "split": "val" if i % 5 == 4 else "train"} for i, (t, c) in enumerate(keyword_texts(n))]
    rows[1]["text"] = 'Ball, "goal" and the team'
    return rows


def test_csv_and_jsonl_tokenise_as_tokenizers_does(tmp_path):
    rows = _rows(40)
    tok = word_tokenizer(tmp_path / "tok.json", [r["text"] for r in rows])
    model = load_model(token_bag(tmp_path / "bag.onnx"))
    texts = {s: [r["text"] for r in rows if r["split"] == s] for s in ("train", "val")}
    lengths = [len(Tokenizer.from_file(str(tok)).encode(r["text"]).ids) for r in rows]
    assert min(lengths) < LENGTH < max(lengths)  # the data has texts to pad and texts to truncate
    loaded = {}
    for name, write in (("texts.csv", _write_csv), ("texts.jsonl", _write_jsonl)):
        path = write(tmp_path / name, rows)
        assert data_format(path) is DataFormat.TEXT
        ds = loaded[name] = load_dataset(path, model, tokenizer=tok)
        assert ds.format is DataFormat.TEXT and ds.split == "the file's split column"
        for s, split in (("train", ds.train), ("val", ds.val)):
            (ids, mask), _ = split.batch(np.arange(len(split)))
            want_ids, want_mask = _direct(tok, texts[s])
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(mask, want_mask)
            assert ids.dtype == mask.dtype == np.int64
        recorded = ds.to_json()["tokenizer"]
        assert recorded["sha256"] == hashlib.sha256(tok.read_bytes()).hexdigest()
        assert (recorded["max_length"], recorded["padding"], recorded["truncation"]) == (LENGTH, "right", "right")
        assert (recorded["pad_token"], recorded["pad_id"]) == ("[PAD]", Tokenizer.from_file(str(tok)).token_to_id("[PAD]"))
    # the same texts are the same training data, whichever file holds them
    assert loaded["texts.csv"].sha256 == loaded["texts.jsonl"].sha256

    # the tokenizer's own sides are kept; its length is the model's
    left = Tokenizer.from_file(str(tok))
    left.enable_padding(direction="left", pad_id=left.token_to_id("[PAD]"), pad_token="[PAD]")
    left.enable_truncation(max_length=5, direction="left")
    left.save(str(tmp_path / "left.json"))
    ds = load_dataset(tmp_path / "texts.csv", model, tokenizer=tmp_path / "left.json")
    (ids, mask), _ = ds.train.batch(np.arange(len(ds.train)))
    want_ids, want_mask = _direct(tmp_path / "left.json", texts["train"], padding="left", truncation="left")
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(mask, want_mask)
    assert ds.to_json()["tokenizer"]["padding"] == "left" and ds.sha256 != loaded["texts.csv"].sha256


def test_a_model_taking_token_type_ids_gets_zeros_and_a_bool_mask_bools(tmp_path):
    import onnx

    proto = onnx.load(token_bag(tmp_path / "bag.onnx"))
    proto.graph.input[1].type.tensor_type.elem_type = onnx.TensorProto.BOOL
    types = onnx.helper.make_tensor_value_info("token_type_ids", onnx.TensorProto.INT64, ["N", LENGTH])
    proto.graph.input.append(types)  # taken, and unused: the step feeds it all the same
    onnx.save(proto, tmp_path / "typed.onnx")
    rows = _rows(20)
    tok = word_tokenizer(tmp_path / "tok.json", [r["text"] for r in rows])
    ds = load_dataset(_write_csv(tmp_path / "texts.csv", rows), load_model(tmp_path / "typed.onnx"), tokenizer=tok)
    (ids, mask, type_ids), _ = ds.train.batch(np.arange(len(ds.train)))
    want_ids, want_mask = _direct(tok, [r["text"] for r in rows if r["split"] == "train"])
    np.testing.assert_array_equal(ids, want_ids)
    assert mask.dtype == np.bool_ and (mask == want_mask.astype(bool)).all()
    assert type_ids.dtype == np.int64 and not type_ids.any()


def test_a_model_of_any_length_takes_the_tokenizers_max_length(tmp_path):
    rows = _rows(20)
    tok = word_tokenizer(tmp_path / "tok.json", [r["text"] for r in rows])
    model = load_model(token_bag(tmp_path / "any.onnx", length="sequence"))
    texts = _write_csv(tmp_path / "texts.csv", rows)
    with pytest.raises(BadInput, match="the tokenizer sets no max length"):
        load_dataset(texts, model, tokenizer=tok)
    capped = Tokenizer.from_file(str(tok))
    capped.enable_truncation(max_length=8)
    capped.save(str(tmp_path / "capped.json"))
    ds = load_dataset(texts, model, tokenizer=tmp_path / "capped.json")
    (ids, mask), _ = ds.train.batch(np.arange(len(ds.train)))
    assert ids.shape == mask.shape == (len(ds.train), 8) and ds.to_json()["tokenizer"]["max_length"] == 8


def test_the_split_and_class_names_follow_the_image_csvs_rules(tmp_path):
    """No split column: the image CSV's stratified split, to the row; names sorted as the image
    CSV sorts them, whole numbers as class indices, a plan's names deciding the indices."""
    keywords = [KEYWORDS[c][0] for c in sorted(KEYWORDS)]
    labels = [sorted(KEYWORDS)[i % 3] for i in range(12)] + ["sport"] * 6  # 4, 4 and 10 of a class
    rows = [{"text": f"w{i} {keywords[sorted(KEYWORDS).index(c)]}", "label": c} for i, c in enumerate(labels)]
    tok = word_tokenizer(tmp_path / "tok.json", [r["text"] for r in rows])
    model = load_model(token_bag(tmp_path / "bag.onnx"))
    ds = load_dataset(_write_csv(tmp_path / "texts.csv", rows), model, tokenizer=tok)
    assert ds.classes == ("food", "music", "sport") and ds.split.startswith("stratified")
    vocab = Tokenizer.from_file(str(tok))
    (ids, _), _ = ds.val.batch(np.arange(len(ds.val)))
    text_val = sorted(int(vocab.id_to_token(int(i))[1:]) for i in ids[:, 1])  # each text's first word: w<row>
    for i in range(len(rows)):
        Image.new("L", (6, 6), i).save(tmp_path / f"{i}.png")
    images = tmp_path / "images.csv"
    images.write_text("".join(f"{i}.png,{c}\n" for i, c in enumerate(labels)))
    image_ds = load_dataset(images, load_model(tiny_cnn(tmp_path / "cnn.onnx")))
    image_val = sorted(int(Path(f).stem) for f in image_ds.val.rows.files)  # type: ignore[attr-defined]
    assert text_val == image_val and ds.classes == image_ds.classes

    numbered = [{"text": r["text"], "label": sorted(KEYWORDS).index(r["label"])} for r in rows]
    as_numbers = load_dataset(_write_jsonl(tmp_path / "numbers.jsonl", numbered), model, tokenizer=tok)
    assert as_numbers.classes is None
    np.testing.assert_array_equal(as_numbers.val.labels, ds.val.labels)
    four = load_model(token_bag(tmp_path / "four.onnx", n_classes=4))
    planned = load_dataset(tmp_path / "texts.csv", four, tokenizer=tok, classes=["ant", "food", "music", "sport"])
    np.testing.assert_array_equal(planned.val.labels, ds.val.labels + 1)
    with pytest.raises(BadInput, match="class 'sport' is not one the plan was made with"):
        load_dataset(tmp_path / "texts.csv", model, tokenizer=tok, classes=["food", "music"])


@pytest.mark.slow  # a two-trial study of a PyTorch export and three runs
def test_text_plans_records_its_tokenizer_and_runs_with_the_plans_copy(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
    import torch_families as tf

    rows = [{"text": t, "label": c} for t, c in keyword_texts(150)]
    texts = _write_csv(tmp_path / "texts.csv", rows)
    tok = word_tokenizer(tmp_path / "tok.json", [r["text"] for r in rows])
    sha256 = hashlib.sha256(tok.read_bytes()).hexdigest()
    result = planner.plan(
        model=tf.export("token_bag", "dynamo"),
        data=texts,
        tokenizer=tok,
        out=tmp_path / "plan",
        trials=2,
        accuracy_steps=60,
        latency_repeats=2,
    )
    assert result.plan is not None
    accuracy = result.plan.metrics.accuracy
    assert accuracy.after > accuracy.before + 0.2  # a keyword decides the class: fine-tuning learns it
    recorded = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert recorded["schema_version"] == SCHEMA_VERSION and recorded["dataset"]["format"] == "text"
    assert recorded["dataset"]["tokenizer"]["sha256"] == recorded["files"]["tokenizer.json"] == sha256
    assert (tmp_path / "plan" / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert "tokenised by tokenizer.json" in (tmp_path / "plan" / "report.md").read_text()

    # the plan tokenises with its own copy: the file it was made from may change or go
    word_tokenizer(tok, [r["text"] for r in rows], extra_words=20)
    assert hashlib.sha256(tok.read_bytes()).hexdigest() != sha256
    ran = planner.run(tmp_path / "plan", data=texts, steps=60, out=tmp_path / "ran")
    assert ran.after["accuracy"] == accuracy.after
    again = planner.run(tmp_path / "plan", data=_write_jsonl(tmp_path / "texts.jsonl", rows), steps=60, out=tmp_path / "ran")
    assert again.after["accuracy"] == accuracy.after

    # a re-targeted plan carries the tokenizer too
    retargeted = planner.compile(tmp_path / "plan", target=DEFAULT_TARGET, out=tmp_path / "retargeted")
    assert retargeted.files["tokenizer.json"] == sha256 and retargeted.dataset.tokenizer == result.plan.dataset.tokenizer

    swapped = tmp_path / "swapped"
    shutil.copytree(tmp_path / "plan", swapped)
    shutil.copyfile(tok, swapped / "tokenizer.json")
    with pytest.raises(BadInput, match="tokenizer.json is not the file this plan was written with"):
        planner.run(swapped, data=texts, steps=1, out=tmp_path / "never")
