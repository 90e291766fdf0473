"""A compiled step as C: every kernel as TVM's C code generator writes it, and a driver that calls
them in the planned order with every tensor at a fixed offset in one static arena.

What planner builds is already a static program: after its own passes (fuse, schedule, update in
place, storages shared by lifetime) a step's lowered `train_step` holds only storages of a fixed
size, tensors at offset 0 of a storage, reshapes (views), kernel calls and kills — no VM builtin, no
shape function. So a step needs no VM where no VM runs (a microcontroller, a firmware image): the
driver places every tensor at an offset in an arena sized at build time (`_pack`), describes each
tensor once as a static `DLTensor`, and calls each kernel through TVM's packed C calling convention,
the one its C code generator emits. A kernel call's scratch (`TVMBackendAllocWorkspace`) is a
block of the arena planned for that call alone.

The step's C API (`train_step.h`), no heap, no OS:

    int32_t planner_step(void* const inputs[PLANNER_N_INPUTS], void* const params[PLANNER_N_PARAMS],
                         const int64_t* labels, float* loss);

`inputs` are the batch's model inputs (copied into the arena first unless they already lie there,
where `planner_inputs` points: `input_offsets`), `params` every other tensor the step takes in the
order of its `StepSignature` (frozen weights, trainable weights, optimizer states, the learning
rate last); the trainable weights and the states are updated where they are.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from planner.backend.mcu.ckernels import include_dirs, kernels_source, workspace_bytes
from planner.backend.mcu.ctemplates import HEADER, RUNTIME
from planner.backend.mcu.cvalues import ctype, label_dtype, literal, output_size, target_size
from planner.errors import CandidateFailed
from planner.runtime.convention import PREDICT_FUNC, STEP_FUNC
from planner.types import ModelInput, StepSignature

ALIGN = 64  # every tensor and scratch block starts on a cache line (and any SIMD load's alignment)


@dataclass(frozen=True)
class CStep:
    """A step's C sources and the static memory they declare."""

    kernels: str  # train_step.kernels.c: every kernel, TVM's C
    driver: str  # train_step.c: the arena, the tensors, the calls
    header: str  # train_step.h: the API
    arena_bytes: int  # every tensor at its offset (`_pack`): the most bytes alive at once, or a little more
    workspace_bytes: int  # the most scratch any one kernel call takes (a block of the arena, for that call)
    calls: tuple[str, ...]  # the kernel of each of the step's calls, in order


@dataclass
class _Tensor:
    """A tensor of the step: a C name, its shape and dtype, and where its data is."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    data: str  # a C expression of its address

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _itemsize(self.dtype)

    @property
    def callers(self) -> bool:
        """Whether it lies in one of the buffers the step's caller hands it (its inputs, params,
        labels), not at an address known when the firmware is linked (the arena, a constant)."""
        return any(caller in self.data for caller in _CALLERS)

    @property
    def ref(self) -> str:
        """A `DLTensor*` to it, as a kernel call passes it: its static descriptor, or, on a buffer
        of the caller's, a descriptor made where the call is (on the stack, for that call)."""
        if self.callers:
            return f"&(DLTensor){{{self.data}, {{kDLCPU, 0}}, {len(self.shape)}, {_dl_dtype(self.dtype)}, (int64_t*){self.name}_shape, 0, 0}}"
        return f"(DLTensor*)&{self.name}"


_CALLERS = ("inputs[", "params[", "labels")  # what the step's and the prediction's callers hand them


