"""Models that put one kind of operator each on the gradient path, checked against PyTorch itself.

Every family of `torch_families.OPERATOR_FAMILIES`, exported by both of torch's exporters: ALBERT
(three layers sharing one set of weights), a weight-normed dilated causal TCN, an Inception-style
1-D net with MaxPool1d and AvgPool1d, a tanh-GELU decoder, a conv encoder padded every way, a
ConvTranspose autoencoder, a GroupNorm/InstanceNorm audio encoder and relative-position
attention gathering a learned bias with `torch.gather`. For each: `inspect` names its layers as
PyTorch does and all of them train, and one SGD step of every layer is PyTorch's float64 autograd
step within float32 noise (`test_pytorch_families._check_one_step`). Where the exporters differ
in what they write (ALBERT's shared weights, weight norm), a test says what each writes.

"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
from test_pytorch_families import _check_layers, _check_one_step  # noqa: E402

import torch_families as tf  # noqa: E402
from planner import api  # noqa: E402
from processes import planner  # noqa: E402

pytestmark = pytest.mark.slow

CASES = [pytest.param(f, e, id=f"{f}-{e}") for f in tf.OPERATOR_FAMILIES for e in tf.EXPORTERS]


@pytest.mark.parametrize("family, exporter", CASES)
def test_layers_are_pytorch_modules_and_all_train(family, exporter):
    """`inspect` names each layer by its PyTorch module path (or parameter name), every layer can
    train, and every parameter planner would train is one PyTorch tensor."""
    _check_layers(family, exporter, tf.export(family, exporter))


@pytest.mark.parametrize("family, exporter", CASES)
def test_one_sgd_step_matches_pytorch_autograd_in_float64(family, exporter):
    """Every layer trained: each updated tensor within float32 noise of PyTorch's float64 step."""
    path = tf.export(family, exporter)
    tf.parameter_map(family, path, api.inspect(path).parameters)  # what the reference needs, before a compile
    _check_one_step(family, path)


@pytest.mark.parametrize("exporter", tf.EXPORTERS)
@pytest.mark.parametrize("layers", [["head"], ["conv4", "head"]], ids=["head", "conv4-head"])
def test_a_frozen_padded_front_trains_like_pytorch(exporter, layers):
    """pad_encoder with its front frozen: every Pad (reflect, replicate, constant) runs before the
    trained layers, outside the differentiated function, and the step is still PyTorch's."""
    _check_one_step("pad_encoder", tf.export("pad_encoder", exporter), layers)


# ------------------------------------------------------------------------- shared weights (ALBERT)

_SHARED = "model.albert.encoder.albert_layer_groups.0.albert_layers.0."
_SHARED_MODULES = ("attention.query", "attention.key", "attention.value", "attention.dense", "ffn", "ffn_output")
_SHARED_NORMS = ("attention.LayerNorm", "full_layer_layer_norm")


def test_albert_legacy_export_holds_each_shared_weight_once_and_trains_it_as_one():
    """The legacy exporter writes each weight the three ALBERT layers share once: the biases and
    LayerNorm tensors are read by the three layers' nodes, each transposed Linear weight by layer
    0's MatMul and, through `Identity(initializer)`, by layers 1's and 2's. planner ties those
    (`fixups.tie_identities`): each shared module is ONE layer with one weight and one bias, used
    by all three layers (`shared_by`), so its gradient is the sum over them, as PyTorch's is
    (`test_one_sgd_step_matches_pytorch_autograd_in_float64[albert-legacy]`)."""
    path = tf.export("albert", "legacy")
    proto = onnx.load(str(path))
    inits = {t.name for t in proto.graph.initializer}
    identities = [n for n in proto.graph.node if n.op_type == "Identity" and n.input[0] in inits]
    assert len(identities) == 2 * len(_SHARED_MODULES)  # layers 1 and 2 read each shared weight through one
    model = api.inspect(path)
    mapping = tf.parameter_map("albert", path, model.parameters)
    for module in _SHARED_MODULES + _SHARED_NORMS:
        layer = model.layer(_SHARED + module)
        assert layer.shared_by, module  # the nodes of layers 1 and 2
        assert {mapping[p].name for p in (layer.weight, layer.bias)} == {f"{_SHARED}{module}.weight", f"{_SHARED}{module}.bias"}
    assert len(set(mapping.values())) == len(mapping)  # one initializer per PyTorch tensor


