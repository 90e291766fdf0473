"""Tasks beyond single-label classification, checked against PyTorch itself.

Four models as PyTorch users export them (`torch_families.TASK_FAMILIES`), from both exporters:
MLPerf Tiny's anomaly autoencoder (reconstruction), a regression MLP, a multi-label CNN and a
Hugging Face BERT token tagger with padding ignored. For each, one SGD step of every layer is
PyTorch's float64 autograd step of the task's own loss (`torch_families.task_loss`: MSE,
BCE-with-logits, cross-entropy with ignore_index) within float32 noise, and `planner plan` and
`planner run` train it on data it can learn, judged by the task's metric in its direction.

The fast tier checks what the data says of the task: inference from the labels, and the bad
inputs that are one line each.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from planner.errors import BadInput
from planner.inputs.data import load_dataset
from planner.inputs.model import load_model
from planner.tasks import TASKS


def _linear(path: Path, n_in: int, out_shape: tuple[int, ...]) -> Path:
    """x [batch, n_in] -> MatMul + Add -> [batch, *out_shape]: a model of any output, in ONNX."""
    rng = np.random.default_rng(0)
    n_out = int(np.prod(out_shape))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["flat"])]
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (n_in, n_out)).astype(np.float32), "w"),
        numpy_helper.from_array(np.zeros(n_out, np.float32), "b"),
    ]
    out = "flat"
    if len(out_shape) != 1:
        inits.append(numpy_helper.from_array(np.array([-1, *out_shape], np.int64), "shape"))
        nodes.append(helper.make_node("Reshape", ["flat", "shape"], ["out"]))
        out = "out"
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", *out_shape])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _data(path: Path, x: np.ndarray, y: np.ndarray | None = None) -> Path:
    np.savez(path, x=x.astype(np.float32), **({"y": y} if y is not None else {}))
    return path


X = np.random.default_rng(1).normal(size=(30, 6)).astype(np.float32)


@pytest.mark.parametrize(
    "out_shape, y, task",
    [
        ((3,), np.arange(30) % 3, "classification"),
        ((3,), np.array(["a", "b", "c"] * 10), "classification"),
        ((4,), (np.arange(120).reshape(30, 4) % 3 == 0).astype(np.float32), "multilabel"),
        ((1,), np.linspace(-1, 1, 30), "regression"),
        ((2,), np.random.default_rng(2).normal(size=(30, 2)), "regression"),
        ((6,), None, "reconstruction"),
    ],
    ids=["indices", "names", "0/1 rows", "one float", "two floats", "no labels"],
)
def test_the_labels_and_the_output_say_the_task(tmp_path, out_shape, y, task):
    """Without --task, the task is the one the model's output and the labels fit: class indices or
    names are classes, 0/1 rows labels, floats targets, no labels an autoencoder's data."""
    model = load_model(_linear(tmp_path / "m.onnx", 6, out_shape))
    data = load_dataset(_data(tmp_path / "d.npz", X, y), model)
    assert data.task is TASKS[task]
    x, target = data.train.batch(np.arange(4))
    assert target.shape == (4, *model.with_task(data.task).target.static)
    if task == "reconstruction":
        np.testing.assert_array_equal(target, x)


@pytest.mark.parametrize(
    "out_shape, y, task, message",
    [
        ((3,), np.linspace(0.1, 2.9, 30), None, "label 0 is 0.1 \\(float targets are regression"),
        ((3,), np.linspace(0.1, 2.9, 30), "classification", "label 0 is 0.1 \\(float targets are regression"),
        ((2, 2), np.linspace(0.1, 2.9, 30), None, "token classification needs one per token"),
        ((2,), np.zeros((30, 3), np.float32), "regression", r"targets of shape \(24, 3\), but for regression"),
        ((4,), np.full((30, 4), 2.0), "multilabel", "must be 0 or 1"),
        ((5,), None, "reconstruction", "not shaped as its input"),
        ((3,), None, "classification", r"expected arrays x_train, y_train, x_val, y_val \(or x, y\); found x"),
        ((1,), np.full(30, 0.5), "regression", "every train target is 0.5"),
        ((3,), np.arange(30) % 3, "unknown", "no task 'unknown'"),
    ],
    ids=[
        "floats for a classifier",
        "floats named classes",
        "floats for a grid",
        "wrong shape",
        "not 0/1",
        "output not the input",
        "no labels",
        "constant",
        "unknown task",
    ],
)
def test_labels_that_do_not_fit_the_task_are_one_line(tmp_path, out_shape, y, task, message):
    model = load_model(_linear(tmp_path / "m.onnx", 6, out_shape))
    with pytest.raises(BadInput, match=message) as caught:
        load_dataset(_data(tmp_path / "d.npz", X, y), model, task=task)
    assert "\n" not in str(caught.value)


