"""The caches verify what they read: a damaged or edited entry (a step, a kernel object, an accuracy
result) is a miss and is built again — never loaded, never a crash. A cache or disk that cannot be
written, or a compiler gone, is an `EnvironmentFailure` (the machine's fault), never a failed trial.

Real compiles of the tiny model, each in its own cache (not the session's shared one)."""

from __future__ import annotations

import errno
import inspect
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tvm

from planner import cachefile
from planner.backend.cache import META_NAME, check_cache_dir
from planner.backend.lower import kernels, link
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.sgemm import gemm, gemm_kernels
from planner.backend.vm.compile import LIB_NAME, compile_candidate
from planner.errors import EnvironmentFailure
from planner.inputs.data import load_dataset
from planner.inputs.model import load_model
from planner.measurement.accuracy import measure_accuracy
from planner.runtime.session import TrainingSession
from planner.types import Candidate

HOST = tvm.target.Target({"kind": "llvm"})


def _candidate(model) -> Candidate:
    head = [layer.name for layer in model.layers if layer.weight or layer.bias][-1]
    return Candidate(trainable=((head, "full"),), batch_size=4, optimizer="sgd", lr=0.05)


def _losses(model, library: Path, step) -> list[float]:
    rng = np.random.default_rng(0)
    session = TrainingSession(library, step.signature, model.initializers)
    return [
        session.step(rng.normal(0, 1, (4, *model.only_input.shape)).astype(np.float32), rng.integers(0, model.n_classes, 4))
        for _ in range(3)
    ]


@pytest.fixture(scope="module")
def pristine(tiny_model, tmp_path_factory):
    """A cache holding the tiny model's compiled candidate, its library's bytes, and the losses of
    three steps with it (trained from a copy: the cached library is never loaded here)."""
    model = load_model(tiny_model)
    cache = tmp_path_factory.mktemp("pristine") / "cache"
    with pytest.MonkeyPatch.context() as mp:  # lowered afresh: an earlier test's kernels never reach this cache
        mp.setattr(kernels._Remembered, "memo", type(kernels._Remembered.memo)())
        gemm._built.cache_clear()
        gemm._parsed.cache_clear()
        step = compile_candidate(model, _candidate(model), BuildOptions(HOST, cache))
    copy = tmp_path_factory.mktemp("reference") / LIB_NAME
    shutil.copyfile(step.library, copy)
    return model, cache, step, copy.read_bytes(), _losses(model, copy, step)


@pytest.fixture
def cache(pristine, tmp_path) -> Path:
    """A copy of the pristine cache, to damage."""
    shutil.copytree(pristine[1], tmp_path / "cache")
    return tmp_path / "cache"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_body(path: Path, edit) -> None:
    """Change the stored body, leaving its (now stale) hash: a hand edit."""
    stored = json.loads(path.read_text())
    edit(stored["body"])
    path.write_text(json.dumps(stored))


def _rehash(path: Path, edit) -> None:
    """Change the stored body and write a matching hash: what the hash cannot catch, so the
    reader's own checks must."""
    stored = json.loads(path.read_text())
    edit(stored["body"])
    cachefile.write_json(path, stored["body"], path.parent.name if path.name == META_NAME else path.stem)


STEP_DAMAGE = {
    "truncated library": lambda e: _truncate(e / LIB_NAME),
    "library with a flipped byte": lambda e: _flip_a_byte(e / LIB_NAME),
    "library gone": lambda e: (e / LIB_NAME).unlink(),
    "edited memory": lambda e: _edit_body(e / META_NAME, lambda b: b["memory"].update(total=1024)),
    "truncated metadata": lambda e: _truncate(e / META_NAME),
    "metadata not JSON": lambda e: (e / META_NAME).write_bytes(b"\x00\xff garbage"),
    "metadata without its hash": lambda e: (e / META_NAME).write_text(
        json.dumps(json.loads((e / META_NAME).read_text())["body"])
    ),
    "metadata missing a field": lambda e: _rehash(e / META_NAME, lambda b: b.pop("signature")),
}


