"""Small ONNX models and datasets built in code for the tests (nothing is downloaded)."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops._op import OpRunUnaryNum
from onnx.reference.ops.op_conv_transpose import ConvTranspose as _ConvTranspose
from onnx.reference.ops.op_pad import Pad_18 as _Pad
from onnx.reference.ops.op_rnn import RNN_14

from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.inputs.model import Model, load_model
from planner.runtime.session import TrainingSession
from planner.types import Candidate, StepSignature


def tiny_cnn(path: Path, seed: int = 0, extra_op: str | None = None, n_classes: int = 3, channels: int = 1) -> Path:
    """Conv-BN-ReLU(channels->4) MaxPool Conv(4->6)-ReLU GAP Flatten Gemm(6->C), input [batch,channels,6,6].

    `extra_op` inserts a single-input op (e.g. "Floor") right before the classifier head.
    """
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def p(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    nodes.append(
        helper.make_node(
            "Conv",
            ["x", p("c1.w", rng.normal(0, 0.5, (4, channels, 3, 3))), p("c1.b", rng.normal(0, 0.1, 4))],
            ["a1"],
            name="c1",
            pads=[1, 1, 1, 1],
        )
    )
    bn = [
        p("bn.s", rng.uniform(0.5, 1.5, 4)),
        p("bn.b", rng.normal(0, 0.1, 4)),
        p("bn.m", rng.normal(0, 0.1, 4)),
        p("bn.v", rng.uniform(0.5, 1.5, 4)),
    ]
    nodes.append(helper.make_node("BatchNormalization", ["a1", *bn], ["a2"], name="bn"))
    nodes.append(helper.make_node("Relu", ["a2"], ["a3"], name="r1"))
    nodes.append(helper.make_node("MaxPool", ["a3"], ["a4"], name="pool", kernel_shape=[2, 2], strides=[2, 2]))
    nodes.append(
        helper.make_node(
            "Conv",
            ["a4", p("c2.w", rng.normal(0, 0.4, (6, 4, 3, 3))), p("c2.b", rng.normal(0, 0.1, 6))],
            ["a5"],
            name="c2",
            pads=[1, 1, 1, 1],
        )
    )
    nodes.append(helper.make_node("Relu", ["a5"], ["a6"], name="r2"))
    nodes.append(helper.make_node("GlobalAveragePool", ["a6"], ["a7"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["a7"], ["a8"], name="flat"))
    feat = "a8"
    if extra_op:
        nodes.append(helper.make_node(extra_op, ["a8"], ["a9"], name="blocker"))
        feat = "a9"
    nodes.append(
        helper.make_node(
            "Gemm",
            [feat, p("fc.w", rng.normal(0, 0.5, (n_classes, 6))), p("fc.b", rng.normal(0, 0.1, n_classes))],
            ["logits"],
            name="fc",
            transB=1,
        )
    )
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", channels, 6, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", n_classes])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def blobs(path: Path, n: int = 240, n_classes: int = 3, seed: int = 0, shape=(1, 6, 6), **overrides) -> Path:
    """A learnable task: one random template per class plus noise; x/y splits (last 20 % val)."""
    rng = np.random.default_rng(seed)
    templates = rng.normal(0, 1, (n_classes, *shape))
    y = rng.integers(0, n_classes, n)
    x = templates[y] + rng.normal(0, 0.8, (n, *shape))
    arrays = {"x": x.astype(np.float32), "y": y.astype(np.int64)}
    arrays.update(overrides)
    np.savez(path, **arrays)
    return path


def write_plan_json(plan_dir: Path, raw: dict) -> None:
    """`raw` as the plan's plan.json, its own sha256 made to agree: a hand edit by someone who knows
    the format (planner refuses any other), for tests of what is checked beyond it."""
    from planner.plans.schema import content_sha256

    (plan_dir / "plan.json").write_text(json.dumps({**raw, "sha256": content_sha256(raw)}))


# --- text: a token model, texts whose class a keyword gives, a tokenizer trained on them -------

KEYWORDS = {"sport": ("ball", "goal", "team"), "food": ("bread", "soup", "salt"), "music": ("song", "drum", "band")}
FILLER = tuple("the a of and to in is it on for was with as at by this that from or but".split())


def token_bag(path: Path, vocab: int = 64, length: int | str = 12, n_classes: int = 3, mask_length: int | None = None) -> Path:
    """A text classifier on `input_ids` and `attention_mask` [batch, length] int64 (a str `length`:
    a dynamic one of that name): rows of an embedding table `embed` [vocab, 8] averaged over the
    sequence, scaled by the share of tokens attended, then Gemm(8->C). `mask_length` makes the
    mask another length than the ids."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (vocab, 8)).astype(np.float32), "embed"),
        numpy_helper.from_array(rng.normal(0, 0.5, (n_classes, 8)).astype(np.float32), "fc.w"),
        numpy_helper.from_array(np.zeros(n_classes, np.float32), "fc.b"),
        numpy_helper.from_array(np.array([1], np.int64), "seq_axis"),
    ]
    nodes = [
        helper.make_node("Gather", ["embed", "input_ids"], ["tokens"], name="embedding"),
        helper.make_node("ReduceMean", ["tokens", "seq_axis"], ["pooled"], name="pool", keepdims=0),
        helper.make_node("Cast", ["attention_mask"], ["mask"], name="mask_f", to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["mask", "seq_axis"], ["attended"], name="share", keepdims=1),
        helper.make_node("Mul", ["pooled", "attended"], ["scaled"], name="scale"),
        helper.make_node("Gemm", ["scaled", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "token_bag",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", length]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", mask_length or length]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", n_classes])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def keyword_texts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(text, class) pairs, a learnable task: a class's keyword among its first words, in 2 to 16
    filler words, so some texts are longer than a 12-token model takes (truncated) and most are
    shorter (padded), and the keyword survives truncation."""
    rng = np.random.default_rng(seed)
    classes = sorted(KEYWORDS)
    pairs = []
    for i in range(n):
        label = classes[i % len(classes)]
        words = [str(w) for w in rng.choice(FILLER, int(rng.integers(2, 17)))]
        words.insert(int(rng.integers(0, 4)), str(rng.choice(KEYWORDS[label])))
        pairs.append((" ".join(words).capitalize(), label))
    return pairs


def word_tokenizer(path: Path, texts: list[str], *, pad: str | None = "[PAD]", extra_words: int = 0) -> Path:
    """A WordLevel tokenizer trained on `texts` with Hugging Face tokenizers (in code, nothing
    downloaded), saved as `path`: lower-cased, split on whitespace and punctuation, each text
    `[CLS] ... [SEP]`; `pad` its padding token (None: none), `extra_words` made-up words more in
    its vocabulary."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = [t for t in (pad, "[UNK]", "[CLS]", "[SEP]") if t is not None]
    words = [f"word{i}" for i in range(extra_words)]
    tokenizer.train_from_iterator([*texts, *words], trainers.WordLevelTrainer(special_tokens=specials))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("[CLS]", "[SEP]")]
    )
    tokenizer.save(str(path))
    return path