def _flagged(path: Path, flags: np.ndarray) -> Path:
    """Normal train samples and val samples with their anomaly flags: an anomaly detector's data."""
    np.savez(path, x_train=X[:20], x_val=X[20:], y_val=flags)
    return path


def test_val_flags_alone_make_an_anomaly_detector_judged_by_auc(tmp_path):
    """`x_train`, `x_val` and `y_val` alone: the train samples are normal and their own targets,
    the val flags say which val samples are anomalous, and the AUC of the reconstruction error
    orders them: 1.0 when the flagged samples are rebuilt worst, 0.0 when best, ties half."""
    from planner.runtime.session import score

    model = load_model(_linear(tmp_path / "m.onnx", 6, (6,)))
    flags = np.array([0, 1] * 5)
    data = load_dataset(_flagged(tmp_path / "d.npz", flags), model)
    assert data.task.name == "anomaly" and data.task.metric.name == "auc" and data.train.labels is None
    np.testing.assert_array_equal(data.val.labels, flags)
    x, y = next(data.val.chunks(10))
    error = np.where(flags == 1, 2.0, 1.0)[:, None]  # the flagged samples rebuilt worst

    def rebuilt(how: np.ndarray):
        return lambda inputs: inputs + how

    assert score("anomaly", rebuilt(error), [(x, y)])[1] == 1.0
    assert score("anomaly", rebuilt(3.0 - error), [(x, y)])[1] == 0.0
    assert score("anomaly", rebuilt(np.ones((10, 1))), [(x, y)])[1] == 0.5


@pytest.mark.parametrize(
    "flags, message",
    [
        (np.zeros(10), "flags are all 0: an AUC needs normal and anomalous"),
        (np.arange(10) % 3, "one 0/1 anomaly flag per sample"),
    ],
    ids=["one kind", "not 0/1"],
)
def test_anomaly_flags_that_cannot_judge_are_one_line(tmp_path, flags, message):
    model = load_model(_linear(tmp_path / "m.onnx", 6, (6,)))
    with pytest.raises(BadInput, match=message) as caught:
        load_dataset(_flagged(tmp_path / "d.npz", flags), model)
    assert "\n" not in str(caught.value)


def test_a_model_bound_to_its_task_keeps_the_weights_it_read(tmp_path):
    """Binding a task (or a length) copies the model description, not its weights: those already
    read are the copy's, not read from the graph again."""
    model = load_model(_linear(tmp_path / "m.onnx", 4, (3,)))
    weights = model.initializers
    bound = model.with_task(TASKS["regression"])
    assert bound.task.name == "regression" and bound.initializers is weights


def test_per_token_labels_make_a_tagger_and_padding_is_ignored(tmp_path):
    """Labels [N, length] for a [batch, length, classes] output: token classification, -100 kept
    (the loss and the metric skip it), any other label out of the classes refused."""
    model = load_model(_linear(tmp_path / "m.onnx", 6, (4, 3)))
    y = np.random.default_rng(0).integers(0, 3, (30, 4))
    y[:, -1] = -100
    data = load_dataset(_data(tmp_path / "d.npz", X, y), model)
    assert data.task is TASKS["token-classification"]
    _, target = data.val.batch(np.arange(2))
    assert target.dtype == np.int64 and (target[:, -1] == -100).all()
    y[0, 0] = 3
    with pytest.raises(BadInput, match="token label 3 is outside 0..2"):
        load_dataset(_data(tmp_path / "bad.npz", X, y), model)


