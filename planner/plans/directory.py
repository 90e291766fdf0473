"""Output directories planner owns: checked before any trial, claimed, locked, replaced atomically.

Root ignores permission bits and a disk fills up mid-run, so the only honest checks are real
writes; failures anywhere (the plan files, the study's SQLite file) become `OutputUnwritable`.

Ownership: a directory planner writes into carries a `.planner` marker naming what it holds (a
plan, or a run's fine-tuned model). A directory that holds anything else is refused, never
overwritten: `--out ~/Documents` must not replace someone's `report.md`. The marker is also the
lock a writer holds, so two processes never write one directory at once.

Atomicity under kill -9 at any instant: the new files are staged in a hidden folder inside the
directory, then a commit record naming them is renamed into place (the instant the new contents
become the truth), then each file is renamed over its old version. Whoever next opens the
directory (a writer or a reader) finishes an interrupted roll-forward from the commit record, or
removes staged folders that never got one. So a reader sees the old files or the new ones, never
a mix, and nothing stale stays behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import ValidationError

from planner import faults
from planner.backend import ARTIFACT_STEM
from planner.digest import file_sha256
from planner.errors import BadInput, OutputUnwritable, reason
from planner.inputs.data import Dataset
from planner.inputs.model import Model, load_model
from planner.plans.schema import READS, Plan, content_sha256
from planner.tasks import task_named
from planner.types import Precision

# The plan directory's files: every module names them through these
PLAN_FILE = "plan.json"
WEIGHTS_FILE = "weights.npz"
MODEL_FILE = "model.onnx"
REPORT_MD = "report.md"
REPORT_HTML = "report.html"
TRIALS_FILE = "trials.json"
STUDY_FILE = "study.db"  # the CLI's study storage, when `--storage` is not given
TOKENIZER_FILE = "tokenizer.json"  # text data: the tokenizer `run` makes new text token ids with
# every name a plan directory holds: a model's external data file, copied in beside model.onnx,
# must not be one of them, nor a back end's artifact file (`ARTIFACT_STEM.*`)
RESERVED_NAMES = frozenset({PLAN_FILE, WEIGHTS_FILE, MODEL_FILE, REPORT_MD, REPORT_HTML, TRIALS_FILE, STUDY_FILE, TOKENIZER_FILE})

MARKER = ".planner"
COMMIT = ".planner-commit"
STAGED_PREFIX = ".staged-"
Kind = Literal["plan", "run"]
_WHAT: dict[object, str] = {"plan": "a plan directory", "run": "fine-tuned weights"}  # keyed by a marker's "kind"


def _foreign(out: Path, kind: Kind) -> list[str]:
    """Entries of `out` that say planner did not make it for `kind` (empty: it may be used)."""
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return []
    marker = out / MARKER
    if marker.is_file():
        try:
            text = marker.read_text()
            owner = json.loads(text).get("kind") if text else kind  # empty: torn by a kill as planner made it
        except (OSError, ValueError, AttributeError):
            owner = None
        return [] if owner == kind else [f"{MARKER} (it holds {_WHAT.get(owner, 'something else')})"]
    if kind == "plan" and (out / PLAN_FILE).is_file() and (out / STUDY_FILE).is_file():
        return []  # a plan directory from before markers existed
    return entries


def prepare_out_dir(out: str | Path, create: bool = True, kind: Kind = "plan") -> Path:
    """`out` once planner may write `kind` into it: new, empty, or marked as planner's `kind`.

    Created (with its marker) when `create`; else only checked (its nearest existing parent is
    probed, nothing is made). A file given as --out, a directory holding other files, a
    read-only directory or file system is one line, before any trial runs."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputUnwritable(f"`out` {out} is a file, not a directory; give a directory for the {kind}")
    if out.is_dir():
        foreign = _foreign(out, kind)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", …" if len(foreign) > 3 else "")
            raise BadInput(
                f"`out` {out} holds files planner did not write for {_WHAT[kind]} ({shown}); "
                "give a new or empty directory, so nothing of yours is overwritten"
            )
    try:
        if create:
            out.mkdir(parents=True, exist_ok=True)
        probe = out if create else next(p for p in (out, *out.absolute().parents) if p.exists())
        if not probe.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(probe))
        with tempfile.TemporaryFile(dir=probe, prefix=".planner-probe-"):
            pass  # root ignores permission bits: only a real file tells whether writing works
        if create:
            _create_marker(out / MARKER, kind)
    except OSError as exc:
        raise OutputUnwritable(f"cannot write the {kind} into {out}: {reason(exc)}") from None
    return out