# --- one op between a trainable conv and the head: does a correct gradient flow through it? -----

Body = Callable[[list, Callable, str, int, np.random.Generator], str]


def _clip(nodes, p, h, C, rng):  # ReLU6, with tensor bounds as every exporter writes it
    for name, v in (("lo", 0.0), ("hi", 6.0)):
        nodes.append(
            helper.make_node("Constant", [], [name], name=f"const_{name}", value=numpy_helper.from_array(np.array(v, np.float32)))
        )
    nodes.append(helper.make_node("Clip", [h, "lo", "hi"], ["o"], name="op"))
    return "o"


def _channels_last(inner: Body) -> Body:
    def body(nodes, p, h, C, rng):
        nodes.append(helper.make_node("Transpose", [h], ["t"], name="to_nhwc", perm=[0, 2, 3, 1]))
        out = inner(nodes, p, "t", C, rng)
        nodes.append(helper.make_node("Transpose", [out], ["o2"], name="to_nchw", perm=[0, 3, 1, 2]))
        return "o2"

    return body


def _layernorm(nodes, p, h, C, rng):
    nodes.append(
        helper.make_node(
            "LayerNormalization",
            [h, p("op.s", rng.uniform(0.5, 1.5, C)), p("op.b", rng.normal(0, 0.1, C))],
            ["o"],
            name="op",
            axis=-1,
        )
    )
    return "o"


def _matmul(nodes, p, h, C, rng):
    nodes.append(helper.make_node("MatMul", [h, p("op.w", rng.normal(0, 0.5, (C, C)))], ["o"], name="op"))
    return "o"


def _concat(nodes, p, h, C, rng):
    nodes.append(helper.make_node("Concat", [h, h], ["cc"], name="op", axis=1))
    nodes.append(helper.make_node("Conv", ["cc", p("mix.w", rng.normal(0, 0.5, (C, 2 * C, 1, 1)))], ["o"], name="mix"))
    return "o"


def _const(nodes, name, value):
    nodes.append(helper.make_node("Constant", [], [name], name=f"const_{name}", value=numpy_helper.from_array(np.asarray(value))))
    return name