def _bigram_lm(path: Path, vocab: int = 32, length: int = 6) -> Path:
    """input_ids [batch, length] -> Gather(table) -> MatMul -> logits [batch, length, vocab]: the
    smallest next-token model, in ONNX."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["h"]), helper.make_node("MatMul", ["h", "head"], ["logits"])]
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (vocab, 8)).astype(np.float32), "table"),
        numpy_helper.from_array(rng.normal(0, 0.5, (8, vocab)).astype(np.float32), "head"),
    ]
    graph = helper.make_graph(
        nodes,
        "bigram",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", length])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", length, vocab])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


SENTENCES = ["the cat sat on the mat .", "a dog ran to the park .", "my bird sang in the tree .", "the fox hid under a log ."]


def _corpus(path: Path, n: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.write_text(" ".join(SENTENCES[i] for i in rng.integers(0, len(SENTENCES), n)))
    return path


def test_a_corpus_is_next_token_chunks_of_the_model_length(tmp_path):
    """A `.txt` and JSON Lines of {"text"}: tokenised whole, cut into windows of length + 1, each
    input the window's first `length` ids and its target the last `length`; the last fifth val."""
    from builders import word_tokenizer

    model = load_model(_bigram_lm(tmp_path / "lm.onnx"))
    tok = word_tokenizer(tmp_path / "tok.json", SENTENCES, pad=None)
    for corpus in (_corpus(tmp_path / "c.txt", 40), tmp_path / "c.jsonl"):
        if corpus.suffix == ".jsonl":
            corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in (tmp_path / "c.txt").read_text().split(" . ")))
        data = load_dataset(corpus, model, tokenizer=tok)
        assert data.task is TASKS["causal-lm"]
        x, y = data.train.batch(np.arange(3))
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # each target the next input
        np.testing.assert_array_equal(y[:-1, -1], x[1:, 0])  # and across windows: the corpus read through
        assert len(data.val) == max(1, round((len(data.train) + len(data.val)) * 0.2))


def test_a_corpus_shorter_than_two_chunks_is_one_line(tmp_path):
    from builders import token_bag, word_tokenizer

    model = load_model(_bigram_lm(tmp_path / "lm.onnx"))
    tok = word_tokenizer(tmp_path / "tok.json", SENTENCES, pad=None)
    for text, said in (("the cat sat .", "4 tokens, less than one chunk"), ("the cat sat on the mat .", "7 tokens, one chunk")):
        (tmp_path / "short.txt").write_text(text)
        with pytest.raises(BadInput, match=f"the corpus is {said} of the model's 6 and one more: .* 13 tokens"):
            load_dataset(tmp_path / "short.txt", model, tokenizer=tok)
    with pytest.raises(BadInput, match="cannot be trained so"):
        load_dataset(_corpus(tmp_path / "c.txt", 40), load_model(token_bag(tmp_path / "bag.onnx")), tokenizer=tok)


# ------------------------------------------------------------------------ PyTorch's models and loss

torch = pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
from test_pytorch_families import _check_layers, _check_one_step  # noqa: E402

import torch_families as tf  # noqa: E402
from planner import api  # noqa: E402
from processes import PLANNED, planner  # noqa: E402

CASES = [pytest.param(f, e, id=f"{f}-{e}", marks=pytest.mark.slow) for f in tf.TASK_FAMILIES for e in tf.EXPORTERS]


@pytest.mark.parametrize("family, exporter", CASES)
def test_one_sgd_step_of_each_task_matches_pytorch_autograd_in_float64(family, exporter):
    """Every layer trained with the task's loss: each updated tensor within float32 noise of
    PyTorch's float64 step with PyTorch's own loss (mean MSE, BCE-with-logits, cross-entropy
    ignoring -100)."""
    path = tf.export(family, exporter)
    _check_layers(family, exporter, path)
    _check_one_step(family, path)


def _learnable(family: str, n: int) -> dict[str, np.ndarray]:
    """`n` samples `family`'s model can learn from: targets a function of the inputs."""
    x, _ = tf.sample_batch(family, n, seed=5)
    rng = np.random.default_rng(7)
    match tf.TASK_FAMILIES[family].task:
        case "reconstruction":  # frames on a 4-dimensional subspace: what the bottleneck can hold
            basis = rng.normal(size=(4, 40))
            return {"x": (rng.normal(size=(n, 4)) @ basis / 2).astype(np.float32)}
        case "regression":
            return {"x": x, "y": (x @ rng.normal(size=(7, 3)) / 2).astype(np.float32)}
        case "multilabel":
            w = rng.normal(size=(x[:, 0].reshape(n, -1).shape[1], 5))
            return {"x": x, "y": (x[:, 0].reshape(n, -1) @ w > 0).astype(np.float32)}
        case "token-classification":
            ids, mask = x
            return {"input_ids": ids, "attention_mask": mask, "y": np.where(mask == 1, ids % 10, -100)}
        case "loss-in-model":  # the box and the class a function of the image: targets are inputs, no y
            image = x[0]
            feature = image.reshape(n, -1) @ rng.normal(size=(100, 4)) / 10
            return {"x": image, "boxes": feature.astype(np.float32), "labels": feature[:, :3].argmax(axis=1)}
    raise ValueError(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f, fam in tf.TASK_FAMILIES.items() if fam.task != "causal-lm"])
