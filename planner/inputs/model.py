"""Load and validate an ONNX model, and describe its layers.

planner trains models whose inputs (an image, features, token ids and an attention mask) all
have the batch as their first dimension, with one float output whose meaning is its task's
(`planner.tasks`: `[batch, classes]` logits, values, a reconstruction, per-token logits). Everything else about a model (layers, parameters, shapes,
which layers can be trained) is read here once, so later stages never re-parse ONNX.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import onnx
from onnx import external_data_helper, numpy_helper

from planner.errors import BadInput, CandidateFailed, first_line
from planner.inputs.fixups import (
    dequantize_weights,
    for_import,
    name_nodes,
    tie_copies,
    tie_identities,
    tie_transposes,
    unpaired_quantization,
)
from planner.inputs.layers import Layer, layers_of, parameters_of
from planner.tasks import CLASSIFICATION, TASKS, Task
from planner.types import Encoding, Int8Scale, ModelInput, Precision

__all__ = ["Layer", "Model", "load_model", "save_onnx"]


@dataclass
class Model:
    """A validated ONNX model, and the task it is trained for."""

    path: Path
    proto: onnx.ModelProto  # the model's graph with its weights loaded, nodes named, ties undone
    sha256: str  # of the model file and its external data files
    data_files: tuple[str, ...]  # external data files, relative to the model's folder
    inputs: tuple[ModelInput, ...]  # every graph input that is not an initializer, in graph order
    fixed_batch: int | None  # the batch the model was exported with, when it is not symbolic
    output: ModelInput  # the one output, its shape after the batch (a str: a length its inputs share)
    parameters: tuple[str, ...]  # initializers that are parameters, in graph order
    layers: list[Layer]
    lengths: dict[str, int] = field(default_factory=dict)  # dynamic input lengths bound (`bind`)
    # parameters holding bitwise-equal tensors that nothing in the file ties: if they are one
    # PyTorch parameter written once per use, planner trains the copies apart (`planner inspect` says so)
    copies: tuple[tuple[str, ...], ...] = ()
    # what the model is trained for (its loss and metric): inferred from its output until data
    # (or `--task`) says (`with_task`)
    task: Task = CLASSIFICATION
    # int8 scales of its activations, calibrated on the training data (`planner.inputs.calibration`;
    # None: not calibrated), and whether the graph quantizes them (`for_precision`: an int8 candidate's)
    calibration: dict[str, Int8Scale] | None = None
    int8: bool = False

    @property
    def key(self) -> str:
        """What identifies the model a step is built from: its files, the lengths bound, the
        task (whose loss the step computes), its inputs' encodings and its activations' scales."""
        codes = [i.to_json() for i in self.inputs if i.encoding is not None]
        if not self.lengths and self.task is CLASSIFICATION and not codes and not self.int8:
            return self.sha256
        extra: list = [] if self.task is CLASSIFICATION else [self.task.name]
        if self.int8:  # the scales a float step never reads (calibrated anew where a worker loads the data) stay out
            extra.append(sorted((t, a.to_json()) for t, a in (self.calibration or {}).items()))
        return hashlib.sha256(json.dumps([self.sha256, sorted(self.lengths.items()), *extra, *codes]).encode()).hexdigest()

    @property
    def n_classes(self) -> int:
        """The output's last size: classes of a classifier (0 where it is not fixed)."""
        last = self.output.shape[-1] if self.output.shape else 1
        return last if isinstance(last, int) else 0

    @property
    def target(self) -> ModelInput:
        """One sample's target as the step takes it."""
        return self.task.target(self.output, self.inputs)

    def with_task(self, task: Task) -> Model:
        """The model trained for `task` (BadInput when its output cannot be)."""
        if (why := task.refuses(self.output, self.inputs)) is not None:
            raise BadInput(f"{self.path.name} cannot be trained for {task.name}: {why}")
        return self._replaced(task=task)

    @property
    def unbound(self) -> tuple[str, ...]:
        """The dynamic lengths (a sequence length) no data has bound yet."""
        return tuple(dict.fromkeys(d for i in self.inputs for d in i.shape if isinstance(d, str)))

    def bind(self, shapes: Sequence[Sequence[int]], where: str) -> Model:
        """The model with its dynamic lengths set from `shapes`, one per input (after the batch):
        the lengths the data has, as the batch is the candidate's. A fixed length must equal the
        data's, and two inputs sharing a length (`input_ids`, `attention_mask`) must agree;
        else BadInput naming `where` (the data)."""
        if len(shapes) != len(self.inputs):
            raise BadInput(f"{where}: {len(shapes)} arrays for the model's {len(self.inputs)} inputs")
        lengths: dict[str, int] = {}
        for spec, shape in zip(self.inputs, shapes):
            if len(shape) != len(spec.shape):
                raise BadInput(f"{where}: samples of shape {tuple(shape)}, the model's input '{spec.name}' needs {spec.shape}")
            for dim, size in zip(spec.shape, shape):
                fixed = dim if isinstance(dim, int) else lengths.setdefault(dim, int(size))
                if fixed != size:
                    raise BadInput(
                        f"{where}: samples of shape {tuple(shape)}, the model's input '{spec.name}' needs {spec.shape}"
                        + (f" with {dim} = {fixed} as in the other inputs" if isinstance(dim, str) else "")
                    )
        bound = {k: v for k, v in lengths.items() if k in self.unbound}
        if not bound:
            return self
        inputs = tuple(
            replace(i, shape=tuple(bound.get(d, d) if isinstance(d, str) else d for d in i.shape)) for i in self.inputs
        )
        output = replace(self.output, shape=tuple(bound.get(d, d) if isinstance(d, str) else d for d in self.output.shape))
        return self._replaced(inputs=inputs, output=output, lengths={**self.lengths, **bound})

    def encoded(self, codes: Mapping[str, Encoding]) -> Model:
        """The model whose step takes the inputs named in `codes` in 8 bits, decoding each as its
        first operation (`Encoding`; `import_proto` writes the decoding into the graph)."""
        if unknown := sorted(set(codes) - {i.name for i in self.inputs}):
            raise BadInput(f"{self.path.name} has no input named {unknown[0]!r}")
        try:
            inputs = tuple(i.encoded(codes[i.name]) if i.name in codes else i for i in self.inputs)
        except ValueError as exc:
            raise BadInput(f"{self.path.name}: {exc}") from None
        return self._replaced(inputs=inputs)

    def calibrated(self, scales: Mapping[str, Int8Scale]) -> Model:
        """The model with its activations' int8 scales (`planner.inputs.calibration.calibrate`),
        which an int8 candidate's graph quantizes its activations at (`for_precision`)."""
        return self._replaced(calibration=dict(scales))

    def for_precision(self, precision: Precision) -> Model:
        """The model as a candidate of `precision` builds its step from: an int8 one quantizes
        the activations at their calibrated scales; any other computes them in float."""
        if precision is not Precision.INT8:
            return self._replaced(int8=False) if self.int8 else self
        if self.calibration is None:  # not calibrated, or ONNX Runtime could not run it: no int8 candidate builds
            raise CandidateFailed(f"{self.path.name}: precision int8 needs its activations calibrated on training data")
        return self._replaced(int8=True)

    def key_for(self, precision: Precision) -> str:
        """The key of the model a candidate of `precision` builds its step from (`for_precision`):
        an int8 one's includes the activations' scales."""
        if precision is Precision.INT8 and self.calibration is not None:
            return self.for_precision(precision).key
        return self.key

    @property
    def exported(self) -> Model:
        """The model taking every input as its ONNX file does (what data is read for), not in
        8 bits (`encoded`)."""
        if all(i.encoding is None for i in self.inputs):
            return self
        return self._replaced(inputs=tuple(replace(i, dtype="float32", encoding=None) if i.encoding else i for i in self.inputs))

    def _replaced(self, **changes) -> Model:
        """`replace(self, **changes)` keeping the initializers already read: neither the graph nor
        its parameter list changes, and reading them again was a second conversion of every
        weight (a 124M decoder's 0.5 GB) each time the data bound a task or a length."""
        copy = replace(self, **changes)
        if "initializers" in self.__dict__:
            copy.__dict__["initializers"] = self.__dict__["initializers"]
        return copy

    @cached_property
    def initializers(self) -> dict[str, np.ndarray]:
        """Every parameter by ONNX name, in graph order (the order TVM imports them)."""
        wanted = set(self.parameters)
        return {t.name: numpy_helper.to_array(t) for t in self.proto.graph.initializer if t.name in wanted}

    @property
    def only_input(self) -> ModelInput:
        """The model's one input, for data that has one array per sample (images, `x` arrays)."""
        if len(self.inputs) != 1:
            names = ", ".join(i.name for i in self.inputs)
            raise BadInput(
                f"{self.path.name} takes {len(self.inputs)} inputs ({names}): give one array per input, named as the input"
            )
        return self.inputs[0]

    @property
    def image_shape(self) -> tuple[int, ...]:
        """The one input's shape, which images are made into (they need a fixed size)."""
        spec = self.only_input
        if spec.shape != (shape := tuple(d for d in spec.shape if isinstance(d, int))):
            raise BadInput(f"{self.path.name}: input '{spec.name}' {spec.shape} has dynamic sizes; images need a fixed size")
        return shape

    @property
    def data_paths(self) -> dict[str, Path]:
        """Each external data file: its name as the model refers to it -> where it is."""
        return {location: self.path.parent / location for location in self.data_files}

    def import_proto(self, batch: int) -> onnx.ModelProto:
        """The graph as TVM imports it for a step of `batch` samples (see `planner.fixups`): a
        fresh copy, weights included, for the importer to read once."""
        if self.unbound:
            raise BadInput(
                f"{self.path.name}: its inputs' lengths {', '.join(self.unbound)} are bound by the data; load data first"
            )
        codes = {i.name: i.encoding for i in self.inputs if i.encoding is not None}
        activations = self.calibration if self.int8 else None
        return for_import(self.proto, batch, set(self.parameters), self.lengths, codes, activations)

    def layer(self, name: str) -> Layer:
        """A layer by its name, or by the name of an ONNX node in it."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        for layer in self.layers:
            if name in layer.nodes:
                return layer
        raise BadInput(f"model has no layer named {name!r} (see `planner inspect {self.path}`)")


def load_model(path: str | Path) -> Model:
    """Read, check and normalize an ONNX model, or raise BadInput saying what is wrong.

    External data (the `NAME.onnx.data` file torch's exporter writes beside the model) is read
    from beside the model wherever planner runs, and is part of the model's hash."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"model file not found: {path}")
    raw = path.read_bytes()
    try:
        proto = onnx.load_from_string(raw)
    except Exception as exc:  # onnx raises several unrelated types for corrupt files
        raise BadInput(f"{path} is not a valid ONNX model: {first_line(exc)}") from None
    data_files = _external_data(proto, path)
    digest = hashlib.sha256(raw)
    for location in data_files:
        digest.update(location.encode() + b"\0")
        with open(path.parent / location, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    try:
        if data_files:
            external_data_helper.load_external_data_for_model(proto, str(path.parent))
        onnx.checker.check_model(proto)
    except Exception as exc:
        raise BadInput(f"{path} is not a valid ONNX model: {first_line(exc)}") from None
    name_nodes(proto.graph)
    dequantize_weights(proto.graph)
    if (problem := unpaired_quantization(proto.graph)) is not None:
        raise BadInput(f"{path}: {problem}")
    tie_identities(proto.graph)
    apart = tie_copies(proto.graph) + tie_transposes(proto.graph)
    graph = proto.graph
    init_names = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in init_names]
    if not inputs:
        raise BadInput(f"{path}: the model takes no input")
    batches = {d.dim_value if d.HasField("dim_value") else d.dim_param for i in inputs for d in i.type.tensor_type.shape.dim[:1]}
    if len(batches) > 1:
        raise BadInput(f"{path}: the inputs' first dimensions differ ({', '.join(map(str, batches))}); each must be the batch")
    first = graph.output[0].type.tensor_type
    if len(graph.output) > 1 and first.HasField("shape") and len(first.shape.dim) == 0:
        del graph.output[1:]  # a model that computes its own loss first: the rest (its logits, say) is not trained
    if len(graph.output) != 1:
        raise BadInput(
            f"{path}: planner needs one output (logits, values or a reconstruction) or a scalar loss first, "
            f"found {len(graph.output)} outputs, the first of shape {_shape_text(first)}"
        )
    model_inputs = tuple(_model_input(path, i) for i in inputs)
    output = _resolved(proto, _model_output(path, graph.output[0]), model_inputs)
    parameters = parameters_of(graph)
    return Model(
        path=path.absolute(),  # not resolved: its data files are beside the path given, a link included
        proto=proto,
        sha256=digest.hexdigest(),
        data_files=tuple(data_files),
        inputs=model_inputs,
        fixed_batch=batch if isinstance(batch := next(iter(batches)), int) and batch > 0 else None,
        output=output,
        task=next((t for t in TASKS.values() if t.refuses(output, model_inputs) is None), CLASSIFICATION),
        parameters=parameters,
        layers=layers_of(proto, parameters),
        copies=tuple(tuple(g) for g in apart if all(n in parameters for n in g)),
    )


# The input types a step takes: float32 features, integer token ids and masks.
_INPUT_TYPES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.INT64: "int64",
    onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.BOOL: "bool",
}