def _create_marker(marker: Path, kind: Kind) -> None:
    """The marker, made once and never replaced: it is also the lock file, and a lock taken on
    one inode means nothing once a rename has put another in its place."""
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"kind": kind, "written_by": "planner"}) + "\n")


def release_if_empty(out: Path, created: bool = True) -> None:
    """When `out` holds nothing but planner's marker (a run that wrote nothing), remove the
    marker, and `out` itself if this run `created` it."""
    with suppress(OSError):
        if {p.name for p in out.iterdir()} <= {MARKER}:
            (out / MARKER).unlink(missing_ok=True)
            if created:
                out.rmdir()


_HELD: set[Path] = set()  # directories this process holds (re-entrant: `plan` holds, then writes)


@contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold `out` for this process: a second planner process writing into it (a second `plan`
    on the same --out) is refused with one line, instead of racing it (e.g. both creating the
    study database). The lock dies with the process, so kill -9 leaves no stale lock."""
    key = out.resolve()
    if key in _HELD:
        yield
        return
    marker = out / MARKER
    try:
        fd = os.open(marker, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise OutputUnwritable(f"cannot write into {out}: {reason(exc)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BadInput(f"another planner process is writing into {out}; wait for it, or give another `out`") from None
        _HELD.add(key)
        try:
            yield
        finally:
            _HELD.discard(key)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_STAGED = re.compile(r"\.staged-[A-Za-z0-9_]+")
KEPT = frozenset({STUDY_FILE, *(f"{STUDY_FILE}-{s}" for s in ("journal", "wal", "shm"))})  # never replaced or removed


def safe_name(name: object) -> bool:
    """Whether `name` may be written or removed in a planner directory: a plain relative path
    inside it, not planner's own bookkeeping, not the study. A commit record or an old plan.json
    comes from disk, and a directory someone sent you must not make planner delete or overwrite
    `../anything`."""
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    path = Path(name)
    return (
        not path.is_absolute()
        and ".." not in path.parts
        and "." not in path.parts
        and not path.parts[0].startswith((MARKER, STAGED_PREFIX))
        and name not in KEPT
    )


@contextmanager
def _dir_lock(out: Path, shared: bool) -> Iterator[None]:
    """flock on the directory itself: writers (`replace_files`) hold it exclusively while they
    replace files, readers share it while they verify and load, so a reader never sees (or
    loads) a mix, and never cleans up after a writer that is still at work."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextmanager
def reading(out: Path) -> Iterator[None]:
    """Hold `out` for reading: no writer replaces files meanwhile. A replacement a killed writer
    committed is finished first (with the writer's lock, briefly). A directory planner did not
    mark is read as it is, never touched."""
    out = Path(out)
    if not (out / MARKER).is_file():
        yield
        return
    if (out / COMMIT).exists() or any(out.glob(f"{STAGED_PREFIX}*")):
        with suppress(OSError), _dir_lock(out, shared=False):
            recover(out)  # (a read-only copy of a plan stays as it is)
    with _dir_lock(out, shared=True):
        yield