def _itemsize(dtype: str) -> int:
    t = tvm.runtime.DataType(dtype)
    return max(1, t.bits * t.lanes // 8)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _shape(expr: relax.Expr) -> tuple[int, ...]:
    values = expr.values if isinstance(expr, relax.ShapeExpr) else expr.ty.shape.values
    return tuple(int(d) for d in values)


def _op(value: relax.Expr) -> str:
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""


class _Driver:
    """Walks one lowered function once, in program order, and writes its C: its tensors named
    `PREFIX...`, its parameters' data the C expressions `params` gives in order."""

    def __init__(self, func: relax.Function, params: list[str], prefix: str, workspaces: dict[str, int], inputs: list[int]):
        if len(params) != len(func.params):
            raise CandidateFailed(f"the C back end expected {len(params)} parameters, the function takes {len(func.params)}")
        self.func, self.params, self.prefix = func, params, prefix
        self.tensors: dict[relax.Var, _Tensor] = {}
        self.blocks: list[_Block] = []  # every tensor the arena holds, with its lifetime
        self.block_of: dict[relax.Var, _Block] = {}  # a tensor, or a view of it, -> its block
        self.arena = 0
        self.constants: list[str] = []
        self.calls: list[tuple[int, str, list[_Tensor], _Tensor | None]] = []  # index, kernel, arguments, scratch
        self.workspaces = workspaces  # kernel symbol -> the scratch a call of it takes
        self.called: list[str] = []  # the kernel of each call, in order
        self.kernels: set[str] = set()
        self.tuples: dict[relax.Var, list[relax.Expr]] = {}
        self.max_args = 0  # the most arguments a kernel takes
        self.inputs = inputs  # where each model input lies in the arena (`input_offsets`)

    def _name(self, hint: str) -> str:
        return f"{self.prefix}{len(self.tensors)}_{re.sub(r'[^0-9A-Za-z_]', '_', hint)}"[:64]

    def _tensor(self, var: relax.Var, data: str, shape: tuple[int, ...] | None = None, dtype: str | None = None) -> _Tensor:
        ty = var.ty
        t = _Tensor(self._name(var.name), shape if shape is not None else _shape(var), dtype or str(ty.dtype), data)
        self.tensors[var] = t
        return t

    def _in_arena(self, var: relax.Var, t: _Tensor, at: int) -> None:
        block = _Block(t, _aligned(t.nbytes), at, at)
        self.blocks.append(block)
        self.block_of[var] = block

    def _use(self, expr: relax.Expr, at: int) -> None:
        """`expr` read (or written) by binding `at`: what it lives in lives until then."""
        for v in self.tuples.get(expr, [expr]) if isinstance(expr, relax.Var) else getattr(expr, "fields", [expr]):
            if isinstance(v, relax.Var) and v in self.block_of:
                block = self.block_of[v]
                block.end = max(block.end, at)

    def _argument(self, arg: relax.Expr) -> _Tensor:
        if isinstance(arg, relax.Var):
            if arg not in self.tensors:
                raise CandidateFailed(f"the C back end met {arg.name}, a value the step never made")
            return self.tensors[arg]
        if isinstance(arg, tvm.ir.Constant):
            value = arg.value.numpy()
            name = f"{self.prefix}c{len(self.constants)}"
            c = ctype(str(value.dtype))
            items = ", ".join(literal(v, str(value.dtype)) for v in value.ravel().tolist()) or "0"
            self.constants.append(f"static const {c} {name}_data[{max(1, value.size)}] = {{{items}}};")
            t = _Tensor(name, tuple(value.shape), str(value.dtype), f"(void*){name}_data")
            self.tensors[relax.Var(name, arg.ty)] = t
            return t
        raise CandidateFailed(f"the C back end cannot pass {type(arg).__name__} to a kernel")

    def walk(self) -> None:
        pinned = []
        for k, (p, data) in enumerate(zip(self.func.params, self.params)):
            if k < len(self.inputs):  # in the arena from before the first call to its last reader
                t = self._tensor(p, f"arena + {self.inputs[k]}")
                self._in_arena(p, t, -1)
                pinned.append((self.inputs[k], self.block_of[p]))
            else:
                self._tensor(p, data)
        at = 0
        for block in self.func.body.blocks:
            for binding in block.bindings:
                self._binding(binding.var, binding.value, at)
                at += 1
        self._use(self.func.body.body, at)  # what the function returns is read after its last call
        self.arena = _pack(self.blocks, pinned)

    def _binding(self, var: relax.Var, value: relax.Expr, at: int) -> None:
        op = _op(value)
        if op == "relax.memory.alloc_storage":
            pass  # TVM's storages are not kept: each tensor is placed on its own (`_pack`)
        elif op == "relax.memory.alloc_tensor":
            if int(value.args[1].value) != 0:
                raise CandidateFailed("the C back end takes tensors at the start of their storage")
            self._in_arena(var, self._tensor(var, ""), at)
        elif op == "relax.builtin.alloc_tensor":  # a tensor TVM did not plan (a returned one)
            self._in_arena(var, self._tensor(var, ""), at)
        elif op == "relax.reshape":
            source = self._argument(value.args[0])
            view = self._tensor(var, source.data)
            if value.args[0] in self.block_of:  # a view of an arena tensor, placed with it
                self.block_of[var] = self.block_of[value.args[0]]
                self.block_of[var].views.append(view)
        elif op in ("relax.memory.kill_tensor", "relax.memory.kill_storage"):
            pass
        elif isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar):
            for a in value.args:
                self._use(a, at)
            args = [self._argument(a) for a in value.args]
            symbol = f"__tvm_ffi_{value.op.name_hint}"
            self.kernels.add(symbol)
            index = len(self.called) if self.prefix == "s" else -1  # the step's calls are reported, one by one
            scratch = None
            if self.workspaces.get(symbol):  # the call's scratch: a block of the arena alive for the call alone
                scratch = _Tensor(f"{self.prefix}w{len(self.calls)}", (self.workspaces[symbol],), "uint8", "")
                self.blocks.append(_Block(scratch, _aligned(scratch.nbytes), at, at))
            self.calls.append((index, symbol, args, scratch))
            self.called.append(value.op.name_hint)
            self.max_args = max(self.max_args, len(args))
        elif isinstance(value, relax.Tuple):
            self.tuples[var] = list(value.fields)
        elif isinstance(value, relax.Var):
            self.tensors[var] = self.tensors[value]
            if value in self.block_of:
                self.block_of[var] = self.block_of[value]
        else:
            raise CandidateFailed(f"the C back end cannot emit {op or type(value).__name__} in the step")

    def outputs(self) -> list[_Tensor]:
        """What the function returns (a step: the loss, then each trainable weight and optimizer
        state as updated; a prediction: the logits)."""
        result = self.func.body.body
        fields = self.tuples.get(result) if isinstance(result, relax.Var) else None
        if fields is None:
            fields = list(result.fields) if isinstance(result, relax.Tuple) else [result]
        return [self._argument(f) for f in fields]

    def distinct(self) -> list[_Tensor]:
        """Every tensor once (a variable bound to another shares its tensor)."""
        return list({id(t): t for t in self.tensors.values()}.values())