@pytest.mark.parametrize("damage", STEP_DAMAGE)
def test_a_damaged_step_entry_is_rebuilt_not_loaded(pristine, cache, damage):
    """Without the check, a truncated library is dlopened (SIGBUS: the test process dies) and an
    edited memory number is adopted; here each damage is a miss: the entry is rebuilt under the
    lock, byte for byte the library a fresh build makes, and trains the same."""
    model, _, fresh, library, losses = pristine
    entry = cache / "steps" / fresh.directory.name
    STEP_DAMAGE[damage](entry)

    # checked before anything loads the library: a damaged one that was used fails here, not in dlopen
    rebuilt = compile_candidate(model, _candidate(model), BuildOptions(HOST, cache))
    assert not rebuilt.cached, "the damaged entry was used"
    assert rebuilt.library.read_bytes() == library
    assert rebuilt.memory == fresh.memory and rebuilt.signature == fresh.signature
    assert _losses(model, rebuilt.library, rebuilt) == losses
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name, f"{entry.name}.lock"]  # no .bad-*, no .tmp-*
    assert compile_candidate(model, _candidate(model), BuildOptions(HOST, cache)).cached  # and the new entry verifies


def _workspaces_doubled(body: dict) -> None:
    body["workspaces"] = [2 * w + 1024 for w in body["workspaces"]] or [1024]


KERNEL_DAMAGE = {
    "truncated object": lambda o: _truncate(o),
    "edited workspaces": lambda o: _edit_body(o.with_suffix(".json"), _workspaces_doubled),
    "metadata not JSON": lambda o: o.with_suffix(".json").write_text("{"),
}


@pytest.mark.parametrize("damage", KERNEL_DAMAGE)
def test_a_damaged_kernel_object_is_compiled_again(pristine, cache, damage):
    """Without the check, a truncated object breaks the link of every step that uses the kernel
    (a failed trial, for ever) and an edited workspace size changes the planned memory."""
    model, _, fresh, library, losses = pristine
    objects = sorted(link.objects_dir(cache, HOST).glob("*.o"))
    for obj in objects:
        KERNEL_DAMAGE[damage](obj)
    shutil.rmtree(cache / "steps")  # the step is linked again from its kernels

    rebuilt = compile_candidate(model, _candidate(model), BuildOptions(HOST, cache))
    assert sorted(link.objects_dir(cache, HOST).glob("*.o")) == objects
    assert rebuilt.library.read_bytes() == library
    assert rebuilt.memory == fresh.memory
    assert _losses(model, rebuilt.library, rebuilt) == losses


PARSED_KERNEL_DAMAGE = {
    "none (loaded, not parsed)": lambda p: None,
    "truncated": _truncate,
    "a flipped byte": _flip_a_byte,
    "not TVM's JSON": lambda p: _rehash(p, lambda b: b.update(tir='{"root": 1, "nodes": []}')),
    "another kernel's key": lambda p: _rehash(p, lambda b: b["made_of"].__setitem__(2, b["made_of"][2] + 1)),
    "another kernel's TIR": lambda p: _rehash(
        p, lambda b: b.update(tir=tvm.ir.save_json(tvm.tirx.PrimFunc([], tvm.tirx.Evaluate(0))))
    ),
}