def recover(out: Path) -> None:
    """Finish a replacement a killed process committed, and remove staged folders it never did.

    Call it only holding the directory's exclusive lock (`replace_files` and `reading` do): a
    staged folder is a live writer's work until then. A commit record that names anything but
    a staged folder of this directory and plain files in it is ignored (and removed)."""
    commit = out / COMMIT
    if commit.is_file():
        try:
            record = json.loads(commit.read_text())
            staged, names, stale = record["staged"], list(record["files"]), list(record["remove"])
            valid = isinstance(staged, str) and _STAGED.fullmatch(staged) and all(map(safe_name, names + stale))
        except (OSError, ValueError, KeyError, TypeError):
            valid = False  # torn before its rename: never committed
        if valid:
            for name in names:
                with suppress(FileNotFoundError):
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(out / staged / name, out / name)
                    faults.point("write-renaming")
            for name in stale:
                (out / name).unlink(missing_ok=True)
        commit.unlink(missing_ok=True)
    for leftover in out.glob(f"{STAGED_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in out.glob(f"{COMMIT}.tmp-*"):
        leftover.unlink(missing_ok=True)


def replace_files(out: Path, fill: Callable[[Path], None], last: str | None = None, remove: tuple[str, ...] = ()) -> None:
    """Replace files of `out` with those `fill(staging_dir)` writes, atomically (module docstring).

    `last` is renamed after every other file (a plan's plan.json: its presence marks a plan);
    `remove` are old files the new contents no longer have. Files of `out` that `fill` does not
    write (the study database, the marker) are kept. When writing fails (out of disk, a
    read-only file system, ...) `out` is left as it was and the failure is one
    `OutputUnwritable` line."""
    with _dir_lock(out, shared=False):
        _replace_files(out, fill, last, tuple(r for r in remove if safe_name(r)))


def _replace_files(out: Path, fill: Callable[[Path], None], last: str | None, remove: tuple[str, ...]) -> None:
    recover(out)
    staged = None
    try:
        staged = Path(tempfile.mkdtemp(dir=out, prefix=STAGED_PREFIX))
        fill(staged)
        names = sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file())
        for name in names:
            with open(staged / name, "rb") as f:
                os.fsync(f.fileno())
        names = [n for n in names if n != last] + [n for n in names if n == last]
        _fsync_dir(staged)
        faults.point("write-staged")
        _write_atomically(
            out / COMMIT, json.dumps({"staged": staged.name, "files": names, "remove": [r for r in remove if r not in names]})
        )
        faults.point("write-committed")
    except OSError as exc:
        failed = _newest(staged) if staged is not None else None  # the file being written when it failed
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        where = f" ({failed})" if failed else ""
        raise OutputUnwritable(f"cannot write into {out}: {reason(exc)}{where}; nothing was written") from None
    recover(out)  # renames within one directory: they need no space
    _fsync_dir(out)


def _newest(staged: Path) -> str | None:
    files = [p for p in staged.rglob("*") if p.is_file()]
    return str(max(files, key=lambda p: p.stat().st_mtime_ns).relative_to(staged)) if files else None


# --- the plan directory: its files, written atomically, read back verified ---


def model_files(model: Model) -> dict[str, Path]:
    """The files of `model` as a plan directory holds them: model.onnx and, under the names the
    model gives them, its external data files. BadInput when one would overwrite a plan file."""
    clash = sorted(
        n for n in model.data_files if n in RESERVED_NAMES or n.startswith((MARKER, STAGED_PREFIX, f"{ARTIFACT_STEM}."))
    )
    if clash:
        raise BadInput(
            f"{model.path.name}: its external data file is named {clash[0]}, a name the plan directory uses; rename it (and re-save the model)"
        )
    return {MODEL_FILE: model.path, **model.data_paths}


def data_files(dataset: Dataset) -> dict[str, Path]:
    """The files the plan's data needs where the plan runs, as the plan directory holds them: text
    data's tokenizer, so new text becomes token ids as the measured text did."""
    return {TOKENIZER_FILE: dataset.tokenizer.path} if dataset.tokenizer is not None else {}


def plan_model(plan_dir: Path, plan: Plan) -> Model:
    """The plan's model as its step was built: its lengths bound as the plan measured them (a
    sequence length), trained for the plan's task, its inputs taken as the plan's step takes them. Call after `read_plan` verified the files."""
    model = load_model(plan_dir / MODEL_FILE).bind([i.static for i in plan.signature.inputs], "plan.json")
    codes = {i.name: i.encoding for i in plan.signature.inputs if i.encoding is not None}
    model = model.with_task(task_named(plan.dataset.task)).encoded(codes)
    int8 = plan.candidate.precision is Precision.INT8  # its scales, even none (no activation to quantize)
    return model.calibrated(plan.signature.activations) if int8 else model


def plan_tokenizer(plan_dir: Path, plan: Plan) -> Path | None:
    """The plan's own copy of its tokenizer (None: its data is not text). `read_plan` verified it
    against `files`; that sha256 must also be the one the dataset records, the tokenizer measured."""
    recorded = plan.dataset.tokenizer
    if recorded is None:
        return None
    if plan.files.get(TOKENIZER_FILE) != recorded.sha256:
        raise BadInput(
            f"{plan_dir / PLAN_FILE} records a tokenizer (sha256 {recorded.sha256[:12]}…) but not its copy "
            f"{TOKENIZER_FILE} with that sha256; re-create the plan"
        )
    return plan_dir / TOKENIZER_FILE