def _model_input(path: Path, value: onnx.ValueInfoProto) -> ModelInput:
    """One graph input as a `ModelInput`, or BadInput when planner cannot feed it."""
    tensor = value.type.tensor_type
    dims = tensor.shape.dim
    if len(dims) < 1:  # [batch] is a value a sample (a class index a model computing its loss takes)
        raise BadInput(f"{path}: input '{value.name}' must be [batch, ...], got a scalar")
    if any(not d.HasField("dim_value") and not d.dim_param for d in dims[1:]):
        raise BadInput(f"{path}: input '{value.name}' has an unnamed dynamic dimension; name it (dynamic_axes) or fix it")
    if tensor.elem_type not in _INPUT_TYPES:
        kind = onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
        raise BadInput(f"{path}: input '{value.name}' is {kind}; planner feeds float32, int64, int32 or bool inputs")
    return ModelInput(value.name, tuple(d.dim_value or d.dim_param for d in dims[1:]), _INPUT_TYPES[tensor.elem_type])


def _model_output(path: Path, value: onnx.ValueInfoProto) -> ModelInput:
    """The graph's output as a `ModelInput`: its shape after the batch, a dynamic size by the name
    the exporter gave it (an input's length of the same name binds it)."""
    tensor = value.type.tensor_type
    if tensor.elem_type != onnx.TensorProto.FLOAT:
        kind = onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
        raise BadInput(f"{path}: output '{value.name}' is {kind}; planner trains models whose output is float32")
    dims = tensor.shape.dim
    if not dims:  # the batch's loss, computed by the model itself
        return ModelInput(value.name, (), "float32", batched=False)
    return ModelInput(value.name, tuple(d.dim_value or d.dim_param or "?" for d in dims[1:]), "float32")