@pytest.mark.parametrize("damage", PARSED_KERNEL_DAMAGE)
def test_a_damaged_parsed_kernel_is_parsed_again(pristine, cache, damage, monkeypatch):
    """The OpenBLAS convolutions' TIR is kept parsed in the cache (`gemm.built`): an intact entry
    loads as the very kernel parsing makes (the same step to the byte), a damaged one is parsed
    again from the source and stored again whole."""
    model, _, fresh, library, losses = pristine
    entries = sorted(gemm.kernels_dir(cache).glob("*.json"))
    assert entries, "the tiny model's convolutions went through OpenBLAS and were kept"
    for entry in entries:
        PARSED_KERNEL_DAMAGE[damage](entry)
    shutil.rmtree(cache / "steps")
    shutil.rmtree(link.objects_dir(cache, HOST))
    monkeypatch.setattr(kernels._Remembered, "memo", type(kernels._Remembered.memo)())  # this process lowers again
    gemm._built.cache_clear()
    gemm._parsed.cache_clear()

    inodes = [e.stat().st_ino for e in entries]

    rebuilt = compile_candidate(model, _candidate(model), BuildOptions(HOST, cache))
    assert rebuilt.library.read_bytes() == library
    assert _losses(model, rebuilt.library, rebuilt) == losses
    assert all(cachefile.read_json(e, e.stem) is not None for e in entries)
    kept = [e.stat().st_ino for e in entries] == inodes  # an entry parsed again is written anew
    assert kept == damage.startswith("none")


def test_a_kernel_parsed_after_its_source_changed_is_not_kept(pristine, tmp_path, monkeypatch):
    """TVMScript parses the kernels' modules as they are on disk: changed under a running study (a
    checkout), the kernel it gives must not be kept under the key of the source the process was
    started with."""
    model = pristine[0]
    monkeypatch.setattr(kernels._Remembered, "memo", type(kernels._Remembered.memo)())
    gemm._built.cache_clear()
    gemm._parsed.cache_clear()
    monkeypatch.setattr(gemm, "_source_id", lambda: "another source")
    compile_candidate(model, _candidate(model), BuildOptions(HOST, tmp_path / "cache"))
    assert not list(gemm.kernels_dir(tmp_path / "cache").glob("*.json"))


def test_every_module_of_the_kernels_tvmscript_keys_them(tmp_path, monkeypatch):
    """TVMScript parses the OpenBLAS kernels, and the macros they call from another module, from
    their modules as they are on disk: every planner module whose code the kernels use keys the
    kernels kept parsed (`gemm._source_id`), and an edit to any of them changes the key."""
    used = {Path(gemm_kernels.__file__).resolve()} | {
        Path(inspect.getsourcefile(v) or "").resolve()
        for v in vars(gemm_kernels).values()
        if callable(v) and str(getattr(v, "__module__", None)).startswith("planner.")  # not a value such as LIMITS
    }
    assert used == {path.resolve() for path in gemm._KERNEL_SOURCES}
    copies = [tmp_path / path.name for path in gemm._KERNEL_SOURCES]
    for path, copy in zip(gemm._KERNEL_SOURCES, copies):
        shutil.copy(path, copy)
    monkeypatch.setattr(gemm, "_KERNEL_SOURCES", tuple(copies))
    assert gemm._source_id() == gemm._MADE_BY
    for copy in copies:
        before = gemm._source_id()
        copy.write_text(copy.read_text() + "\n")
        assert gemm._source_id() != before


@pytest.fixture
def measured(pristine, tiny_data, tmp_path):
    """The tiny model's accuracy measured once into a fresh cache: (measure again, first result, its file)."""
    model, _, step, _, _ = pristine
    data = load_dataset(tiny_data, model)
    cache = tmp_path / "acc-cache"

    def measure():
        return measure_accuracy(model, data, _candidate(model), step, 6, 0, cache)

    first = measure()
    (path,) = (cache / "accuracy").glob("*.json")
    return measure, first, path


ACCURACY_DAMAGE = {
    "edited after": lambda p, first: _edit_body(p, lambda b: b.update(after=0.99 if first.after != 0.99 else 0.5)),
    "not JSON": lambda p, first: p.write_text('{"sha256": '),
    "after out of range": lambda p, first: _rehash(p, lambda b: b.update(after=1.5)),
    "steps not a count": lambda p, first: _rehash(p, lambda b: b.update(steps="six")),
    "a field missing": lambda p, first: _rehash(p, lambda b: b.pop("before")),
    "a field too many": lambda p, first: _rehash(p, lambda b: b.update(board="pi")),
}