def test_each_task_plans_runs_and_reports_in_its_metric(family, tmp_path):
    """`planner plan` on data the model can learn: plan.json records the task and its metric,
    which improves in its own direction (an error down, a share up); `planner run` reproduces the
    plan's step and says the metric by name; the report names it."""
    path = tf.export(family, "dynamo")
    task = tf.TASK_FAMILIES[family].task
    np.savez(tmp_path / "data.npz", **_learnable(family, 160))
    done = planner(
        "plan", "--model", path, "--data", tmp_path / "data.npz", "--out", tmp_path / "plan", "--trials", "2",
        "--accuracy-steps", "60", "--seed", "1",
    )  # fmt: skip
    assert done.returncode in PLANNED, done.stderr
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["dataset"]["task"] == task
    acc = plan["metrics"]["accuracy"]
    metric = TASKS[task].metric
    assert acc["metric"] == metric.name
    assert metric.gain(acc["before"], acc["after"]) > 0, acc
    ran = planner("run", tmp_path / "plan", "--steps", "20", "--out", tmp_path / "ran")
    assert ran.returncode == 0, ran.stderr
    assert f"{metric.name} " in ran.stdout
    report = (tmp_path / "plan" / "report.md").read_text()
    assert f"val {metric.name}" in report
    assert api.inspect(tmp_path / "ran" / "model.onnx").output.shape == api.inspect(path).output.shape


@pytest.mark.slow
def test_a_decoder_fine_tunes_on_a_text_corpus_by_next_token(tmp_path):
    """GPT-2 with its tied LM head, a `.txt` corpus and the user's tokenizer: `planner plan` infers
    causal-lm, the perplexity falls, plan.json records the tokenizer, and `planner run` tokenises
    the corpus again with the plan's copy and trains on it."""
    from builders import word_tokenizer

    path = tf.export("gpt2_lm", "dynamo")
    tok = word_tokenizer(tmp_path / "tok.json", SENTENCES, pad=None)
    corpus = _corpus(tmp_path / "notes.txt", 400)
    done = planner(
        "plan", "--model", path, "--data", corpus, "--tokenizer", tok, "--out", tmp_path / "plan", "--trials", "2",
        "--accuracy-steps", "60", "--seed", "1",
    )  # fmt: skip
    assert done.returncode in PLANNED, done.stderr
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["dataset"]["task"] == "causal-lm" and plan["dataset"]["tokenizer"]["max_length"] == 12
    acc = plan["metrics"]["accuracy"]
    assert acc["metric"] == "perplexity" and acc["after"] < 0.75 * acc["before"], acc
    ran = planner("run", tmp_path / "plan", "--steps", "10", "--out", tmp_path / "ran")
    assert ran.returncode == 0, ran.stderr
    assert "perplexity " in ran.stdout


HEADS = [
    pytest.param(family, exporter, recompute, id=f"{family}-{exporter}-{recompute}", marks=pytest.mark.slow)
    for family, exporter, recompute in (
        ("gpt2_lm", "legacy", "none"),
        ("gpt2_lm", "dynamo", "auto"),
        ("llama_lm", "legacy", "auto"),
        ("llama_lm", "dynamo", "none"),
        ("bert_tagger", "legacy", "none"),
        ("bert_tagger", "dynamo", "none"),
    )
]


@pytest.mark.parametrize("family, exporter, recompute", HEADS)
def test_a_head_in_chunks_of_tokens_trains_like_pytorch_and_never_holds_the_logits(
    family, exporter, recompute, monkeypatch, tmp_path
):
    """A token cross-entropy whose logits are over `head.CHUNK_BYTES` is computed a chunk of
    tokens at a time (here 8 of the batch's 24, so three chunks; a tagger's 10 classes leave a
    row shorter than one vector, the decoders' 64 are whole vectors): no tensor of the step holds
    every token's logits, and one SGD step of every layer — the decoders' LM heads tied to their
    embeddings, the tagger's with its bias — is PyTorch's float64 autograd step, with activations
    recomputed or not."""
    from test_pytorch_families import BATCH
    from tvm import relax

    from planner.backend.graph import head
    from planner.backend.lower import pipeline
    from planner.runtime.convention import STEP_FUNC
    from planner.types import Candidate

    model = api.inspect(path := tf.export(family, exporter)).with_task(TASKS[tf.TASK_FAMILIES[family].task])
    length, vocab = (int(d) for d in model.output.shape)
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path))  # the chunk size is no part of a build's cache key
    monkeypatch.setattr(head, "CHUNK_BYTES", 8 * vocab * 4)
    monkeypatch.setattr(pipeline, "_GRAPHS", type(pipeline._GRAPHS)())  # nor of the graphs a process keeps
    layers = tuple((layer.name, "full") for layer in model.layers)
    mod, _ = pipeline.training_module(model, Candidate(layers, BATCH, "sgd", 0.1, recompute=recompute))
    whole = {(BATCH, length, vocab), (BATCH * length, vocab)}
    shapes = {
        tuple(int(d) for d in b.var.ty.shape)
        for block in mod[STEP_FUNC].body.blocks
        for b in block.bindings
        if isinstance(b.var.ty, relax.TensorType) and b.var.ty.shape is not None
    }
    assert (8, vocab) in shapes
    if family != "llama_lm":  # (this Llama's MLP is as wide as its vocabulary: [2, 12, 64] is its up-projection)
        assert not shapes & whole, shapes & whole
    _check_one_step(family, path, recompute=recompute)


