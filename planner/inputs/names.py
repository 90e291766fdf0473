"""PyTorch module paths for the layers of an exported ONNX model.

A PyTorch user knows a layer as `features.0.0` or `encoder.layers.1.self_attn`, never as the
node name an exporter happened to write. Each exporter leaves the module path somewhere else:

- the dynamo exporter (torch >= 2.9's default) names nodes by position (`node_Conv_292`) but keeps
  PyTorch's parameter names (`features.0.0.weight`; a BatchNorm folded into a convolution leaves
  `conv1.weight_bias`) and records the module stack in each node's `namespace` metadata;
- the legacy exporter (`dynamo=False`) writes anonymous parameters (`onnx::Conv_193`) but names
  each node by its module path (`/features/features.0/features.0.0/Conv`).

`layer_name` tries them in that order, so one architecture gets the same layer names from
either exporter — as long as the file keeps each parameter apart: the dynamo exporter stores
equal tensors once (fresh LayerNorms, say), and one tensor used by several nodes is one layer
(`Layer.shared_by`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import onnx

# What an exporter invents: legacy `onnx::Conv_193`, dynamo constants `val_12`, paths.
_INVENTED = re.compile(r"^(onnx::|val_\d+$|_val_)|::|/")
_IDENTIFIER_PATH = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*$")  # regnet has `block1-0`


def is_pytorch_name(name: str) -> bool:
    """Whether an initializer name is a PyTorch parameter path rather than an exporter's invention."""
    return bool(_IDENTIFIER_PATH.match(name)) and not _INVENTED.search(name)


def owner_module(param: str) -> str | None:
    """`layer1.0.conv1.weight` -> `layer1.0.conv1`: the module a named parameter belongs to."""
    if not is_pytorch_name(param) or "." not in param:
        return None
    return param.rsplit(".", 1)[0]


def _metadata_path(node: onnx.NodeProto) -> str | None:
    """The innermost module of a dynamo export's `namespace` entry
    (`: ResNet/layer1: Sequential/layer1.0: BasicBlock/add: aten.add.Tensor` -> `layer1.0`)."""
    namespace = next((p.value for p in node.metadata_props if p.key == "namespace"), None)
    if not namespace:
        return None
    path = None
    for entry in namespace.split("/"):
        name, _, kind = entry.partition(": ")
        if name and kind and not kind.startswith("aten.") and _IDENTIFIER_PATH.match(name):
            path = name
    return path


def _legacy_path(node: onnx.NodeProto) -> str | None:
    """A legacy export's node path as a module path: `/layer1/layer1.0/conv1/Conv` ->
    `layer1.0.conv1` (a scope repeats its parent's name for container children)."""
    if not node.name.startswith("/"):
        return None
    scopes = node.name.strip("/").split("/")[:-1]
    path, last = "", ""
    for scope in scopes:
        if path and scope.startswith(last + "."):
            path += scope[len(last) :]
        else:
            path = f"{path}.{scope}" if path else scope
        last = scope
    return path or None


def module_path(node: onnx.NodeProto) -> str | None:
    """The module path a node records, by either exporter (None when it records none)."""
    return _metadata_path(node) or _legacy_path(node)


def layer_name(nodes: Iterable[onnx.NodeProto], params: Iterable[str], taken: set[str]) -> str:
    """The name for a layer made of `nodes` owning `params` (weight first): the module path its
    parameters carry, else the module path its node records, else its node name — the first
    one no earlier layer has taken."""
    nodes = list(nodes)
    options = [owner_module(p) for p in params]
    options += [_metadata_path(n) for n in nodes] + [_legacy_path(n) for n in nodes] + [n.name for n in nodes]
    for option in options:
        if option and option not in taken:
            return option
    return nodes[0].name


def standalone_name(node: onnx.NodeProto, param: str, taken: set[str]) -> str:
    """The name of a parameter used on its own (a class token, a positional embedding): the
    parameter's own PyTorch name when it has one, else as for any layer. An embedding table (a
    Gather's data) is its module's weight, so its layer is the module (`embed`, not `embed.weight`)."""
    if node.op_type == "Gather" and node.input[0] == param:
        return layer_name([node], [param], taken)
    if is_pytorch_name(param) and param not in taken:
        return param
    return layer_name([node], [param], taken)


_FX_ARGUMENT = re.compile(r"%([A-Za-z_][\w]*)")


def has_record(node: onnx.NodeProto) -> bool:
    """Whether the node records the FX node it came from (the dynamo exporter's nodes do)."""
    return any(p.key == "pkg.torch.onnx.fx_node" for p in node.metadata_props)


def recorded_parameters(node: onnx.NodeProto) -> set[str]:
    """The PyTorch parameters a dynamo export's node says it computes with: the FX placeholders
    (`%p_layer_0_ffn_weight`) among the arguments of the FX node it came from (none for a node of
    another exporter)."""
    record = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), None)
    if record is None or "](args = " not in record:
        return set()
    return {name for name in _FX_ARGUMENT.findall(record.split("](args = ", 1)[1]) if name.startswith("p_")}


def folded_values(graph: onnx.GraphProto) -> set[str]:
    """Initializers the dynamo exporter computed rather than found: values of the PyTorch
    program it folded into constants, never parameters.

    Why: its optimizer folds every computation on constants, and to it a parameter is a constant
    too: BERT's `position_embeddings(arange(12))` is stored as `embedding_2` [1, 12, 32], Llama's
    rotary `cos`/`sin` (from the `inv_freq` buffer) as `unsqueeze_14`. Trained, such a tensor
    would be a parameter no PyTorch module has. Each node records the FX node it came from
    (`pkg.torch.onnx.fx_node`: `... args = (%add_8, %embedding_2)`); an initializer named as an
    FX node is such a value (parameters are FX placeholders, `%p_...`, stored under their
    PyTorch names)."""
    inits = {t.name for t in graph.initializer}
    found: set[str] = set()
    for node in graph.node:
        record = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), None)
        if record is not None and "](args = " in record:
            found.update(name for name in _FX_ARGUMENT.findall(record.split("](args = ", 1)[1]) if name in inits)
    return found