@pytest.mark.parametrize("damage", ACCURACY_DAMAGE)
def test_a_damaged_accuracy_result_is_measured_again(measured, damage):
    """Without the check an edited `after` is reported as the candidate's accuracy, and malformed
    JSON crashes the trial; here both are misses, measured again to the very same values."""
    measure, first, path = measured
    ACCURACY_DAMAGE[damage](path, first)
    again = measure()
    assert (again.before, again.after, again.loss_before, again.loss_after, again.steps, again.diverged_at) == (
        first.before,
        first.after,
        first.loss_before,
        first.loss_after,
        first.steps,
        first.diverged_at,
    )
    assert measure() == again  # the fresh result is stored, and read back as is


BEFORE_DAMAGE = {
    "edited accuracy": lambda p: _edit_body(p, lambda b: b.update(accuracy=0.99 if b["accuracy"] != 0.99 else 0.5)),
    "not JSON": lambda p: p.write_text("{"),
    "accuracy out of range": lambda p: _rehash(p, lambda b: b.update(accuracy=1.5)),
    "loss not a number": lambda p: _rehash(p, lambda b: b.update(loss="low")),
    "a field missing": lambda p: _rehash(p, lambda b: b.pop("loss")),
}


@pytest.mark.parametrize("damage", BEFORE_DAMAGE)
def test_a_damaged_accuracy_before_fine_tuning_is_measured_again(measured, damage):
    """The untouched model's val accuracy is cached apart (one value for every candidate of a
    precision): a damaged one is a miss, measured again, never reported."""
    measure, first, path = measured
    (before,) = (path.parent / "before").glob("*.json")
    path.unlink()  # the candidate's own result: measured again, and it reads the before-value
    BEFORE_DAMAGE[damage](before)
    again = measure()
    assert (again.before, again.loss_before, again.after) == (first.before, first.loss_before, first.after)


def test_the_accuracy_before_fine_tuning_is_measured_once_per_precision_and_int8_weights(pristine, tiny_data, tmp_path):
    """Candidates that differ only in what trains or their batch share the untouched model's val
    accuracy; int8 frozen weights change the model, so they measure their own."""
    model, _, _, _, _ = pristine
    data = load_dataset(tiny_data, model)
    cache = tmp_path / "cache"
    base = _candidate(model)
    first = [layer.name for layer in model.layers if layer.weight][0]
    candidates = [
        base,
        replace(base, batch_size=2),
        replace(base, trainable=((first, "full"),)),
        replace(base, frozen_weights="int8"),
    ]
    results, own = [], []
    for candidate in candidates:
        step = compile_candidate(model, candidate, BuildOptions(HOST, cache))
        results.append(measure_accuracy(model, data, candidate, step, 2, 0, cache))
        own.append(
            TrainingSession(step.library, step.signature, model.initializers).evaluate(*data.val.batch(np.arange(len(data.val))))
        )
    assert len(list((cache / "accuracy" / "before").glob("*.json"))) == 2
    assert all((r.loss_before, r.before) == (results[0].loss_before, results[0].before) for r in results[1:3])
    for r, (loss, accuracy) in zip(results, own):  # each the value its own step computes, to rounding
        assert r.before == accuracy and r.loss_before == pytest.approx(loss, rel=1e-5)
    assert (results[3].loss_before, results[3].before) == own[3]  # int8: its own measurement


def test_check_cache_dir_creates_a_missing_one(tmp_path):
    assert check_cache_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir() and not any((tmp_path / "a" / "b").iterdir())  # the probe is gone


def test_check_cache_dir_refuses_a_file(tmp_path):
    (tmp_path / "cache").write_text("not a directory")
    with pytest.raises(EnvironmentFailure, match=r"compile cache .*cache: it is a file.*PLANNER_CACHE_DIR") as err:
        check_cache_dir(tmp_path / "cache")
    assert len(str(err.value).splitlines()) == 1
    with pytest.raises(EnvironmentFailure, match="not a directory"):
        check_cache_dir(tmp_path / "cache" / "sub")