def write_plan_dir(out: Path, plan: Plan, files: dict[str, Path], weights: dict[str, np.ndarray], texts: dict[str, str]) -> Plan:
    """Write plan.json, copies of `files`, weights.npz and `texts` into `out`, atomically (see
    `outdir.replace_files`: the old plan stays whole, or the new one is complete, under kill -9 at
    any instant). plan.json, written last, records the sha256 of every file a run loads, and
    the plan with them is returned. Files already in `out` that are not part of a plan (the
    study database) are kept; an old plan's external data file the new model lacks is removed.
    """
    created = not Path(out).exists()
    out = prepare_out_dir(out)
    old_files = _plan_files(out)
    written = plan

    def fill(staged: Path) -> None:
        nonlocal written
        for name, source in files.items():
            (staged / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, staged / name)
        np.savez(staged / WEIGHTS_FILE, **weights)  # type: ignore[arg-type]  # numpy's stub: **weights might bind allow_pickle
        for name, text in texts.items():
            (staged / name).write_text(text)
        loaded = [*files, WEIGHTS_FILE]  # what `run` and `compile` load: verified before use
        hashed = plan.model_copy(update={"files": {name: file_sha256(staged / name) for name in loaded}, "sha256": None})
        raw = json.loads(json.dumps(hashed.model_dump()))  # as read back: JSON's types
        written = hashed.model_copy(update={"sha256": content_sha256(raw)})
        (staged / PLAN_FILE).write_text(json.dumps(written.model_dump(), indent=2) + "\n")

    try:
        with locked(out):
            replace_files(out, fill, last=PLAN_FILE, remove=tuple(sorted(set(old_files) - set(files) - {WEIGHTS_FILE})))
    except OutputUnwritable as exc:
        release_if_empty(out, created)  # nothing of a plan: no marker claiming one (nor a directory made for it)
        raise OutputUnwritable(str(exc).replace("cannot write into", "cannot write the plan into", 1)) from None
    return written


def _plan_files(out: Path) -> list[str]:
    """The files the plan now in `out` names (none when there is no readable plan)."""
    try:
        old = json.loads((out / PLAN_FILE).read_text())
        names = [*old.get("files", {}), *old.get("model", {}).get("data_files", [])]
    except (OSError, ValueError, AttributeError, TypeError):
        return []
    return [n for n in names if safe_name(n)]  # plan.json is read from disk: never `../x` or the study


def read_plan(plan_dir: Path, verify: bool = True) -> Plan:
    """The plan in `plan_dir`, validated; with `verify`, every file it names is checked against
    its recorded sha256 *before* anything is loaded — a truncated library would crash the loader,
    and a swapped one (another plan's, or code planted there) would run silently."""
    plan_dir = Path(plan_dir)
    if not plan_dir.is_dir():
        raise BadInput(f"{plan_dir} holds no plan (no {PLAN_FILE}); make one with `planner plan`")
    with reading(plan_dir):  # no writer replaces files while they are checked
        return _read_plan(plan_dir, verify)


def _read_plan(plan_dir: Path, verify: bool) -> Plan:
    path = plan_dir / PLAN_FILE
    if not path.is_file():
        raise BadInput(f"{plan_dir} holds no plan (no {PLAN_FILE}); make one with `planner plan`")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path} is not a valid plan: {exc}") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version not in READS:
        raise BadInput(
            f"{path} has schema version {version}; this planner reads {', '.join(map(str, READS))} "
            "(re-create the plan with `planner plan`)"
        )
    if version >= 7 and raw.get("sha256") != content_sha256(raw):
        raise BadInput(
            f"{path} was changed since it was written (its content no longer matches its sha256): a plan is "
            "what was measured, so edit the scheme and `planner measure` it instead — or restore the plan"
        )
    try:
        plan = Plan.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise BadInput(f"{path} is not a valid plan: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    if verify:
        for name, digest in plan.files.items():
            file = plan_dir / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise BadInput(f"{path} names a file outside its directory: {name}")
            if not file.is_file():
                raise BadInput(f"{file} is missing; the plan needs it (copy the whole plan directory)")
            if file_sha256(file) != digest:
                raise BadInput(
                    f"{file} is not the file this plan was written with (sha256 differs): it was changed, "
                    "truncated or swapped; nothing was loaded — re-create or re-copy the plan"
                )
        missing = {*plan.step.files, WEIGHTS_FILE, MODEL_FILE} - plan.files.keys()
        if missing:
            raise BadInput(f"{path} records no sha256 for {', '.join(sorted(missing))}; re-create the plan")
    return plan