def _shape_text(tensor: onnx.TypeProto.Tensor) -> str:
    return "[" + ", ".join(str(d.dim_value or d.dim_param or "?") for d in tensor.shape.dim) + "]"


def _resolved(proto: onnx.ModelProto, output: ModelInput, inputs: tuple[ModelInput, ...]) -> ModelInput:
    """`output` with each size the exporter named apart from every input's (the legacy exporter's
    `Addlogits_dim_1` for a tagger's sequence length) as ONNX's shape inference computes it from
    the inputs: a size the inputs fix, or one of their named lengths that data binds."""
    named = {d for i in inputs for d in i.shape if isinstance(d, str)}
    if all(isinstance(d, int) or d in named for d in output.shape) or not output.batched:
        return output
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    copy.graph.output[0].type.tensor_type.ClearField("shape")
    try:
        inferred = onnx.shape_inference.infer_shapes(copy, data_prop=True).graph.output[0].type.tensor_type.shape.dim
    except Exception:  # inference fails on some graphs: the names stay, and a task needing the size says so
        return output
    sizes = tuple(d.dim_value or d.dim_param or "?" for d in inferred[1:])
    if len(sizes) != len(output.shape):
        return output
    return ModelInput(output.name, tuple(s if isinstance(s, int) or s in named else o for s, o in zip(sizes, output.shape)))