def _gather_select(nodes, p, h, C, rng):  # x[:, :, 1] as a class-token select writes it, put back as a row
    nodes.append(helper.make_node("Gather", [h, _const(nodes, "index", np.array(1, np.int64))], ["g"], name="op", axis=2))
    nodes.append(helper.make_node("Unsqueeze", ["g", _const(nodes, "ax", np.array([2], np.int64))], ["o"], name="op_unsqueeze"))
    return "o"


def _gather_table(nodes, p, h, C, rng):  # an embedding: rows of a parameter table picked by constant indices
    table = p("op.table", rng.normal(0, 0.5, (5, 6)))
    nodes.append(
        helper.make_node(
            "Gather", [table, _const(nodes, "rows", np.array([4, 0, 2, 2, 1, 3], np.int64))], ["e"], name="op", axis=0
        )
    )
    nodes.append(helper.make_node("Add", [h, "e"], ["o"], name="op_add"))
    return "o"


def _split(nodes, p, h, C, rng):  # ShuffleNet's channel split, halves swapped
    nodes.append(
        helper.make_node(
            "Split", [h, _const(nodes, "sizes", np.array([C // 2, C // 2], np.int64))], ["a", "b"], name="op", axis=1
        )
    )
    nodes.append(helper.make_node("Relu", ["a"], ["ar"], name="op_relu"))
    nodes.append(helper.make_node("Concat", ["b", "ar"], ["o"], name="op_concat", axis=1))
    return "o"


def _expand_param(nodes, p, h, C, rng):  # a class token: one parameter broadcast to the batch
    nodes.append(helper.make_node("Shape", [h], ["hs"], name="op_shape"))
    nodes.append(helper.make_node("Expand", [p("op.token", rng.normal(0, 0.5, (1, C, 1, 6))), "hs"], ["e"], name="op"))
    nodes.append(helper.make_node("Mul", [h, "e"], ["o"], name="op_mul"))
    return "o"


def _attention(nodes, p, h, C, rng):  # softmax(h h^T / 2) h over each channel's 6x6 map: batched MatMuls
    nodes.append(helper.make_node("Transpose", [h], ["ht"], name="op_t", perm=[0, 1, 3, 2]))
    nodes.append(helper.make_node("MatMul", [h, "ht"], ["s"], name="op_scores"))
    nodes.append(helper.make_node("Mul", ["s", _const(nodes, "scale", np.array(0.5, np.float32))], ["ss"], name="op_scale"))
    nodes.append(helper.make_node("Softmax", ["ss"], ["a"], name="op_softmax", axis=-1))
    nodes.append(helper.make_node("MatMul", ["a", h], ["o"], name="op"))
    return "o"


def _silu(nodes, p, h, C, rng):  # SiLU as exporters write it (squeeze-excitation, EfficientNet)
    nodes.append(helper.make_node("Sigmoid", [h], ["s"], name="op_sigmoid"))
    nodes.append(helper.make_node("Mul", [h, "s"], ["o"], name="op"))
    return "o"


def _scalar(nodes, name, value, dtype=np.float32):
    return _const(nodes, name, np.array(value, dtype))


def _gelu_tanh(nodes, p, h, C, rng):  # GPT-2's NewGELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    nodes.append(helper.make_node("Pow", [h, _scalar(nodes, "three", 3.0)], ["cube"], name="op_pow"))
    nodes.append(helper.make_node("Mul", ["cube", _scalar(nodes, "coef", 0.044715)], ["cubed"], name="op_coef"))
    nodes.append(helper.make_node("Add", [h, "cubed"], ["inner"], name="op_inner"))
    nodes.append(helper.make_node("Mul", ["inner", _scalar(nodes, "scale", math.sqrt(2 / math.pi))], ["arg"], name="op_scale"))
    nodes.append(helper.make_node("Tanh", ["arg"], ["t"], name="op_tanh"))
    nodes.append(helper.make_node("Add", ["t", _scalar(nodes, "one", 1.0)], ["t1"], name="op_one"))
    nodes.append(helper.make_node("Mul", [h, _scalar(nodes, "half", 0.5)], ["hh"], name="op_half"))
    nodes.append(helper.make_node("Mul", ["hh", "t1"], ["o"], name="op"))
    return "o"


def _rms_norm_upcast(nodes, p, h, C, rng):  # Llama's RMSNorm: w * (x * rsqrt(mean(x^2) + eps)).to(dtype), x upcast
    nodes.append(helper.make_node("Cast", [h], ["xd"], name="op_upcast", to=TensorProto.DOUBLE))
    nodes.append(helper.make_node("Pow", ["xd", _scalar(nodes, "two", 2.0, np.float64)], ["sq"], name="op_pow"))
    nodes.append(helper.make_node("ReduceMean", ["sq", _const(nodes, "axes", np.array([-1], np.int64))], ["ms"], name="op_mean"))
    nodes.append(helper.make_node("Add", ["ms", _scalar(nodes, "eps", 1e-6, np.float64)], ["mse"], name="op_eps"))
    nodes.append(helper.make_node("Sqrt", ["mse"], ["rms"], name="op_sqrt"))
    nodes.append(helper.make_node("Reciprocal", ["rms"], ["rrms"], name="op_reciprocal"))
    nodes.append(helper.make_node("Mul", ["xd", "rrms"], ["nd"], name="op_normalize"))
    nodes.append(helper.make_node("Cast", ["nd"], ["n"], name="op_downcast", to=TensorProto.FLOAT))
    nodes.append(helper.make_node("Mul", [p("op.w", rng.uniform(0.5, 1.5, C)), "n"], ["o"], name="op"))
    return "o"


def _rms_norm_div(nodes, p, h, C, rng):  # T5-style RMSNorm in float32, the rsqrt written as a division
    nodes.append(helper.make_node("Pow", [h, _scalar(nodes, "two", 2.0)], ["sq"], name="op_pow"))
    nodes.append(helper.make_node("ReduceMean", ["sq", _const(nodes, "axes", np.array([-1], np.int64))], ["ms"], name="op_mean"))
    nodes.append(helper.make_node("Add", ["ms", _scalar(nodes, "eps", 1e-6)], ["mse"], name="op_eps"))
    nodes.append(helper.make_node("Sqrt", ["mse"], ["rms"], name="op_sqrt"))
    nodes.append(helper.make_node("Div", [h, "rms"], ["o"], name="op"))
    return "o"


def _rope(nodes, p, h, C, rng):  # Llama's rotary embedding over the last axis: x cos + rotate_half(x) sin
    half = 3
    inv_freq = 1.0 / 10000 ** (np.arange(0, 2 * half, 2) / (2 * half))
    angles = np.arange(6)[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    axes = _const(nodes, "axes", np.array([-1], np.int64))
    mid, end = _const(nodes, "mid", np.array([half], np.int64)), _const(nodes, "end", np.array([2 * half], np.int64))
    nodes.append(helper.make_node("Slice", [h, _const(nodes, "start", np.array([0], np.int64)), mid, axes], ["x1"], name="op_x1"))
    nodes.append(helper.make_node("Slice", [h, mid, end, axes], ["x2"], name="op_x2"))
    nodes.append(helper.make_node("Neg", ["x2"], ["nx2"], name="op_neg"))
    nodes.append(helper.make_node("Concat", ["nx2", "x1"], ["rot"], name="op_rotate", axis=-1))
    nodes.append(helper.make_node("Mul", [h, _const(nodes, "cos", np.cos(emb).astype(np.float32))], ["hc"], name="op_cos"))
    nodes.append(helper.make_node("Mul", ["rot", _const(nodes, "sin", np.sin(emb).astype(np.float32))], ["rs"], name="op_sin"))
    nodes.append(helper.make_node("Add", ["hc", "rs"], ["o"], name="op"))
    return "o"


def _causal_attention(nodes, p, h, C, rng):
    """Each channel's 6x6 map as 6 tokens: scores plus a learned position bias (T5's), the causal
    mask a Trilu of a constant, masked with -inf before the softmax (as exporters write it)."""
    nodes.append(helper.make_node("Trilu", [_const(nodes, "ones", np.ones((6, 6), bool))], ["causal"], name="op_causal", upper=0))
    nodes.append(helper.make_node("Transpose", [h], ["ht"], name="op_t", perm=[0, 1, 3, 2]))
    nodes.append(helper.make_node("MatMul", [h, "ht"], ["s"], name="op_scores"))
    nodes.append(helper.make_node("Mul", ["s", _scalar(nodes, "scale", 0.5)], ["ss"], name="op_scale"))
    nodes.append(helper.make_node("Add", ["ss", p("op.bias", rng.normal(0, 0.5, (6, 6)))], ["sb"], name="op"))
    nodes.append(helper.make_node("Where", ["causal", "sb", _scalar(nodes, "ninf", -np.inf)], ["masked"], name="op_mask"))
    nodes.append(helper.make_node("Softmax", ["masked"], ["a"], name="op_softmax", axis=-1))
    nodes.append(helper.make_node("MatMul", ["a", h], ["o"], name="op_context"))
    return "o"


def _trilu(nodes, p, h, C, rng):  # Trilu on the gradient path: the lower triangle plus half the strict upper one
    nodes.append(helper.make_node("Trilu", [h], ["lower"], name="op_tril", upper=0))
    nodes.append(helper.make_node("Trilu", [h, _scalar(nodes, "k", 1, np.int64)], ["upper"], name="op_triu", upper=1))
    nodes.append(helper.make_node("Mul", ["upper", _scalar(nodes, "half", 0.5)], ["upper2"], name="op_half"))
    nodes.append(helper.make_node("Add", ["lower", "upper2"], ["o"], name="op"))
    return "o"


def _tokens(nodes, h, C):
    """h [N, C, 6, 6] as a sequence of 36 tokens of width C, [N, 36, C]."""
    nodes.append(
        helper.make_node("Reshape", [h, _const(nodes, "seq_shape", np.array([0, C, 36], np.int64))], ["hs"], name="tok_r")
    )
    nodes.append(helper.make_node("Transpose", ["hs"], ["tokens"], name="tok_t", perm=[0, 2, 1]))
    return "tokens"


def _input_ids(nodes):
    """Token ids read off the model input, [N, 36] int64 (small integers, 0 the padding id)."""
    flat = _const(nodes, "ids_shape", np.array([0, 36], np.int64))
    nodes.append(helper.make_node("Reshape", ["x", flat], ["xf"], name="ids_r"))
    nodes.append(helper.make_node("Mul", ["xf", _scalar(nodes, "ids_scale", 2.0)], ["xs"], name="ids_scale"))
    nodes.append(helper.make_node("Cast", ["xs"], ["ids"], name="ids_cast", to=TensorProto.INT64))
    return "ids"


def _pooled(nodes, pooled):
    """[N, C] -> [N, C, 1, 1], for the pattern model's GlobalAveragePool."""
    nodes.append(
        helper.make_node("Unsqueeze", [pooled, _const(nodes, "pool_axes", np.array([2, 3], np.int64))], ["o"], name="op_4d")
    )
    return "o"


def _last_token(nodes, p, h, C, rng):
    """GPT2ForSequenceClassification as the dynamo exporter writes its pooling: the last non-pad
    token `(arange(S) * (ids != pad)).argmax(-1)`, then `logits[arange(batch), last]` a GatherND
    of the two index tensors stacked."""
    tokens, ids = _tokens(nodes, h, C), _input_ids(nodes)
    nodes.append(helper.make_node("Equal", [ids, _scalar(nodes, "pad", 0, np.int64)], ["is_pad"], name="op_eq"))
    nodes.append(helper.make_node("Not", ["is_pad"], ["non_pad"], name="op_not"))
    nodes.append(helper.make_node("Cast", ["non_pad"], ["non_pad_i"], name="op_cast", to=TensorProto.INT32))
    nodes.append(helper.make_node("Shape", [ids], ["seq_len"], name="op_seq_shape", start=1, end=2))
    nodes.append(helper.make_node("Cast", ["seq_len"], ["seq_len_i"], name="op_seq_cast", to=TensorProto.INT32))
    nodes.append(helper.make_node("Squeeze", ["seq_len_i"], ["seq"], name="op_seq_scalar"))
    zero_i, one_i = _scalar(nodes, "zero_i", 0, np.int32), _scalar(nodes, "one_i", 1, np.int32)
    nodes.append(helper.make_node("Range", [zero_i, "seq", one_i], ["positions"], name="op_positions"))
    nodes.append(helper.make_node("Mul", ["positions", "non_pad_i"], ["kept"], name="op_kept"))
    nodes.append(helper.make_node("ArgMax", ["kept"], ["last"], name="op_argmax", axis=-1, keepdims=0))
    nodes.append(helper.make_node("Shape", [h], ["batch"], name="op_batch_shape", start=0, end=1))
    nodes.append(helper.make_node("Squeeze", ["batch"], ["batch_n"], name="op_batch_scalar"))
    zero, one = _scalar(nodes, "zero", 0, np.int64), _scalar(nodes, "one", 1, np.int64)
    nodes.append(helper.make_node("Range", [zero, "batch_n", one], ["rows"], name="op_rows"))
    minus1 = _const(nodes, "minus1", np.array([-1], np.int64))
    nodes.append(helper.make_node("Unsqueeze", ["rows", minus1], ["rows1"], name="op_rows1"))
    nodes.append(helper.make_node("Unsqueeze", ["last", minus1], ["last1"], name="op_last1"))
    nodes.append(helper.make_node("Concat", ["rows1", "last1"], ["index"], name="op_index", axis=-1))
    nodes.append(helper.make_node("GatherND", [tokens, "index"], ["pooled"], name="op"))
    return _pooled(nodes, "pooled")


def _gather_nd_repeated(nodes, p, h, C, rng):  # GatherND picking one token twice: the gradient must add up
    nodes.append(helper.make_node("Transpose", [_tokens(nodes, h, C)], ["by_token"], name="op_t", perm=[1, 0, 2]))
    picks = _const(nodes, "picks", np.array([[35], [7], [35]], np.int64))
    nodes.append(helper.make_node("GatherND", ["by_token", picks], ["picked"], name="op"))
    nodes.append(helper.make_node("Transpose", ["picked"], ["pt"], name="op_back", perm=[1, 2, 0]))
    nodes.append(helper.make_node("Unsqueeze", ["pt", _const(nodes, "ax", np.array([3], np.int64))], ["o"], name="op_4d"))
    return "o"


def _mean_pooling(nodes, p, h, C, rng):
    """A text encoder's masked mean pooling (sentence-transformers): sum(tokens * mask) /
    clamp(sum(mask), 1e-9), the attention mask an integer tensor cast to float."""
    tokens, ids = _tokens(nodes, h, C), _input_ids(nodes)
    nodes.append(helper.make_node("Equal", [ids, _scalar(nodes, "pad", 0, np.int64)], ["is_pad"], name="op_eq"))
    nodes.append(helper.make_node("Not", ["is_pad"], ["attend"], name="op_not"))
    nodes.append(helper.make_node("Cast", ["attend"], ["mask"], name="op_mask", to=TensorProto.INT64))
    nodes.append(helper.make_node("Unsqueeze", ["mask", _const(nodes, "minus1", np.array([-1], np.int64))], ["m3"], name="op_m3"))
    nodes.append(helper.make_node("Shape", [tokens], ["tshape"], name="op_tshape"))
    nodes.append(helper.make_node("Expand", ["m3", "tshape"], ["me"], name="op_expand"))
    nodes.append(helper.make_node("Cast", ["me"], ["mf"], name="op_maskf", to=TensorProto.FLOAT))
    nodes.append(helper.make_node("Mul", [tokens, "mf"], ["masked"], name="op_masked"))
    seq = _const(nodes, "seq_axis", np.array([1], np.int64))
    nodes.append(helper.make_node("ReduceSum", ["masked", seq], ["total"], name="op", keepdims=0))
    nodes.append(helper.make_node("ReduceSum", ["mf", seq], ["count"], name="op_count", keepdims=0))
    nodes.append(helper.make_node("Clip", ["count", _scalar(nodes, "tiny", 1e-9)], ["count1"], name="op_clamp"))
    nodes.append(helper.make_node("Div", ["total", "count1"], ["pooled"], name="op_mean"))
    return _pooled(nodes, "pooled")


def _top1_routing(nodes, p, h, C, rng):
    """Switch Transformer's top-1 router over the channels: each position scaled by its top gate
    probability, picked by `one_hot(argmax)` cast to float, and dropped when that probability is
    below 0.3 (a ReduceMax only compared). The argmax, the one-hot, the comparison and the casts
    from integer and boolean lie on the gradient's way but pass none."""
    nodes.append(helper.make_node("Softmax", [h], ["gates"], name="op_gates", axis=1))
    nodes.append(helper.make_node("ArgMax", [h], ["top"], name="op_argmax", axis=1, keepdims=0))
    depth, values = _scalar(nodes, "experts", C, np.int64), _const(nodes, "off_on", np.array([0, 1], np.int64))
    nodes.append(helper.make_node("OneHot", ["top", depth, values], ["onehot"], name="op_onehot", axis=1))
    nodes.append(helper.make_node("Cast", ["onehot"], ["onehot_f"], name="op_onehot_f", to=TensorProto.FLOAT))
    nodes.append(helper.make_node("Mul", ["gates", "onehot_f"], ["picked"], name="op_pick"))
    axis = _const(nodes, "axis", np.array([1], np.int64))
    nodes.append(helper.make_node("ReduceSum", ["picked", axis], ["gate"], name="op_gate", keepdims=1))
    nodes.append(helper.make_node("ReduceMax", ["gates", axis], ["peak"], name="op_peak", keepdims=1))
    nodes.append(helper.make_node("Greater", ["peak", _scalar(nodes, "capacity", 0.3)], ["routed"], name="op_routed"))
    nodes.append(helper.make_node("Cast", ["routed"], ["keep"], name="op_keep", to=TensorProto.FLOAT))
    nodes.append(helper.make_node("Mul", ["gate", "keep"], ["scale"], name="op_scale"))
    nodes.append(helper.make_node("Mul", [h, "scale"], ["o"], name="op"))
    return "o"


# Patterns of several operators as exporters write them together (each operator on its own is
# proven in its forms by tests/test_operators.py): what matters here is how they compose.
OP_PATTERNS: dict[str, Body] = {
    "Clip(ReLU6)": _clip,
    "LayerNormalization": _channels_last(_layernorm),
    "MatMul+Transpose": _channels_last(_matmul),
    "Gather(select)": _gather_select,
    "Gather(table)": _gather_table,
    "Split": _split,
    "Expand(token)": _expand_param,
    "BatchedMatMul+Softmax": _attention,
    "SiLU": _silu,
    "Pow+Tanh(GPT-2 GELU)": _gelu_tanh,
    "RMSNorm(Cast+Pow+Sqrt+Reciprocal)": _channels_last(_rms_norm_upcast),
    "RMSNorm(Pow+Sqrt+Div)": _channels_last(_rms_norm_div),
    "Neg(rotary embedding)": _rope,
    "CausalAttention(Trilu+Where -inf+Softmax)": _causal_attention,
    "Trilu": _trilu,
    "GatherND(last token)": _last_token,
    "GatherND(repeated)": _gather_nd_repeated,
    "ReduceSum(mean pooling)": _mean_pooling,
    "ReduceSum+Cast(top-1 routing)": _top1_routing,
}
TRAINABLE_OP = {
    "LayerNormalization",
    "MatMul+Transpose",
    "Gather(table)",
    "Expand(token)",
    "RMSNorm(Cast+Pow+Sqrt+Reciprocal)",
    "CausalAttention(Trilu+Where -inf+Softmax)",
}


def op_pattern_model(path: Path, pattern: str, seed: int = 0) -> Path:
    """Conv(1->4) -> PATTERN -> GAP -> Gemm(4->3), input [batch, 1, 6, 6]."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def p(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    C = 4
    nodes.append(
        helper.make_node(
            "Conv",
            ["x", p("c.w", rng.normal(0, 0.5, (C, 1, 3, 3))), p("c.b", rng.normal(0, 0.1, C))],
            ["h"],
            name="c",
            pads=[1, 1, 1, 1],
        )
    )
    out = OP_PATTERNS[pattern](nodes, p, "h", C, rng)
    nodes.append(helper.make_node("GlobalAveragePool", [out], ["gp"], name="gap"))
    nodes.append(helper.make_node("Flatten", ["gp"], ["f"], name="flat"))
    nodes.append(
        helper.make_node(
            "Gemm", ["f", p("fc.w", rng.normal(0, 0.5, (3, C))), p("fc.b", np.zeros(3))], ["logits"], name="fc", transB=1
        )
    )
    graph = helper.make_graph(
        nodes,
        pattern,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 6, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


# --- planner's gradients against float64 central differences of the ONNX reference runtime ------


class Erf(OpRunUnaryNum):
    """onnx's reference Erf rounds to float32 (and so does Gelu, built on it); this one does not."""

    def _run(self, x):
        return (np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype),)


class Gelu(OpRunUnaryNum):
    """GELU in float64, exact or `approximate="tanh"` as ONNX defines them (the reference expands
    ONNX's function body with float32 constants)."""

    def _run(self, x, approximate=None):
        if (approximate or getattr(self, "approximate", "none")) == "tanh":
            return ((0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))).astype(x.dtype),)
        erf = np.vectorize(math.erf, otypes=[np.float64])
        return ((0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))).astype(x.dtype),)