@dataclass
class _Block:
    """A tensor in the arena: its bytes, the bindings where it is made and last read, its views."""

    tensor: _Tensor
    nbytes: int
    start: int
    end: int
    views: list[_Tensor] = field(default_factory=list)


def _pack(blocks: list[_Block], pinned: list[tuple[int, _Block]]) -> int:
    """Give each block an offset, no two blocks alive at once overlapping; returns the arena's size.
    `pinned` blocks (the model's inputs) keep the offsets given.

    Greedy by size (Pisarchyk & Lee, 2020, "offset calculation"): the largest block first, each at
    the lowest offset where it fits between the blocks already placed that are alive beside it.
    Why not TVM's storages, one after another: a storage is busy from its first tensor to its
    last, so a step of many short-lived small tensors (a CNN's first maps computed in row bands,
    `backend.bands`) held three times what is alive at once; by offsets, the arena comes within
    a few percent of that."""
    placed = list(pinned)
    arena = max((o + b.nbytes for o, b in pinned), default=0)
    fixed = {id(b) for _, b in pinned}
    for block in sorted((b for b in blocks if id(b) not in fixed), key=lambda b: (-b.nbytes, b.start)):
        offset = 0
        beside = sorted(((o, b) for o, b in placed if b.start <= block.end and block.start <= b.end), key=lambda ob: ob[0])
        for o, b in beside:
            if o - offset >= block.nbytes:
                break
            offset = max(offset, o + b.nbytes)
        placed.append((offset, block))
        arena = max(arena, offset + block.nbytes)
        for t in (block.tensor, *block.views):
            t.data = f"arena + {offset}"
    return arena


def input_offsets(sig: StepSignature) -> list[int]:
    """Where each model input lies in the arena: one after another from its start, each with room
    for a step's batch or a prediction's, whichever is larger.

    Why in the arena: an input is read by the first layers only, so once they ran its bytes can
    hold what comes after; as a buffer of its own it held them for the whole step (MobileNetV2 at
    128x128: 192 KB, beside a 224 KB arena). The caller writes a batch where `planner_inputs`
    points (into the arena) before each call; a call reuses that memory."""
    offsets, at = [], 0
    for i in sig.inputs:
        offsets.append(at)
        at += _aligned(max(sig.batch_size, sig.micro_batch) * int(np.prod(i.static, dtype=np.int64)) * _itemsize(i.dtype))
    return offsets


