"""Bad input, an unreachable board, a full disk: one clear line on stderr, its exit code, nothing half-written.

The table below is the one place these cases live: `planner plan` with each, its exit code (2 bad
input, 3 board/tracker unreachable) and the words its one line must hold, and what the output
directory holds afterwards (by default: nothing, it was never made).
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

from builders import blobs, free_port, keyword_texts, tiny_cnn, token_bag, word_tokenizer
from planner.inputs.data import load_dataset
from planner.inputs.model import load_model
from processes import planner

LEARNED_NOTHING = 4  # a plan is written; its fine-tune did not beat the start (README's exit codes)


@dataclass
class Case:
    args: list[str]  # after `planner plan`, without --out
    expected: str  # words the one stderr line must hold
    code: int = 2
    out: Path | None = None  # --out [default: a fresh directory that must never be made]
    preexec_fn: Callable[[], None] | None = None  # runs in the child before planner starts
    after: Callable[[Path], None] | None = None  # checks OUT afterwards [default: OUT does not exist]
    env: dict[str, str] | None = None  # environment variables for the child
    notes: list[str] = field(default_factory=list)


class Ctx:
    def __init__(self, tmp: Path, model: Path, data: Path, request):
        self.tmp, self.model, self.data, self.request = tmp, model, data, request

    def fixture(self, name: str):
        return self.request.getfixturevalue(name)

    def plan(self, *args: str) -> list[str]:
        """`--model M --data D` (the tiny ones unless given) plus `args`."""
        model = [] if "--model" in args else ["--model", str(self.model)]
        data = [] if "--data" in args else ["--data", str(self.data)]
        return [*model, *data, *args]

    def npz(self, name: str, **arrays) -> str:
        """The tiny dataset with some of its arrays (x, y) replaced."""
        return str(blobs(self.tmp / f"{name}.npz", **arrays))

    def images(self, name: str, n_classes: int = 3, per_class: int = 4) -> Path:
        """A folder of small PNGs, one subfolder per class (c0, c1, ...)."""
        root = self.tmp / name
        rng = np.random.default_rng(0)
        for c in range(n_classes):
            (root / f"c{c}").mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 256, (6, 6), dtype=np.uint8)).save(root / f"c{c}" / f"{i}.png")
        return root

    def csv(self, name: str, text: str) -> str:
        """`text` as labels.csv beside an image folder's class folders."""
        path = self.images(name) / "labels.csv"
        path.write_text(text)
        return str(path)

    def yaml(self, name: str, text: str) -> str:
        path = self.tmp / name
        path.write_text(text)
        return str(path)

    def text(self, name: str, text: str | None = None, *, tokenizer: str | None = None, model: str | None = None) -> list[str]:
        """`--model` a token_bag (ids and mask of 12, vocabulary 64), `--data` `name` holding
        `text` (default: 30 keyword texts as a CSV), `--tokenizer` one trained on those texts."""
        path = self.tmp / name
        if text is None:
            path.write_text("text,label\n" + "".join(f"{t},{c}\n" for t, c in keyword_texts(30)))
        else:
            path.write_text(text)
        if tokenizer is None:
            tokenizer = str(word_tokenizer(self.tmp / "tok.json", [t for t, _ in keyword_texts(30)]))
        model = model or str(token_bag(self.tmp / "bag.onnx"))
        return ["--model", model, "--data", str(path), "--tokenizer", tokenizer]

    def token_npz(self, name: str, length: int = 12, **arrays) -> list[str]:
        """`--model` a token_bag, `--data` token ids, masks and labels (some replaced by `arrays`)."""
        rng = np.random.default_rng(0)
        data = {
            "input_ids": rng.integers(0, 64, (60, 12)),
            "attention_mask": np.ones((60, length), np.int64),
            "y": np.arange(60) % 3,
            **arrays,
        }
        np.savez(self.tmp / name, **data)  # type: ignore[arg-type]
        return ["--model", str(token_bag(self.tmp / "bag.onnx")), "--data", str(self.tmp / name)]


CASES: dict[str, Callable[[Ctx], Case]] = {}


def case(name: str):
    def register(build: Callable[[Ctx], Case]) -> Callable[[Ctx], Case]:
        CASES[name] = build
        return build

    return register


def _x(ctx: Ctx) -> np.ndarray:
    with np.load(ctx.data) as npz:
        return npz["x"]


def _y(ctx: Ctx) -> np.ndarray:
    with np.load(ctx.data) as npz:
        return npz["y"]


# --- the model ---------------------------------------------------------------------------------


@case("missing model")
def _(ctx):
    return Case(ctx.plan("--model", str(ctx.tmp / "nope.onnx")), "model file not found")


@case("corrupt model")
def _(ctx):
    corrupt = ctx.tmp / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07this is not a protobuf" * 10)
    return Case(ctx.plan("--model", str(corrupt)), "not a valid ONNX model")