@pytest.mark.parametrize("exporter", tf.EXPORTERS)
def test_a_shared_weight_stays_one_tensor_through_measure_and_run(exporter, tmp_path):
    """ALBERT's three layers share one set of weights: measured and run with every layer
    trained, the fine-tuned model.onnx holds each shared weight as one tensor read by all three
    layers (the file's Identity uses read the tensor itself), and it moved."""
    path = tf.export("albert", exporter)
    model = api.inspect(path)
    (ids, mask), y = tf.sample_batch("albert", 24, seed=3)
    np.savez(tmp_path / "data.npz", input_ids=ids, attention_mask=mask, y=y % 10)
    scheme = tmp_path / "all.yaml"
    entries = "\n".join(f"  - {{layer: '{layer.name}', mode: full}}" for layer in model.layers)
    scheme.write_text(f"name: all\ntrainable:\n{entries}\nbatch_size: 2\noptimizer: {{name: adam, lr: 0.01}}\n")
    api.measure(path, scheme=scheme, data=tmp_path / "data.npz", out=tmp_path / "plan", accuracy_steps=2, latency_repeats=2)
    api.run(tmp_path / "plan", data=tmp_path / "data.npz", steps=3, out=tmp_path / "tuned")
    tuned = onnx.load(str(tmp_path / "tuned" / "model.onnx"))
    readers: dict[str, int] = {}
    for node in tuned.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    before = dict(model.initializers)
    after = {t.name: numpy_helper.to_array(t) for t in tuned.graph.initializer}
    for module in ("ffn", "attention.query"):
        weight = model.layer(_SHARED + module).weight
        assert readers[weight] == 3 and not any(n.op_type == "Identity" for n in tuned.graph.node), module
        assert not np.array_equal(after[weight], before[weight]), module  # trained, as one


def test_albert_dynamo_export_copies_some_shared_weights_and_planner_ties_them():
    """What the dynamo exporter writes for ALBERT's shared weights (torch 2.13): biases and
    LayerNorm tensors once, under their PyTorch names, read by the three layers' nodes; the
    transposed query, key, value and dense weights once (`val_*`), read by the three MatMuls; but
    the transposed ffn and ffn_output weights once per layer, three bitwise-equal initializers
    each. Each copy's MatMul records the PyTorch parameter it computes with, so planner reads the
    three as one (`fixups.tie_copies`): one layer, one weight, its gradient summed over the three
    layers (`test_one_sgd_step_matches_pytorch_autograd_in_float64[albert-dynamo]`)."""
    path = tf.export("albert", "dynamo")
    proto = onnx.load(str(path))
    values = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    users: dict[str, list[str]] = {}
    for node in proto.graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node.op_type)
    mapping = tf._match_all(tf._float_initializers(path), tf._folded_module("albert")[0])[0]
    holders: dict[str, list[str]] = {}
    for onnx_name, refs in mapping.items():
        for ref in refs:
            holders.setdefault(ref.name, []).append(onnx_name)
    model = api.inspect(path)
    for module in _SHARED_MODULES + _SHARED_NORMS:
        weight = holders[f"{_SHARED}{module}.weight"]
        bias = holders[f"{_SHARED}{module}.bias"]
        assert bias == [f"{_SHARED}{module}.bias"] and len(users[bias[0]]) == 3, module
        if module in ("ffn", "ffn_output"):
            assert len(weight) == 3 and all(np.array_equal(values[w], values[weight[0]]) for w in weight), (module, weight)
            assert all(users[w] == ["MatMul"] for w in weight), module
        else:
            assert len(weight) == 1 and len(users[weight[0]]) == 3, (module, weight)
        layer = model.layer(_SHARED + module)
        assert layer.weight == weight[0] and len(layer.shared_by) in (2, 4), (
            module,
            layer,
        )  # each further use: a MatMul (and its Add)
    assert not {w for m in ("ffn", "ffn_output") for w in holders[f"{_SHARED}{m}.weight"][1:]} & set(model.parameters)
    with pytest.raises(ValueError, match=r"ffn\.weight' is also in"):
        tf.parameter_map("albert", path)  # the file itself, every initializer named: two copies of one tensor