def test_check_cache_dir_refuses_a_full_disk(tmpfs):
    """Creating a file is not enough: on a full disk the probe's first byte fails."""
    disk = tmpfs("size=64k")
    if disk is None:
        pytest.skip("needs a tmpfs mount (root) for a disk that really fills up")
    (disk / "cache").mkdir()
    _fill(disk, 0)
    with pytest.raises(EnvironmentFailure, match=rf"compile cache {re.escape(str(disk))}/cache: no space left on device \(set"):
        check_cache_dir(disk / "cache")


_PROBE_READ_ONLY = """
import sys
from planner.backend.cache import check_cache_dir
from planner.errors import EnvironmentFailure
try:
    check_cache_dir(sys.argv[1])
except EnvironmentFailure as exc:
    print(f"EnvironmentFailure: {exc}")
"""


def test_check_cache_dir_refuses_a_read_only_directory(tmpfs, tmp_path):
    """Root ignores permission bits, so a read-only directory needs a read-only file system: a
    read-only tmpfs when this process can mount one, else a read-only bind mount in a user and
    mount namespace of its own (`unshare -rm`)."""
    ro = tmpfs("ro,size=64k")
    if ro is not None:
        with pytest.raises(
            EnvironmentFailure,
            match=rf"cannot use the compile cache {re.escape(str(ro))}: read-only file system \(set PLANNER_CACHE_DIR",
        ):
            check_cache_dir(ro)
        return
    if shutil.which("unshare") is None:
        pytest.skip("no tmpfs mount (needs root) and no unshare(1) for a read-only bind mount")
    directory = tmp_path / "ro"
    directory.mkdir()
    script = f'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && exec "{sys.executable}" -c "$2" "$1"'
    res = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", str(directory), _PROBE_READ_ONLY],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "EnvironmentFailure" not in res.stdout and res.returncode != 0:
        pytest.skip(f"no tmpfs mount, and no read-only bind mount in a namespace: {res.stderr.strip()[-300:]}")
    assert f"cannot use the compile cache {directory}: read-only file system (set PLANNER_CACHE_DIR" in res.stdout


_COMPILE = """
import json, sys
from pathlib import Path
import tvm
from planner.backend.lower.pipeline import BuildOptions
from planner.backend.vm.compile import compile_candidate
from planner.errors import CandidateFailed, EnvironmentFailure
from planner.inputs.model import load_model
from planner.types import Candidate
try:
    compile_candidate(load_model(sys.argv[1]), Candidate.from_json(json.loads(sys.argv[2])), BuildOptions(tvm.target.Target({"kind": "llvm"}), Path(sys.argv[3])))
except (EnvironmentFailure, CandidateFailed) as exc:
    print(f"{type(exc).__name__}: {exc}")
else:
    print("compiled")
"""


def _compile_in_child(model_path: Path, model, cache: Path, preexec_fn=None) -> str:
    """Compile in a child process: without planner's own writes, LLVM would exit the process on a
    full disk (`LLVM ERROR: IO failure on output stream`), which must not take pytest with it."""
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE, str(model_path), json.dumps(_candidate(model).to_json()), str(cache)],
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=preexec_fn,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip()


def _fill(disk: Path, leave: int) -> None:
    """Fill the file system of `disk` up to `leave` free bytes."""
    st = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(st.f_bavail * st.f_frsize - leave, 0))


def test_a_full_disk_writing_kernel_objects_is_an_environment_failure(tiny_model, pristine, tmpfs):
    """A 64 KiB disk: the kernel objects (planner writes them, not LLVM) do not fit."""
    disk = tmpfs("size=64k")
    if disk is None:
        pytest.skip("needs a tmpfs mount (root) for a disk that really fills up")
    model, _, step, _, _ = pristine
    out = _compile_in_child(tiny_model, model, disk / "cache")
    objects = link.objects_dir(disk / "cache", HOST)
    assert out == f"EnvironmentFailure: TVM compile: cannot write {disk / 'cache'}: no space left on device"
    assert [p.name for p in (disk / "cache" / "steps").iterdir()] == [f"{step.directory.name}.lock"]
    assert not list(objects.glob(".tmp-*")), "a partial object is left"