class Pad(_Pad):
    """ONNX's Pad with negative pads too (a crop, as `F.pad` writes one), which the reference
    refuses: the crop first, then the reference's own padding by the rest."""

    op_domain = ""

    def _run(self, data, pads, constant_value=None, axes=None, mode=None):
        rank = data.ndim
        listed = list(range(rank)) if axes is None else [int(a) % rank for a in axes]
        widths = [int(p) for p in pads]
        kept = [slice(None)] * rank
        for i, axis in enumerate(listed):
            kept[axis] = slice(max(-widths[i], 0), data.shape[axis] - max(-widths[len(listed) + i], 0))
        rest = np.array([max(w, 0) for w in widths], np.int64)
        return super()._run(data[tuple(kept)], rest, constant_value, axes, mode=mode)


class ConvTranspose(_ConvTranspose):
    """ONNX's ConvTranspose, grouped ones included: the reference splits a grouped weight
    [C_in, C_out / group, k...] along the wrong axis; each group is the reference's own."""

    op_domain = ""

    def _run(self, X, W, B=None, group=None, **attrs):
        group = group or 1
        if group == 1:
            return super()._run(X, W, B, group=1, **attrs)
        biases = np.split(B, group) if B is not None else [None] * group
        parts = zip(np.split(X, group, axis=1), np.split(W, group, axis=0), biases)
        return (np.concatenate([super(ConvTranspose, self)._run(x, w, b, group=1, **attrs)[0] for x, w, b in parts], axis=1),)