@case("truncated model")
def _(ctx):
    truncated = ctx.tmp / "truncated.onnx"
    truncated.write_bytes(ctx.model.read_bytes()[: ctx.model.stat().st_size // 2])
    return Case(ctx.plan("--model", str(truncated)), "not a valid ONNX model")


@case("an unnamed dynamic non-batch dim")
def _(ctx):
    dynamic = ctx.tmp / "dynamic.onnx"
    proto = onnx.load(ctx.model)
    proto.graph.input[0].type.tensor_type.shape.dim[2].Clear()  # neither a size nor a name
    onnx.save(proto, dynamic)
    return Case(ctx.plan("--model", str(dynamic)), "has an unnamed dynamic dimension")


@case("inputs sharing a dynamic length given arrays of two lengths")
def _(ctx):
    model = str(token_bag(ctx.tmp / "dynamic.onnx", length="sequence"))
    rng = np.random.default_rng(0)
    ids, mask = rng.integers(0, 64, (60, 12)), np.ones((60, 10), np.int64)
    np.savez(ctx.tmp / "two.npz", input_ids=ids, attention_mask=mask, y=np.arange(60) % 3)
    return Case(ctx.plan("--model", model, "--data", str(ctx.tmp / "two.npz")), "with sequence = 12 as in the other inputs")


@case("space lists a layer behind an op without gradient")
def _(ctx):
    blocked = tiny_cnn(ctx.tmp / "blocked.onnx", extra_op="Floor")
    space = ctx.yaml("c1.yaml", "name: c1\nlayers: [c1, fc]\n")
    return Case(
        ctx.plan("--model", str(blocked), "--space", space),
        "cannot train layer 'c1': node 'c1' (Conv) gets no gradient: its path to the output passes node 'blocker' (Floor)",
    )


@case("no layer trainable")
def _(ctx):
    proto = onnx.load(ctx.model)
    head = proto.graph.node[-1]
    head.output[0] = "pre"
    proto.graph.node.append(onnx.helper.make_node("Floor", ["pre"], ["logits"], name="floor"))
    onnx.save(proto, ctx.tmp / "floored.onnx")
    return Case(
        ctx.plan("--model", str(ctx.tmp / "floored.onnx")),
        "no layer of floored.onnx can be trained: node 'fc' (Gemm) gets no gradient: its path to the output passes node 'floor' (Floor)",
    )


@case("fixed batch outside the space")
def _(ctx):
    proto = onnx.load(ctx.model)
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    onnx.save(proto, ctx.tmp / "batch2.onnx")
    return Case(ctx.plan("--model", str(ctx.tmp / "batch2.onnx")), "batch2.onnx was exported for batch 2 only")


@case("external data missing")
def _(ctx):
    proto = onnx.load(ctx.model)
    onnx.save(proto, ctx.tmp / "ext.onnx", save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    (ctx.tmp / "ext.onnx.data").unlink()
    return Case(ctx.plan("--model", str(ctx.tmp / "ext.onnx")), "its weights are in 'ext.onnx.data', which is missing beside it")


@case("external data outside the model's folder")
def _(ctx):
    proto = onnx.load(ctx.model)
    (ctx.tmp / "inner").mkdir()
    onnx.save(proto, ctx.tmp / "inner" / "ext.onnx", save_as_external_data=True, location="ext.data", size_threshold=0)
    proto = onnx.load(ctx.tmp / "inner" / "ext.onnx", load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../ext.data"
    (ctx.tmp / "inner" / "ext.data").rename(ctx.tmp / "ext.data")
    onnx.save(proto, ctx.tmp / "inner" / "ext.onnx")
    return Case(ctx.plan("--model", str(ctx.tmp / "inner" / "ext.onnx")), "lies outside the model's folder")


# --- the data ----------------------------------------------------------------------------------


@case("data shape")
def _(ctx):
    return Case(ctx.plan("--data", str(blobs(ctx.tmp / "wrong_shape.npz", shape=(1, 8, 8)))), "needs (1, 6, 6)")


@case("flat samples")
def _(ctx):
    return Case(ctx.plan("--data", ctx.npz("flat", x=_x(ctx).reshape(240, -1))), "samples have shape (36,), the model's input")


@case("samples as strings")
def _(ctx):
    return Case(ctx.plan("--data", ctx.npz("strings", x=_x(ctx).astype(str))), "train samples are <U")


@case("samples as objects")
def _(ctx):  # a ragged list of images: numpy stores it as pickled objects
    ragged = np.empty(240, dtype=object)
    ragged[:] = [np.zeros((6, 6 + i % 2)) for i in range(240)]
    path = ctx.tmp / "ragged.npz"
    np.savez(path, x=ragged, y=_y(ctx))
    return Case(ctx.plan("--data", str(path)), "x holds Python objects; store numbers")


@case("complex samples")
def _(ctx):
    return Case(ctx.plan("--data", ctx.npz("complex", x=_x(ctx) * (1 + 1j))), "train samples are complex64, not real numbers")


@case("NaN in data")
def _(ctx):
    x = _x(ctx).copy()
    x.flat[5] = np.nan
    return Case(ctx.plan("--data", ctx.npz("nan", x=x)), "train samples contain NaN or Inf")


@case("Inf in data")
def _(ctx):
    x = _x(ctx).copy()
    x.flat[-5] = -np.inf  # in the val split
    return Case(ctx.plan("--data", ctx.npz("inf", x=x)), "val samples contain NaN or Inf")


@case("float64 beyond float32")
def _(ctx):
    x = _x(ctx).astype(np.float64)
    x.flat[7] = 1e300  # finite as float64, Inf once cast to the model's float32
    return Case(ctx.plan("--data", ctx.npz("huge", x=x)), "train samples hold values beyond float32's range")


@case("labels out of range")
def _(ctx):
    return Case(
        ctx.plan("--data", str(blobs(ctx.tmp / "bad_labels.npz", y=np.full(240, 7, dtype=np.int64)))), "labels must lie in [0, 2]"
    )


@case("fractional float labels")
def _(ctx):
    y = _y(ctx).astype(np.float64)
    y[3] = 1.5
    return Case(ctx.plan("--data", ctx.npz("fractions", y=y)), "train labels must be whole class indices; label 3 is 1.5")


@case("float targets shaped wrong for --task regression")
def _(ctx):
    y = np.random.default_rng(0).normal(size=(240, 2))
    return Case(
        ctx.plan("--data", ctx.npz("floats", y=y), "--task", "regression"),
        "train targets of shape (192, 2), but for regression the model's output [batch, 3] needs (192, 3)",
    )


@case("an unknown --task")
def _(ctx):
    return Case(ctx.plan("--task", "segmentation"), "--task must be one of classification, multilabel")


@case("--task reconstruction for a model that does not reconstruct its input")
def _(ctx):
    return Case(
        ctx.plan("--task", "reconstruction"),
        "cannot be trained for reconstruction: its output [batch, 3] is not shaped as its input [batch, 1, 6, 6]",
    )


@case("--task loss-in-model for a model whose first output is not a scalar")
def _(ctx):
    return Case(
        ctx.plan("--task", "loss-in-model"),
        "cannot be trained for loss-in-model: its output 'logits' is [batch, 3], not a scalar loss",
    )


@case("a model with two outputs, the first not a scalar loss")
def _(ctx):
    proto = onnx.load(ctx.model)
    proto.graph.output.append(onnx.helper.make_tensor_value_info("pre", onnx.TensorProto.FLOAT, ["N", 3]))
    proto.graph.node[-1].output[0] = "pre"
    proto.graph.node.append(onnx.helper.make_node("Identity", ["pre"], ["logits"], name="copy"))
    onnx.save(proto, ctx.tmp / "two.onnx")
    return Case(ctx.plan("--model", str(ctx.tmp / "two.onnx")), "found 2 outputs, the first of shape [N, 3]")


@case("a .npy instead of a .npz")
def _(ctx):
    path = ctx.tmp / "x.npy"
    np.save(path, _x(ctx))
    return Case(ctx.plan("--data", str(path)), "holds one array; planner needs samples and labels")


@case(".npy folder without labels")
def _(ctx):
    (ctx.tmp / "arrays").mkdir()
    np.save(ctx.tmp / "arrays" / "x.npy", _x(ctx))
    return Case(
        ctx.plan("--data", str(ctx.tmp / "arrays")), "expected .npy files x_train, y_train, x_val, y_val (or x, y); found x"
    )


@case(".npy folder with a truncated array")
def _(ctx):
    (ctx.tmp / "arrays").mkdir()
    np.save(ctx.tmp / "arrays" / "x.npy", _x(ctx))
    np.save(ctx.tmp / "arrays" / "y.npy", _y(ctx))
    x = ctx.tmp / "arrays" / "x.npy"
    x.write_bytes(x.read_bytes()[: x.stat().st_size // 2])
    return Case(ctx.plan("--data", str(ctx.tmp / "arrays")), "x is cut short: its header promises more than the file holds")


@case(".npy folder with object labels")
def _(ctx):
    (ctx.tmp / "arrays").mkdir()
    np.save(ctx.tmp / "arrays" / "x.npy", _x(ctx))
    np.save(ctx.tmp / "arrays" / "y.npy", np.array([f"c{i % 2}" for i in _y(ctx)], dtype=object), allow_pickle=True)
    return Case(ctx.plan("--data", str(ctx.tmp / "arrays")), "y holds Python objects; store numbers")


@case("more class names than outputs")
def _(ctx):
    return Case(
        ctx.plan("--data", ctx.npz("names", y=np.array(["ant", "cat", "dog", "owl"])[np.arange(240) % 4])),
        "4 classes, but the model has 3 outputs",
    )


@case("labels as booleans")
def _(ctx):
    return Case(ctx.plan("--data", ctx.npz("bools", y=_y(ctx) > 0)), "train labels are bool; planner needs class indices 0..2")


@case("corrupt image")
def _(ctx):
    root = ctx.images("corrupt")
    bad = root / "c1" / "1.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    return Case(ctx.plan("--data", str(root)), f"{bad}: not a readable image")


@case("truncated JPEG")
def _(ctx):
    root = ctx.images("truncated")
    cut = root / "c2" / "0.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(cut)
    cut.write_bytes(cut.read_bytes()[:300])
    return Case(ctx.plan("--data", str(root)), f"{cut}: not a readable image")


@case("image folder without class folders")
def _(ctx):
    root = ctx.tmp / "loose"
    root.mkdir()
    Image.new("L", (6, 6)).save(root / "a.png")
    return Case(ctx.plan("--data", str(root)), "has no class folders: an image dataset is one subfolder of images per class")


@case("empty class folder")
def _(ctx):
    root = ctx.images("hidden")
    (root / ".ipynb_checkpoints").mkdir()
    return Case(ctx.plan("--data", str(root)), ".ipynb_checkpoints holds no images")


@case("CSV naming a missing image")
def _(ctx):
    csv = ctx.csv("listed", "path,label\nc0/0.png,c0\nc1/9.png,c1\n")
    return Case(ctx.plan("--data", csv), "row 2 names c1/9.png, not found")


@case("CSV row without a label")
def _(ctx):
    return Case(
        ctx.plan("--data", ctx.csv("short-row", "c0/0.png,c0\nc1/0.png\n")), "row 2 has 1 columns; every row is path,label"
    )


@case("preprocessing for a .npz")
def _(ctx):
    return Case(ctx.plan("--preprocess", "Resize(6)"), "a preprocessing spec applies to images")


@case("unknown preprocessing step")
def _(ctx):
    return Case(ctx.plan("--data", str(ctx.images("sharpen")), "--preprocess", "Resize(6), Sharpen(2)"), "unknown step 'Sharpen'")


@case("preprocessing to a size the model does not take")
def _(ctx):
    return Case(
        ctx.plan("--data", str(ctx.images("crop")), "--preprocess", "CenterCrop(5)"),
        "the steps give 5x5 images; the model takes 6x6",
    )


@case("an image preprocessing cannot bring to the model's size")
def _(ctx):
    root = ctx.images("wide")
    wide = root / "c0" / "wide.png"
    Image.new("RGB", (12, 6)).save(wide)
    return Case(ctx.plan("--data", str(root), "--preprocess", "Resize(6)"), f"{wide}: preprocessed to 6x12, the model takes 6x6")


@case("preprocessing YAML that is not a list")
def _(ctx):
    spec = ctx.yaml("prep.yaml", "resize: 6\n")
    return Case(ctx.plan("--data", str(ctx.images("yaml")), "--preprocess", spec), "a preprocessing spec is a list of steps")


@case("preprocessing with ** arguments")
def _(ctx):
    return Case(
        ctx.plan("--data", str(ctx.images("kw")), "--preprocess", "Resize(6), Normalize(**stats)"),
        "write the arguments out; * and ** are not read",
    )


@case("preprocessing giving an argument twice")
def _(ctx):
    return Case(ctx.plan("--data", str(ctx.images("twice")), "--preprocess", "Resize(size=6, size=8)"), "gives an argument twice")


@case("Normalize with a NaN mean")
def _(ctx):
    spec = ctx.yaml("nan.yaml", "- Normalize: {mean: .nan, std: 0.5}\n")
    return Case(
        ctx.plan("--data", str(ctx.images("nan")), "--preprocess", spec),
        "Normalize.mean: Value error, must be finite numbers within float32's range",
    )


@case("class folder linking back to its parent")
def _(ctx):
    root = ctx.images("looped")
    (root / "c1" / "up").symlink_to(root, target_is_directory=True)
    return Case(ctx.plan("--data", str(root)), "a symbolic link loops or repeats a folder")


@case("CSV label beyond any integer type")
def _(ctx):
    csv = ctx.csv("huge-label", "c0/0.png,0\nc1/0.png,99999999999999999999\n")
    return Case(ctx.plan("--data", csv), "label 99999999999999999999 is beyond the model's 3 outputs")


@case("a single label for all samples")
def _(ctx):
    return Case(ctx.plan("--data", ctx.npz("scalar-y", y=np.int64(1))), "y has shape (); planner needs one label per sample")


@case("class names as bytes that are not UTF-8")
def _(ctx):
    names = np.array([b"caf\xe9", b"th\xe9"])[_y(ctx) % 2]
    return Case(ctx.plan("--data", ctx.npz("latin1", y=names)), "class names stored as bytes that are not UTF-8")


@case("one-hot labels")
def _(ctx):
    return Case(
        ctx.plan("--data", ctx.npz("onehot", y=np.eye(3)[_y(ctx)])), "one-hot or scores; planner needs one class index per sample"
    )


@case("fewer labels than samples")
def _(ctx):
    return Case(ctx.plan("--data", ctx.npz("short", y=_y(ctx)[:200])), "x holds 240 samples but y holds 200 labels")


@case("a single class")
def _(ctx):
    return Case(ctx.plan("--data", ctx.npz("one-class", y=np.zeros(240, dtype=np.int64))), "with a single class")


# --- text and token ids ------------------------------------------------------------------------


@case("a tokenizer larger than the model's embedding table")
def _(ctx):
    from tokenizers import Tokenizer

    big = word_tokenizer(ctx.tmp / "big.json", [t for t, _ in keyword_texts(30)], extra_words=64)
    size = Tokenizer.from_file(str(big)).get_vocab_size()
    return Case(
        ctx.text("texts.csv", tokenizer=str(big)),
        f"vocabulary has {size} tokens, but bag.onnx's embedding table 'embed' has 64 rows",
    )


@case("token ids beyond the embedding table")
def _(ctx):
    ids = np.random.default_rng(0).integers(0, 64, (60, 12))
    ids[7, 3] = 64
    return Case(ctx.token_npz("ids.npz", input_ids=ids), "holds token id 64, outside the model's embedding table 'embed'")


@case("an attention mask of the wrong shape")
def _(ctx):
    return Case(ctx.token_npz("mask.npz", length=10), "attention_mask (train) samples have shape (10,), the model's input")


@case("text for a model whose attention mask is not as long as its ids")
def _(ctx):
    model = str(token_bag(ctx.tmp / "short-mask.onnx", mask_length=10))
    return Case(ctx.text("texts.csv", model=model), "input 'attention_mask' takes shape (10,), but 'input_ids' (12,)")


@case("text for a model that takes no token ids")
def _(ctx):
    args = ctx.text("texts.csv", model=str(ctx.model))
    return Case(args, "tiny.onnx's inputs are x: text feeds a model whose inputs are named so")


@case("a text row without a label")
def _(ctx):
    return Case(ctx.text("texts.csv", "text,label\nthe ball,sport\nthe soup,\n"), "texts.csv: row 2 has no label")


@case("an empty text")
def _(ctx):
    return Case(
        ctx.text("texts.jsonl", '{"text": "the ball", "label": "sport"}\n{"text": " ", "label": "food"}\n'),
        "line 2's text is empty",
    )


@case("a JSON line without a label")
def _(ctx):
    return Case(
        ctx.text("texts.jsonl", '{"text": "the ball", "label": "sport"}\n{"text": "the soup"}\n'), 'line 2 has no "label"'
    )


@case("a text CSV without a label column")
def _(ctx):
    return Case(ctx.text("texts.csv", "text,class\nthe ball,sport\n"), "no label column; a text CSV's header is text,label")


@case("a tokenizer file that is not a tokenizer")
def _(ctx):
    return Case(ctx.text("texts.csv", tokenizer=ctx.yaml("tok.json", '{"vocab": [1, 2]}')), "tok.json is not a tokenizer file")


@case("a tokenizer without a padding token")
def _(ctx):
    unpadded = word_tokenizer(ctx.tmp / "unpadded.json", [t for t, _ in keyword_texts(30)], pad=None)
    return Case(ctx.text("texts.csv", tokenizer=str(unpadded)), "the tokenizer has no padding token ([PAD] or <pad>)")


@case("--tokenizer for data that is not text")
def _(ctx):
    tok = word_tokenizer(ctx.tmp / "tok.json", ["the ball"])
    return Case(ctx.plan("--tokenizer", str(tok)), "holds arrays, not text: a --tokenizer applies to text")


@case("text without --tokenizer")
def _(ctx):
    args = ctx.text("texts.csv")
    return Case(args[: args.index("--tokenizer")], "holds text: give the --tokenizer that makes it the model's token ids")


# --- target and space YAML ---------------------------------------------------------------------


@case("unknown target")
def _(ctx):
    return Case(ctx.plan("--target", "toaster"), "unknown target 'toaster'")


@case("target with a bad size")
def _(ctx):
    return Case(
        ctx.plan("--target", ctx.yaml("bad-target.yaml", "tvm_target: {kind: llvm}\nram_budget_bytes: lots\n")),
        "ram_budget_bytes",
    )


@case("target with tvm_target as a string")
def _(ctx):
    target = ctx.yaml("str-target.yaml", "tvm_target: llvm -mcpu=cortex-a72\nram_budget_bytes: 1GiB\n")
    return Case(ctx.plan("--target", target), "tvm_target: Value error, write it as a mapping like {kind: llvm")


@case("target with an unknown key")
def _(ctx):
    target = ctx.yaml("typo-target.yaml", "tvm_target: {kind: llvm}\nram_budget_bytes: 1GiB\nlatency_budget: 20\n")
    return Case(ctx.plan("--target", target), "latency_budget: Extra inputs are not permitted")


@case("target that is not a mapping")
def _(ctx):
    return Case(ctx.plan("--target", ctx.yaml("list-target.yaml", "- llvm\n- 1GiB\n")), "a target must be a YAML mapping")


@case("target that is not YAML")
def _(ctx):
    return Case(
        ctx.plan("--target", ctx.yaml("broken-target.yaml", "tvm_target: {kind: llvm\nram_budget_bytes: 1GiB\n")),
        "not valid YAML",
    )


@case("target that is a binary file")
def _(ctx):  # e.g. the model given as --target by mistake
    binary = ctx.tmp / "weights.yaml"
    binary.write_bytes(bytes(range(256)))
    return Case(ctx.plan("--target", str(binary)), "not a YAML target (the file is not text)")


@case("microcontroller target without its mcu section")
def _(ctx):
    target = ctx.yaml("mcu.yaml", "backend: c\nrunner: qemu\ntvm_target: {kind: llvm}\nram_budget_bytes: 256KiB\n")
    return Case(ctx.plan("--target", target), "the qemu runner needs an `mcu:` section")


@case("microcontroller target with OpenBLAS kernels")
def _(ctx):
    text = (Path(__file__).parent.parent / "hw_targets" / "cortex-m4-qemu.yaml").read_text()
    target = ctx.yaml("mcu-blas.yaml", text.replace("kernels: portable", "kernels: openblas"))
    return Case(ctx.plan("--target", target), "a microcontroller has no OpenBLAS; set `kernels: portable`")


@case("space with an unknown key")
def _(ctx):
    return Case(
        ctx.plan("--space", ctx.yaml("bad-space.yaml", "batch_size: [8]\nlayerz: [c1]\n")),
        "layerz: Extra inputs are not permitted",
    )


@case("space with a word for a number")
def _(ctx):
    space = ctx.yaml("word-space.yaml", "batch_size: [eight]\n")
    return Case(ctx.plan("--space", space), "batch_size.0: Input should be a valid integer")


@case("space with an infinite rank and an unknown mode")
def _(ctx):
    space = ctx.yaml("inf-space.yaml", "modes: [frozen, lora]\nranks: [4, .inf]\n")
    return Case(ctx.plan("--space", space), "rank must be a whole number from 1 (not inf)")


@case("space with no lr range for one of its optimizers")
def _(ctx):
    space = ctx.yaml("lr-space.yaml", "optimizer: [sgd, adam]\nlr:\n  sgd: {low: 0.01, high: 0.1}\n")
    return Case(ctx.plan("--space", space), "lr: no range for optimizer adam (give one per optimizer listed)")


@case("space with an lr range upside down")
def _(ctx):
    space = ctx.yaml("lr-order.yaml", "lr: {low: 0.1, high: 0.01}\n")
    return Case(ctx.plan("--space", space), "low (0.1) is above high (0.01)")


@case("space with an unknown mode")
def _(ctx):
    space = ctx.yaml("mode-space.yaml", "modes: [frozen, sideways]\n")
    return Case(ctx.plan("--space", space), "no update mode 'sideways': the modes are frozen, full, bias, weight, ratio, lora")


@case("space with a scalar for a list")
def _(ctx):
    return Case(
        ctx.plan("--space", ctx.yaml("scalar-space.yaml", "batch_size: eight\n")), "batch_size: Input should be a valid list"
    )


@case("space that is not a mapping")
def _(ctx):
    return Case(ctx.plan("--space", ctx.yaml("str-space.yaml", "per-layer\n")), "a search space must be a YAML mapping")


@case("space that is not YAML")
def _(ctx):
    return Case(ctx.plan("--space", ctx.yaml("tabs-space.yaml", "batch_size:\n\t- 8\n")), "not valid YAML")


@case("space that is a binary file")
def _(ctx):
    return Case(ctx.plan("--space", str(ctx.model)), "not a YAML search space (the file is not text)")


@case("precision the target lacks")
def _(ctx):
    return Case(
        ctx.plan("--space", ctx.yaml("fp16-space.yaml", "precision: [fp16]\n")),
        "proposes precision fp16; the target supports only",
    )


# --- boards ------------------------------------------------------------------------------------


@case("unreachable tracker")
def _(ctx):
    return Case(
        ctx.plan("--tracker", f"127.0.0.1:{free_port()}", "--key", "nobody"), "cannot reach the RPC tracker at 127.0.0.1:", code=3
    )


@case("tracker without boards of the key")
def _(ctx):
    tracker = ctx.fixture("rpc_tracker")  # a real tracker, no board registered
    return Case(ctx.plan("--tracker", tracker, "--key", "no-such-board"), "no board under key 'no-such-board'", code=3)


# --- flags: checked before anything runs, not after the last trial ------------------------------

for flag, value, words in (
    ("--accuracy-tolerance", "nan", "--accuracy-tolerance must lie in 0..1"),
    ("--accuracy-tolerance", "-5", "--accuracy-tolerance must lie in 0..1"),
    ("--seed", "-1", "--seed must lie in 0.."),
    ("--timeout", "-1", "--timeout must be a positive number of seconds"),
    ("--timeout", "inf", "--timeout must be a positive number of seconds"),
    ("--accuracy-steps", "-3", "--accuracy-steps must be at least 1"),
    ("--accuracy-steps", "0", "--accuracy-steps must be at least 1"),
    ("--trials", "0", "--trials must be at least 1"),
    ("--tune-trials", "-1", "--tune-trials must be 0"),
):
    case(f"{flag} {value}")(lambda ctx, flag=flag, value=value, words=words: Case(ctx.plan(flag, value), words))


# --- the environment ---------------------------------------------------------------------------


@case("compile cache is a file")
def _(ctx):
    file = ctx.tmp / "cache-file"
    file.write_text("not a directory\n")
    return Case(ctx.plan("--trials", "1"), f"cannot use the compile cache {file}", env={"PLANNER_CACHE_DIR": str(file)})


@case("read-only compile cache")
def _(ctx):
    ro = ctx.fixture("tmpfs")("ro,size=64k")
    if ro is None:
        pytest.skip("a read-only directory, as root, needs a read-only tmpfs mount, which this process cannot make")
    return Case(
        ctx.plan("--trials", "1"), f"cannot use the compile cache {ro}: read-only file system", env={"PLANNER_CACHE_DIR": str(ro)}
    )


@case("--out holds someone else's files")
def _(ctx):
    mine = ctx.tmp / "documents"
    mine.mkdir()
    (mine / "report.md").write_text("my own notes\n")
    return Case(
        ctx.plan("--trials", "1"),
        f"--out {mine} holds files planner did not write for a plan directory (report.md)",
        out=mine,
        after=lambda out: _unchanged(out / "report.md", "my own notes\n"),
    )


# --- the output directory ----------------------------------------------------------------------


@case("--out is a file")
def _(ctx):
    file = ctx.tmp / "plan.txt"
    file.write_text("not a directory\n")
    return Case(
        ctx.plan("--trials", "1"),
        f"--out {file} is a file, not a directory",
        out=file,
        after=lambda out: _unchanged(out, "not a directory\n"),
    )


@case("--out inside a file")
def _(ctx):
    file = ctx.tmp / "plan.txt"
    file.write_text("not a directory\n")
    return Case(
        ctx.plan("--trials", "1"), "not a directory", out=file / "p", after=lambda out: _unchanged(file, "not a directory\n")
    )


@case("read-only --out")
def _(ctx):
    """Not root: a directory without write permission. Root ignores permission bits, so there a
    read-only tmpfs (skipped when this process cannot mount one)."""
    if os.geteuid() != 0:
        ro = ctx.tmp / "ro"
        ro.mkdir(mode=0o555)
        return Case(
            ctx.plan("--trials", "1"),
            f"cannot write the plan into {ro / 'p'}: permission denied",
            out=ro / "p",
            after=lambda out: _no_files(out.parent),
        )
    ro = ctx.fixture("tmpfs")("ro,size=64k")
    if ro is None:
        pytest.skip("as root, a read-only directory needs a read-only tmpfs mount, which this process cannot make")
    return Case(
        ctx.plan("--trials", "1"),
        f"cannot write the plan into {ro / 'p'}: read-only file system",
        out=ro / "p",
        after=lambda out: _no_files(out.parent),
    )


@case("out of disk for the study")
def _(ctx):
    """The default storage, OUT/study.db, cannot be created: a 64 KiB tmpfs is full before the
    study's tables fit. SQLite says "database or disk is full"; planner says which directory."""
    disk = ctx.fixture("tmpfs")("size=64k")
    if disk is None:
        pytest.skip("needs a tmpfs mount (root); under RLIMIT_FSIZE SQLite reports EFBIG as a generic I/O error")
    out = disk / "p"
    return Case(
        ctx.plan("--trials", "1", "--accuracy-steps", "5"),
        f"cannot write the study storage into {out}: no space left on device (study.db)",
        out=out,
        after=lambda out: _no_files(disk),
    )


@case("out of disk for the plan files")
def _(ctx):
    """The study is elsewhere (--storage); the trials run; the plan files do not fit in OUT.

    With a tmpfs: a 64 KiB one. Without (not root, no CAP_SYS_ADMIN): RLIMIT_FSIZE in the child
    (Python ignores SIGXFSZ, so the write fails with EFBIG): a first run warms the compile cache
    and fills the study, so the limited run only writes the plan, whose largest file is over
    the limit."""
    storage = f"sqlite:///{ctx.tmp / 'study.db'}"
    args = ctx.plan("--trials", "1", "--accuracy-steps", "5", "--storage", storage)
    disk = ctx.fixture("tmpfs")("size=64k")
    if disk is not None:
        return Case(
            args,
            f"cannot write the plan into {disk / 'p'}: no space left on device (train_step.so); nothing was written",
            out=disk / "p",
            after=_no_files,
        )
    warm = planner("plan", *args, "--out", str(ctx.tmp / "warm"))
    assert warm.returncode == 0, warm.stderr
    sizes = {p.name: p.stat().st_size for p in (ctx.tmp / "warm").iterdir() if p.name != "study.db"}
    limit = max(sizes.values()) - 1
    if limit < (ctx.tmp / "study.db").stat().st_size + 65536:
        pytest.skip(f"no plan file is much larger than the study database ({sizes}): no RLIMIT_FSIZE splits them")
    biggest = max(sizes, key=sizes.get)
    return Case(
        args,
        f"cannot write the plan into {ctx.tmp / 'p'}: file too large",
        out=ctx.tmp / "p",
        after=_no_files,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
        notes=[f"limit {limit} < {biggest}"],
    )


@case("out of disk on a rerun")
def _(ctx):
    """A plan and its study fit; then the disk fills up (another program) and the same command,
    asked for more trials, cannot store them: one line, the earlier plan untouched, the study kept."""
    return _out_of_disk_on_a_rerun(ctx)


@case("out of disk on a rerun, two trials in flight")
def _(ctx):
    """The same with `--overlap`: the trials that cannot be stored run in threads of their own,
    and their failure is still the error (Optuna's own `n_jobs` dropped it)."""
    return _out_of_disk_on_a_rerun(ctx, "--overlap")


def _out_of_disk_on_a_rerun(ctx, *extra: str) -> Case:
    disk = ctx.fixture("tmpfs")("size=64m")
    if disk is None:
        pytest.skip("needs a tmpfs mount (root)")
    out = disk / "p"
    first = planner("plan", *ctx.plan("--trials", "1", "--accuracy-steps", "5"), "--out", str(out))
    assert first.returncode in (0, LEARNED_NOTHING), first.stderr  # five steps: a plan, learned or not
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass

    def after(out: Path) -> None:
        now = {p.name: p for p in out.iterdir()}
        assert now.keys() == before.keys(), sorted(now)  # no temporary directory, no new file
        for name, data in before.items():
            if name != "study.db":
                assert now[name].read_bytes() == data, f"{name} changed"

    return Case(
        ctx.plan("--trials", "3", "--accuracy-steps", "5", *extra),
        f"cannot write the study storage into {out}: no space left on device (study.db); the trials finished so far stay in study.db",
        out=out,
        after=after,
    )


def _unchanged(file: Path, text: str) -> None:
    assert file.read_text() == text


def _no_files(out: Path) -> None:
    """No plan and nothing half-written: OUT is gone or empty."""
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*")) if out.exists() else []
    assert not left, left


@pytest.mark.slow  # a process per row, ~2 s each; the fast tier keeps test_api's flag-mapping case
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_its_exit_code(name, tmp_path, tiny_model, tiny_data, request):
    c = CASES[name](Ctx(tmp_path, tiny_model, tiny_data, request))
    out = c.out or tmp_path / "plan-out"
    res = planner("plan", *c.args, "--out", str(out), preexec_fn=c.preexec_fn, env=c.env)
    assert res.returncode == c.code, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and c.expected in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    if c.after is not None:
        c.after(out)
    else:
        assert not out.exists(), "a failed plan must not leave an output directory"
    print(f"{name}: exit {res.returncode}: {lines[0]}", *c.notes)


def test_whole_float_labels_and_float64_samples_are_accepted(tmp_path, tiny_model, tiny_data):
    with np.load(tiny_data) as npz:
        x, y = npz["x"], npz["y"]
    path = blobs(tmp_path / "floats.npz", x=x.astype(np.float64), y=y.astype(np.float64))
    ds = load_dataset(path, load_model(tiny_model))
    x_train, y_train = ds.train.batch(np.arange(len(ds.train)))
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    np.testing.assert_array_equal(np.concatenate([ds.train.labels, ds.val.labels]), y)


def test_inspect_names_the_blocking_node(tmp_path):
    blocked = tiny_cnn(tmp_path / "blocked.onnx", extra_op="Floor")
    res = planner("inspect", str(blocked), "--json")
    assert res.returncode == 0, res.stderr

    layers = {row["layer"]: row for row in json.loads(res.stdout)["layers"]}
    assert not layers["c1"]["trainable"] and "blocker" in layers["c1"]["reason"]
    assert layers["fc"]["trainable"]  # downstream of the blocker: still trainable
    assert layers["c1"]["params"] == {"c1.w": [4, 1, 3, 3], "c1.b": [4]}
    assert layers["c1"]["param_bytes"] == (36 + 4) * 4
    assert layers["c1"]["output_shape"] == ["N", 4, 6, 6]


def test_no_feasible_plan_exits_1(tmp_path, tiny_model, tiny_data):
    target = tmp_path / "tiny-ram.yaml"
    target.write_text("tvm_target: {kind: llvm}\nram_budget_bytes: 1KiB\n")
    res = planner(
        "plan",
        "--model",
        str(tiny_model),
        "--data",
        str(tiny_data),
        "--target",
        str(target),
        "--out",
        str(tmp_path / "p"),
        "--trials",
        "2",
        "--accuracy-steps",
        "5",
    )
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: no feasible plan")
    assert not (tmp_path / "p" / "plan.json").exists()


def test_run_without_a_plan_is_bad_input(tmp_path):
    res = planner("run", str(tmp_path))
    assert res.returncode == 2 and "holds no plan" in res.stderr