def _external_data(proto: onnx.ModelProto, path: Path) -> list[str]:
    """The external data files the model names, each checked to be a file beside it (never a
    path out of the model's folder), in a fixed order."""
    locations = sorted(
        {
            entry.value
            for tensor in _tensors(proto.graph)
            if external_data_helper.uses_external_data(tensor)
            for entry in tensor.external_data
            if entry.key == "location"
        }
    )
    for location in locations:
        file = path.parent / location
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise BadInput(
                f"{path}: external data '{location}' lies outside the model's folder; planner reads only files beside the model"
            )
        if file.is_symlink():  # onnx refuses links too: one could point anywhere
            raise BadInput(f"{path}: external data '{location}' is a symbolic link; copy the file itself beside the model")
        if not file.is_file():
            raise BadInput(f"{path}: its weights are in '{location}', which is missing beside it (copy it next to {path.name})")
    return locations


def _tensors(graph: onnx.GraphProto):
    """Every tensor a graph holds: initializers and Constant values, subgraphs' included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            yield from attr.tensors
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                yield from _tensors(sub)


def save_onnx(model: Model, weights: dict[str, np.ndarray], path: str | Path) -> None:
    """Write `model` with its initializers replaced by `weights` (same names, shapes, dtypes), the
    way it came: a model whose weights were in an external data file gets `NAME.data` beside it."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    for i, tensor in enumerate(proto.graph.initializer):
        if tensor.name in weights:
            value = np.asarray(weights[tensor.name], dtype=numpy_helper.to_array(tensor).dtype)
            proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(value, tensor.name))
    path = Path(path)
    if model.data_files:
        data = path.with_name(f"{path.name}.data")
        data.unlink(missing_ok=True)  # onnx appends to an existing data file
        onnx.save(
            proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=0
        )
        data.chmod(path.stat().st_mode & 0o777)  # onnx creates it private (0600); it is the model, as readable
    else:
        onnx.save(proto, str(path))