@pytest.mark.parametrize(
    "task, loss", [("regression", "mse_loss"), ("regression-l1", "l1_loss"), ("regression-huber", "huber_loss")]
)
def test_each_regression_loss_steps_as_pytorchs(task, loss, tmp_path):
    """One SGD step of a linear model under each regression loss is PyTorch's float64 step with
    its own loss (`huber_loss` at its default delta 1, on targets spread so both of its branches
    count), and the task is judged by its metric (MSE, or the mean absolute error for the robust
    losses)."""
    import tvm

    from planner.backend.lower.pipeline import BuildOptions
    from planner.backend.vm.compile import compile_candidate
    from planner.runtime.session import TrainingSession
    from planner.types import Candidate

    model = load_model(_linear(tmp_path / "m.onnx", 6, (2,))).with_task(TASKS[task])
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(8, 6)).astype(np.float32), (rng.normal(size=(8, 2)) * 2).astype(np.float32)
    lr = 0.5
    candidate = Candidate(tuple((layer.name, "full") for layer in model.layers), 8, "sgd", lr)
    step = compile_candidate(model, candidate, BuildOptions(tvm.target.Target({"kind": "llvm"})))
    session = TrainingSession(step.library, step.signature, model.initializers)
    session.step(x, y)
    after = session.weights()
    w, b = (torch.tensor(model.initializers[n], dtype=torch.float64, requires_grad=True) for n in ("w", "b"))
    predicted = torch.from_numpy(x).double() @ w + b
    target = torch.from_numpy(y).double()
    getattr(torch.nn.functional, loss)(predicted, target).backward()
    assert ((predicted - target).abs() < 1).any() and ((predicted - target).abs() > 1).any()
    for name, p in (("w", w), ("b", b)):
        np.testing.assert_allclose(after[name], (p - lr * p.grad).detach().numpy(), rtol=1e-5, atol=1e-6)
    assert TASKS[task].metric.name == ("mse" if task == "regression" else "mae")


@pytest.mark.slow
def test_an_anomaly_detector_plans_runs_and_reports_its_auc(tmp_path):
    """MLPerf Tiny's autoencoder shape on normal frames (a 4-dimensional subspace) with val frames
    half of which are off it: `planner plan` infers `anomaly` from the val flags, trains on the
    normal frames, and the AUC of the reconstruction error rises; `planner run` and the report
    say it by name."""
    path = tf.export("fc_autoencoder", "dynamo")
    rng = np.random.default_rng(7)
    basis = rng.normal(size=(4, 40))
    normal = (rng.normal(size=(200, 4)) @ basis / 2).astype(np.float32)
    odd = (rng.normal(size=(20, 40)) * normal.std()).astype(np.float32)
    x_val = np.concatenate([normal[160:], odd])
    np.savez(tmp_path / "data.npz", x_train=normal[:160], x_val=x_val, y_val=np.repeat([0, 1], [40, 20]))
    done = planner(
        "plan", "--model", path, "--data", tmp_path / "data.npz", "--out", tmp_path / "plan", "--trials", "3",
        "--accuracy-steps", "150", "--seed", "1", "--space", "full",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    acc = plan["metrics"]["accuracy"]
    assert plan["dataset"]["task"] == "anomaly" and acc["metric"] == "auc"
    assert acc["after"] > acc["before"] + 0.1, acc  # 0.662 -> 0.879 when written
    ran = planner("run", tmp_path / "plan", "--steps", "20", "--out", tmp_path / "ran")
    assert ran.returncode == 0, ran.stderr
    assert "auc " in ran.stdout
    assert "val auc" in (tmp_path / "plan" / "report.md").read_text()