def _inputs_in(d: _Driver, batch: int, sig: StepSignature) -> list[str]:
    """A call's first statements: each input its caller handed elsewhere copied into the arena."""
    lines = []
    for k, (offset, i) in enumerate(zip(d.inputs, sig.inputs)):
        nbytes = batch * int(np.prod(i.static, dtype=np.int64)) * _itemsize(i.dtype)
        lines.append(f"  if (inputs[{k}] != (void*)(arena + {offset})) memcpy(arena + {offset}, inputs[{k}], {nbytes});")
    return lines


def _dl_dtype(dtype: str) -> str:
    t = tvm.runtime.DataType(dtype)
    return f"{{{int(t.type_code)}, {int(t.bits)}, {int(t.lanes)}}}"


def _step_signature(sig: StepSignature) -> str:
    return (
        f"int32_t planner_step(void* const inputs[{max(1, len(sig.inputs))}], void* const params[{max(1, _n_params(sig))}], "
        "const int64_t* labels, float* loss)"
    )


def _predict_signature(sig: StepSignature) -> str:
    return (
        f"int32_t planner_logits_of(void* const inputs[{max(1, len(sig.inputs))}], "
        f"void* const params[{max(1, _n_params(sig))}], float* logits)"
    )


def _n_params(sig: StepSignature) -> int:
    return len(sig.frozen) + len(sig.trainable) + len(sig.optim_states)


def _tensors(d: _Driver) -> list[str]:
    """Each tensor of `d` once: its shape, and for one at a fixed address (the arena, a constant:
    `_Tensor.callers`) its `DLTensor`, all constants. A tensor on a buffer of the caller's has no
    static descriptor: each call that reads it makes one (`_Tensor.ref`).

    Why: a board's constants stay in flash, its variables take SRAM. MobileNetV2's 1,171
    descriptors, 40 bytes each, held 46 KB of SRAM as variables, a fifth of its step's arena,
    635 of them for the weights the step and the prediction are handed."""
    lines = []
    for t in d.distinct():
        lines.append(f"static const int64_t {t.name}_shape[{max(1, len(t.shape))}] = {{{', '.join(map(str, t.shape)) or '1'}}};")
        if not t.callers:
            lines.append(
                f"static const DLTensor {t.name} = {{(void*)({t.data}), {{kDLCPU, 0}}, {len(t.shape)}, {_dl_dtype(t.dtype)}, "
                f"(int64_t*){t.name}_shape, 0, 0}};"
            )
    return lines


def _body(d: _Driver) -> list[str]:
    """A function's statements: the kernels called, each that takes scratch given its block first."""
    lines = []
    for index, symbol, args, scratch in d.calls:
        if scratch is not None:
            lines.append(f"  SCRATCH({scratch.data}, {scratch.nbytes});")
        lines.append(f"  CALL({index}, {symbol}, {', '.join(a.ref for a in args)});")
    return lines


def _driver(step: _Driver, predict: _Driver, sig: StepSignature, arena: int, workspace: int) -> str:
    """train_step.c: the tensors, the runtime, `planner_step` and `planner_logits_of`."""
    kernels = sorted(step.kernels | predict.kernels)
    lines = [
        "/* Generated by planner: one training step, every tensor at a fixed place (see train_step.h). */",
        '#include "train_step.h"',
        "",
        "#include <math.h>",
        "#include <string.h>",
        "",
        '#include "tvm/ffi/c_api.h"',
        "",
        *(f"extern int32_t {k}(void* self, void* args, int32_t num_args, void* result);" for k in kernels),
        "",
        RUNTIME.substitute(arena=arena, align=ALIGN, max_args=max(1, step.max_args, predict.max_args)),
        *step.constants,
        *predict.constants,
        *_tensors(step),
        *_tensors(predict),
        "",
        f"void* const planner_inputs[{max(1, len(sig.inputs))}] = "
        f"{{{', '.join(f'(void*)(arena + {o})' for o in step.inputs) or '0'}}};",
        "",
        _step_signature(sig) + " {",
        *_inputs_in(step, sig.batch_size, sig),
        *_body(step),
    ]
    loss, *updated = step.outputs()
    lines.append(f"  *loss = *(float*)({loss.data});")
    for i, t in enumerate(updated, start=len(sig.frozen)):  # a weight or state the step did not update where it was
        lines.append(f"  if ((void*)({t.data}) != params[{i}]) memcpy(params[{i}], (void*)({t.data}), {t.nbytes});")
    lines += ["  return 0;", "}", "", _predict_signature(sig) + " {", *_inputs_in(predict, sig.micro_batch, sig), *_body(predict)]
    (logits,) = predict.outputs()
    lines += [f"  memcpy(logits, (void*)({logits.data}), {logits.nbytes});", "  return 0;", "}", ""]
    return "\n".join(lines)


