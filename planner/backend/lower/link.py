"""A step's executable linked from per-kernel object files, cached by content.

Candidates of one model share most of their kernels: the forward pass is the same for every
candidate of a batch size, and a layer's backward kernels recur in every candidate that trains it.
LLVM's code generation is most of a compile (MobileNetV2-0.35@96: 7 of 11 s), so each kernel is
compiled once into its own object file, named by a hash of its final TIR, and every later
candidate, plan and run links those objects again instead of regenerating them. The VM code that
calls the kernels is generated per candidate (it is cheap) and linked over them.

A kernel's symbol is its content hash, so two identical kernels of one step become one; its
workspace sizes (read from its LLVM IR when it is compiled) are stored beside its object for the
memory model, with the object's sha256 (see `cachefile`): an object that does not match is
compiled again. Objects are written to a temporary name and renamed into place: parallel workers
compiling the same kernel keep one of the identical results.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax import vm_build
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.s_tir.analysis import estimate_tir_flops

from planner import cachefile
from planner.backend.graph.memory import kernel_workspaces
from planner.backend.sgemm.gemm_kernels import FLOPS

# The finishing passes of relax.build's pipeline (CPU targets)
_FINISH = (
    relax.transform.LowerRuntimeBuiltin,
    relax.transform.ComputePrimValue,
    relax.transform.VMShapeLower,
    relax.transform.AttachGlobalSymbol,
)


def linker(toolchain: str | None):
    """`export_library`'s `fcompile` for a (cross) toolchain; None links with the host's compiler.

    The triple comes from the toolchain itself: with only linked objects and no LLVM module,
    nothing else tells `export_library` which machine to pack the kernel table for."""
    if toolchain is None:
        return None
    cc = tvm.support.cc
    return cc.cross_compiler(toolchain, get_target_triple=cc.get_target_by_dump_machine(toolchain))


# How each kernel is generated. Without TVM's checks of a kernel's arguments (dtype, rank, shape,
# strides, device; its packed-call wrapper's asserts): the VM calls kernels only on tensors it
# allocated from the memory plan or took in at the step's entry, where it checks each one itself,
# so those checks never fire — and they were a fifth of each kernel's LLVM time (a MobileNetV2
# candidate's 141 kernels: 7.0-8.4 s with them, 5.9-6.2 s without).
CODEGEN = {"tirx.disable_assert": True}


def objects_dir(cache_dir: Path, target: tvm.target.Target) -> Path:
    """Where kernels compiled for `target` by this TVM, as `CODEGEN` says, live (code generation
    depends on all three)."""
    tag = hashlib.sha256(f"{target}|{tvm.__version__}|{sorted(CODEGEN.items())}".encode()).hexdigest()[:16]
    return cache_dir / "kernels" / tag


def _symbol(func: tirx.PrimFunc) -> str:
    return f"k_{tvm_ffi.structural_hash(func.without_attr('global_symbol')) & (2**64 - 1):016x}"


@mutator
class _Rename(PyExprMutator):
    def __init__(self, names: dict[str, relax.GlobalVar]):
        super().__init__()
        self.names = names

    def visit_global_var_(self, op: relax.GlobalVar) -> relax.Expr:
        return self.names.get(op.name_hint, op)


def _by_content(mod: tvm.IRModule) -> tuple[tvm.IRModule, dict[str, tirx.PrimFunc], dict[str, str]]:
    """`mod` with every kernel renamed to its content symbol (duplicates merged), the kernels by
    symbol, and each old kernel name's symbol."""
    bb = relax.BlockBuilder()
    kernels: dict[str, tirx.PrimFunc] = {}
    added: dict[str, relax.GlobalVar] = {}
    symbols: dict[str, str] = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            sym = symbols[gv.name_hint] = _symbol(func)
            if sym not in kernels:
                kernels[sym] = func.with_attr("global_symbol", sym)
                added[sym] = bb.add_func(kernels[sym], sym)
    rename = _Rename({name: added[sym] for name, sym in symbols.items()})
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            bb.add_func(rename.visit_expr(func), gv.name_hint)
    out = bb.get()
    return (out.with_attrs(mod.attrs) if mod.attrs else out), kernels, symbols


@dataclass(frozen=True)
class Kernel:
    """A compiled kernel as the step's profile names it: its symbol in the library, the name the
    compiler gave it (what it computes: `fused_conv2d_add_relu`, `conv2d_gemm`) and its
    floating-point operations per call."""

    symbol: str
    name: str
    flops: int