class RNN(RNN_14):
    """ONNX's RNN with a Relu activation (`nn.RNN(nonlinearity="relu")`), which the reference lacks."""

    op_domain = ""

    def choose_act(self, name, alpha, beta):
        if name in ("Relu", "relu"):
            return lambda x: np.maximum(x, 0)
        return super().choose_act(name, alpha, beta)


class GlobalMaxPool(OpRun):
    """ONNX's GlobalMaxPool over every spatial axis: the reference reduces axes (d, d + 1) for d
    spatial axes, right for 2-D only (`nn.AdaptiveMaxPool1d(1)` exports the 1-D form)."""

    op_domain = ""

    def _run(self, x):
        return (x.max(axis=tuple(range(2, x.ndim)), keepdims=True),)


# ONNX's reference runtime where onnx 1.23's is wrong or lacking: every reference here runs with these
REFERENCE_OPS = [Erf, Gelu, Pad, ConvTranspose, RNN, GlobalMaxPool]


def float64_loss(proto: onnx.ModelProto, weights: dict, x: np.ndarray, y: np.ndarray) -> float:
    """Mean cross-entropy of the ONNX graph evaluated by onnx's reference runtime in float64."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    for i, t in enumerate(m.graph.initializer):
        m.graph.initializer[i].CopyFrom(numpy_helper.from_array(weights[t.name].astype(np.float64), t.name))
    for v in list(m.graph.input) + list(m.graph.output):
        v.type.tensor_type.elem_type = TensorProto.DOUBLE
    for node in m.graph.node:  # constants (e.g. Clip bounds) and casts back to float32 must be float64 too
        if node.op_type == "Constant":
            arr = numpy_helper.to_array(node.attribute[0].t)
            if arr.dtype == np.float32:
                node.attribute[0].t.CopyFrom(numpy_helper.from_array(arr.astype(np.float64), node.attribute[0].t.name))
        if node.op_type == "Cast" and node.attribute[0].i == TensorProto.FLOAT:
            node.attribute[0].i = TensorProto.DOUBLE
    logits = ReferenceEvaluator(m, new_ops=REFERENCE_OPS).run(None, {m.graph.input[0].name: x.astype(np.float64)})[0]
    logits = logits - logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def step_gradients(
    path: Path, trainable: tuple, batch: int = 4, rng: np.random.Generator | None = None
) -> tuple[Model, StepSignature, dict, np.ndarray, np.ndarray, dict]:
    """planner's gradient of each trainable parameter for one batch drawn from `rng` (seeded 1 by
    default): (model, step signature, weights before, x, y, gradients by parameter name).

    SGD with lr = 1 makes the compiled step compute p - grad, so grad = p_before - p_after.
    """
    model = load_model(path)
    step = compile_candidate(
        model,
        Candidate(trainable=trainable, batch_size=batch, optimizer="sgd", lr=1.0),
        BuildOptions(tvm.target.Target({"kind": "llvm"})),
    )
    w0 = {k: v.astype(np.float32) for k, v in model.initializers.items()}
    session = TrainingSession(step.library, step.signature, w0)
    rng = rng or np.random.default_rng(1)
    x = rng.normal(0, 1, (batch, *model.only_input.shape)).astype(np.float32)
    y = rng.integers(0, model.n_classes, batch)
    session.step(x, y)
    w1 = session.weights()
    names = [n.removesuffix("@head") for n in step.signature.trainable]
    return model, step.signature, w0, x, y, {n: w0[n].astype(np.float64) - w1[n].astype(np.float64) for n in names}


def gradient_errors(path: Path, trainable: tuple, batch: int = 4, samples: int = 12, h: float = 1e-6) -> dict[str, float]:
    """Relative error of planner's gradient of each trainable parameter vs finite differences."""
    rng = np.random.default_rng(1)  # the batch, then the entries checked
    model, signature, w0, x, y, grads = step_gradients(path, trainable, batch, rng)
    errors = {}
    for name, full in grads.items():
        grad = full.ravel()
        region = np.ones(w0[name].shape, bool)  # a ratio update trains only the first k channels
        layout = signature.layouts.get(name)
        if layout is not None and layout.mode == "ratio":
            axis, k = layout.axis, layout.size
            region = np.moveaxis(region, axis, 0)
            region[k:] = False
            region = np.moveaxis(region, 0, axis)
            assert not grad[~region.ravel()].any(), f"{name}: frozen channels moved"
        where = np.flatnonzero(region)
        idx = rng.choice(where, size=min(where.size, samples), replace=False)
        fd = []
        for i in idx:
            plus = {k: v.astype(np.float64) for k, v in w0.items()}
            minus = {k: v.astype(np.float64) for k, v in w0.items()}
            plus[name].ravel()[i] += h
            minus[name].ravel()[i] -= h
            fd.append((float64_loss(model.proto, plus, x, y) - float64_loss(model.proto, minus, x, y)) / (2 * h))
        fd = np.array(fd)
        errors[name] = float(np.linalg.norm(grad[idx] - fd) / max(np.linalg.norm(fd), 1e-12))
    return errors


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for trackers, boards and servers the tests start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