def emit(lowered: tvm.IRModule, sig: StepSignature) -> CStep:
    """The C of `lowered` (a memory-planned module, `planner.backend.vm.compile`) and its step's API.

    The step and the prediction never run at once, so they share one arena, sized for the larger."""
    kernels = kernels_source(lowered)
    n_inputs, n_weights = len(sig.inputs), len(sig.frozen) + len(sig.trainable)
    inputs = [f"inputs[{i}]" for i in range(n_inputs)]
    params = [f"params[{i}]" for i in range(_n_params(sig))]
    workspaces = workspace_bytes(kernels, ALIGN)
    offsets = input_offsets(sig)
    step = _Driver(lowered[STEP_FUNC], [*inputs, *params, "(void*)labels"], "s", workspaces, offsets)
    predict = _Driver(lowered[PREDICT_FUNC], [*inputs, *params[:n_weights]], "p", workspaces, offsets)
    step.walk()
    predict.walk()
    arena, workspace = max(ALIGN, step.arena, predict.arena), max(workspaces.values(), default=0)
    header = HEADER.substitute(
        batch=sig.batch_size,
        predict_batch=sig.micro_batch,
        n_inputs=n_inputs,
        n_classes=sig.output_shape[-1] if sig.output_shape else 1,  # (a scalar output: the model's own loss)
        output_size=output_size(sig),
        target_size=target_size(sig),
        task=sig.task,
        label_type=ctype(label_dtype(sig)),
        label_what=(
            "a class index, 0 to PLANNER_N_CLASSES - 1: the smallest type that holds it"
            if sig.task == "classification"
            else "unused (zeros): the model computes its own loss from its inputs"
            if sig.task == "loss-in-model"
            else "a class index per token, -100 for padding"
            if sig.target.integer
            else "a float target"
        ),
        n_params=_n_params(sig),
        n_frozen=len(sig.frozen),
        n_state=_n_params(sig) - len(sig.frozen),
        n_trainable=len(sig.trainable),
        arena=arena,
        workspace=workspace,
        n_calls=len(step.called),
        inputs="\n".join(_input_line(k, i) for k, i in enumerate(sig.inputs)),
        step_signature=_step_signature(sig),
        predict_signature=_predict_signature(sig),
    )
    driver = _driver(step, predict, sig, arena, workspace)
    return CStep(kernels, driver, header, arena, workspace, tuple(step.called))


def _input_line(k: int, i: ModelInput) -> str:
    """Input `k` as train_step.h describes it: what the caller writes where `planner_inputs` points."""
    line = f"   {k}: {i.name}, {i.dtype} [PLANNER_BATCH, {', '.join(map(str, i.shape))}]"
    if i.encoding is None:
        return line
    code = i.encoding
    return line + (
        "\n      8-bit codes the step decodes as code * scale[c] + offset[c] (an image: its pixels before"
        "\n      ToTensor and Normalize), scale {"
        + ", ".join(f"{v:.9g}" for v in code.scale)
        + "}, offset {"
        + ", ".join(f"{v:.9g}" for v in code.offset)
        + "}"
    )


def write_sources(step: CStep, directory: Path) -> list[Path]:
    """The step's C sources in `directory`: the driver, the kernels, the header."""
    files = {"train_step.c": step.driver, "train_step.kernels.c": step.kernels, "train_step.h": step.header}
    for name, text in files.items():
        (directory / name).write_text(text)
    return [directory / name for name in files]


def compile_host(step: CStep, directory: Path, *, compiler: str = "gcc") -> Path:
    """The step built for this machine as a shared library (`train_step.host.so` in `directory`),
    with no floating-point contraction: the step the VM runs, computed in the same order."""
    sources = [s for s in write_sources(step, directory) if s.suffix == ".c"]
    library = directory / "train_step.host.so"
    flags = ["-O2", "-ffp-contract=off", "-shared", "-fPIC", *(f"-I{d}" for d in include_dirs())]
    done = subprocess.run([compiler, *flags, "-o", str(library), *map(str, sources), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        raise CandidateFailed(
            f"{compiler} cannot build the C step: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
        )
    return library