def test_a_full_disk_linking_the_library_is_an_environment_failure(tiny_model, pristine, tmpfs):
    """The kernels are cached; the linker (a subprocess: its errno comes as text) runs out of room."""
    disk = tmpfs("size=4m")
    if disk is None:
        pytest.skip("needs a tmpfs mount (root) for a disk that really fills up")
    model, cache, step, library, _ = pristine
    shutil.copytree(cache / "kernels", disk / "cache" / "kernels")
    _fill(disk, len(library) // 2)
    out = _compile_in_child(tiny_model, model, disk / "cache")
    assert out == f"EnvironmentFailure: linking the step: the linker cannot write into {disk / 'cache'}: no space left on device"
    assert [p.name for p in (disk / "cache" / "steps").iterdir()] == [f"{step.directory.name}.lock"]


def test_a_file_size_limit_linking_the_library_is_an_environment_failure(tiny_model, pristine, tmp_path):
    """RLIMIT_FSIZE (`ulimit -f`; needs no root) below the library's size: the linker is killed by
    SIGXFSZ while every kernel object fits."""
    model, cache, _, library, _ = pristine
    biggest = max(p.stat().st_size for p in (cache / "kernels").rglob("*"))
    limit = (biggest + len(library)) // 2
    assert biggest < limit < len(library)
    out = _compile_in_child(
        tiny_model, model, tmp_path / "cache", lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    )
    assert (
        out == f"EnvironmentFailure: linking the step: the linker cannot write into {tmp_path / 'cache'}: "
        "file too large (over the file size limit, see `ulimit -f`)"
    )


def test_a_failed_write_of_the_step_metadata_is_an_environment_failure(pristine, cache, monkeypatch):
    model, _, step, _, _ = pristine
    shutil.rmtree(cache / "steps")
    write_json = cachefile.write_json

    def full_disk(path: Path, body: dict, key: str) -> None:
        if path.name == META_NAME:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write_json(path, body, key)

    monkeypatch.setattr(cachefile, "write_json", full_disk)
    with pytest.raises(
        EnvironmentFailure, match=rf"^cannot write the compile cache {re.escape(str(cache))}: no space left on device$"
    ):
        compile_candidate(model, _candidate(model), BuildOptions(HOST, cache))
    assert [p.name for p in (cache / "steps").iterdir()] == [f"{step.directory.name}.lock"]


@pytest.mark.parametrize("how", ["toolchain", "CXX"])
def test_a_missing_compiler_is_an_environment_failure(pristine, cache, monkeypatch, how):
    """The (cross) compiler named by the target, or the host's ($CXX) gone: nothing can link, for
    any candidate, so it is not this candidate's failure."""
    model, *_ = pristine
    shutil.rmtree(cache / "steps")
    missing = "/nonexistent/planner-test-g++"
    toolchain = missing if how == "toolchain" else None
    if how == "CXX":
        monkeypatch.setenv("CXX", missing)
    with pytest.raises(EnvironmentFailure, match=re.escape(f"linking the step: the C++ compiler {missing} is not installed")):
        compile_candidate(model, _candidate(model), BuildOptions(HOST, cache, toolchain=toolchain))


def test_a_cache_removed_while_compiling_is_an_environment_failure(pristine, tmp_path, monkeypatch):
    """`rm -rf` of the cache while a compile runs: its next write finds no folder (not the candidate's fault)."""
    model, *_ = pristine
    cache = tmp_path / "cache"
    object_code = link._object_code

    def removing_the_cache(lib):
        shutil.rmtree(cache, ignore_errors=True)
        return object_code(lib)

    monkeypatch.setattr(link, "_object_code", removing_the_cache)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # kernels one at a time: none re-creates the folder
    with pytest.raises(EnvironmentFailure, match=rf"^TVM compile: {re.escape(str(cache))}/kernels/\w+/\.tmp-\w+\.o: not found$"):
        compile_candidate(model, _candidate(model), BuildOptions(HOST, cache))