def test_copies_nothing_ties_are_said_by_inspect(tmp_path):
    """ALBERT's dynamo export without the records that tie its per-use copies (another tool's
    file, say): planner cannot know they are one tensor, trains them apart, and `inspect` says so
    — in its table's notes and in `--json`'s `copies`."""
    proto = onnx.load(str(tf.export("albert", "dynamo")))
    for node in proto.graph.node:
        kept = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.fx_node"]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
    onnx.save(proto, str(tmp_path / "albert.onnx"))
    model = api.inspect(tmp_path / "albert.onnx")
    copies = {frozenset(group) for group in model.copies}
    ffn = next(frozenset(g) for g in copies if len(g) == 3)
    assert all(name in model.parameters for name in ffn)
    res = planner("inspect", str(tmp_path / "albert.onnx"), "--json")
    assert res.returncode == 0, res.stderr
    assert {frozenset(g) for g in json.loads(res.stdout)["copies"]} == copies
    res = planner("inspect", str(tmp_path / "albert.onnx"))
    assert res.returncode == 0 and "and nothing in the file ties them" in res.stdout, res.stdout[-500:]


def test_parameter_map_refuses_two_initializers_of_one_tensor(tmp_path):
    """A PyTorch tensor the file holds once may be used by any number of nodes; held twice (an
    `Identity(initializer)` replaced by a copy of the initializer) it is refused: planner would
    train the copies apart."""
    proto = onnx.load(str(tf.export("albert", "legacy")))
    inits = {t.name: t for t in proto.graph.initializer}
    identity = next(n for n in proto.graph.node if n.op_type == "Identity" and n.input[0] in inits)
    copy = numpy_helper.from_array(numpy_helper.to_array(inits[identity.input[0]]), "copied_weight")
    proto.graph.initializer.append(copy)
    identity.input[0] = copy.name
    onnx.save(proto, str(tmp_path / "albert.onnx"))
    with pytest.raises(ValueError, match="is also in"):
        tf.parameter_map("albert", tmp_path / "albert.onnx")


# ------------------------------------------------------------------------------------ weight norm


def test_weight_norm_as_each_exporter_writes_it():
    """`parametrizations.weight_norm` on the TCN's convs. The legacy exporter keeps w = g * v / ||v||
    in the graph (ReduceL2 of v over its input and kernel axes, Div, Mul by g): g and v are
    parameters under their PyTorch names, layers of their own, and the conv (bias only) reads the
    computed weight; their step is PyTorch's through the norm
    (`test_one_sgd_step_matches_pytorch_autograd_in_float64[tcn-legacy]`). The dynamo exporter
    folds each weight into a constant named as the FX node that computed it (`mul_2`), which planner
    never trains (`names.folded_values`): g and v are nowhere in the file, and the conv trains its
    bias alone — which `inspect` says (`Layer.folded_weight`)."""
    legacy = onnx.load(str(tf.export("tcn", "legacy")))
    ops = [n.op_type for n in legacy.graph.node]
    assert ops.count("ReduceL2") == ops.count("Div") == ops.count("Mul") == 3
    model = api.inspect(tf.export("tcn", "legacy"))
    for i in range(3):
        g, v = (f"convs.{i}.parametrizations.weight.original{k}" for k in range(2))
        assert model.layer(g).weight == g and model.layer(v).weight == v
        conv = model.layer(f"convs.{i}")
        assert (conv.op, conv.weight, conv.bias) == ("Conv", None, f"convs.{i}.bias")

    path = tf.export("tcn", "dynamo")
    dynamo = onnx.load(str(path))
    convs = [n for n in dynamo.graph.node if n.op_type == "Conv" and n.input[2].startswith("convs.")]
    folded = {t.name for t in dynamo.graph.initializer}
    assert [n.input[1] for n in convs] == ["mul_2", "mul_11", "mul_22"] and folded >= {"mul_2", "mul_11", "mul_22"}
    assert not any(n.op_type in ("ReduceL2", "Div") for n in dynamo.graph.node)
    model = api.inspect(path)
    assert not {"mul_2", "mul_11", "mul_22"} & set(model.parameters)
    for i in range(3):
        conv = model.layer(f"convs.{i}")
        assert (conv.op, conv.weight, conv.bias, conv.trainable) == ("Conv", None, f"convs.{i}.bias", True)
        assert conv.folded_weight == ["mul_2", "mul_11", "mul_22"][i]  # what inspect says of it