def _flops(func: tirx.PrimFunc) -> int:
    """A kernel's floating-point operations: declared by a library kernel (whose work is an
    external call TVM cannot see into), else counted from its loops by TVM."""
    declared = func.attrs.get(FLOPS) if func.attrs else None
    if declared is not None:
        return int(declared)
    try:
        return int(estimate_tir_flops(tvm.IRModule({"main": func})))
    except Exception:  # a loop TVM cannot bound: the profile shows its time without a rate
        return 0


# Kernel objects verified by this process, by the identity (inode, size, modification time) of
# the object and its metadata: a study links the same cached kernels into step after step, and
# hashing each object again cost ~6 ms a kernel (1.5 s of a MobileNetV2 step's 257). A file
# replaced or rewritten since has another identity and is verified again. The last 8,192 used are
# kept (a few hundred bytes each): the kernels of a study of one model, not of every study a
# long-lived worker ran.
_verified: OrderedDict[Path, tuple[tuple, list[int], int]] = OrderedDict()
_VERIFIED_KEPT = 8192
_verified_lock = threading.Lock()  # (objects are made in a pool of threads)


def _identity(*paths: Path) -> tuple | None:
    try:
        return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in (p.stat() for p in paths))
    except OSError:
        return None


def _object(sym: str, func: tirx.PrimFunc, target: tvm.target.Target, directory: Path) -> tuple[Path, list[int], int]:
    """The kernel's object file, workspace sizes and flops, compiled now unless they are cached
    (and verify). Writing them into the cache raises the OSError of a full disk or a read-only one."""
    obj, meta_path = directory / f"{sym}.o", directory / f"{sym}.json"
    identity = _identity(obj, meta_path)
    with _verified_lock:
        known = _verified.get(obj)
        if known is not None:
            _verified.move_to_end(obj)
    if known is not None and identity is not None and known[0] == identity:
        return obj, list(known[1]), known[2]
    meta = cachefile.read_json(meta_path, sym)
    if (
        meta is not None
        and cachefile.matches(obj, meta.get("object"))
        and isinstance(meta.get("workspaces"), list)
        and isinstance(meta.get("flops"), int)
    ):
        if identity is not None:
            with _verified_lock:
                _verified[obj] = (identity, meta["workspaces"], meta["flops"])
                if len(_verified) > _VERIFIED_KEPT:
                    _verified.popitem(last=False)
        return obj, meta["workspaces"], meta["flops"]
    with tvm.transform.PassContext(config=CODEGEN):  # (a pool thread: the caller's context is not here)
        lib = tvm.tirx.build(tvm.IRModule({sym: func}), target=target)
    workspaces = kernel_workspaces(lib.inspect_source("ll")).get(sym, [])
    flops = _flops(func)
    directory.mkdir(parents=True, exist_ok=True)
    cachefile.write_bytes(obj, _object_code(lib))
    # the object first: its metadata, written last, is what makes the pair valid
    cachefile.write_json(meta_path, {"workspaces": workspaces, "flops": flops, "object": cachefile.digest(obj)}, sym)
    return obj, workspaces, flops


def _object_code(lib: tvm.runtime.Module) -> bytes:
    """The kernel's object code. LLVM writes it into memory (a memfd), not onto the cache's disk:
    LLVM exits the whole process on a failed write (a full disk), where Python's write raises."""
    fd = os.memfd_create("kernel.o")
    with open(fd, "rb") as f:
        lib.write_to_file(f"/proc/self/fd/{fd}", "o")
        return f.read()


def build(
    mod: tvm.IRModule, target: tvm.target.Target, cache_dir: Path
) -> tuple[relax.VMExecutable, dict[str, list[int]], list[Kernel]]:
    """The executable of a memory-planned module, the workspace sizes of each of its kernels (by
    their names in `mod`), and its kernels as the library names them."""
    with target:
        mod = tvm.transform.Sequential([p() for p in _FINISH])(mod)
    names: dict[str, str] = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            names.setdefault(_symbol(func), gv.name_hint)
    mod, kernels, symbols = _by_content(mod)
    directory = objects_dir(cache_dir, target)
    libs, workspaces, table = [], {}, []
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        done = pool.map(lambda sym: _object(sym, kernels[sym], target, directory), kernels)
        for sym, (obj, workspaces[sym], flops) in zip(kernels, done):
            libs.append(tvm.runtime.load_static_library(str(obj), [sym]))
            table.append(Kernel(sym, names.get(sym, sym), flops))
    # relax.build's own two halves, with the kernels supplied as objects instead of compiled anew
    builder = relax.ExecBuilder()
    vm_build._vmcodegen(builder, mod, "bytecode")
    executable = vm_build._vmlink(builder, target, None, ext_libs=libs)
    return executable, {name: workspaces[sym] for name, sym in symbols.items()}, table
