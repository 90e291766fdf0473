"""Execute a plan: fine-tune with the plan's compiled step and export the result.

A plan directory is self-contained — plan.json, the compiled step, the starting weights and the
model graph — so it runs where it was compiled for: in this process (on the board itself, or on
the planning host for a host plan), or with `--target` where that target's runner runs steps (on a
board over TVM RPC, say: the weights go up, every step runs there, the trained weights come back).
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import numpy as np

from planner.backend import Artifact, ArtifactKind, backend_class, backend_for
from planner.cachefile import default_cache_dir
from planner.errors import BadInput, MeasureFailed, OutputUnwritable, StepNotLoadable
from planner.inputs.data import Dataset, Tokenization, data_format, format_named, load_dataset
from planner.inputs.defaults import DEFAULT_RUN_STEPS
from planner.inputs.model import save_onnx
from planner.inputs.preprocess import Preprocess
from planner.inputs.targets import HardwareTarget, load_target
from planner.measurement import Session, runner_for, selfcheck
from planner.measurement.accuracy import evaluate, finetune
from planner.measurement.local import LocalRunner
from planner.plans.directory import (
    MODEL_FILE,
    WEIGHTS_FILE,
    locked,
    plan_model,
    plan_tokenizer,
    prepare_out_dir,
    read_plan,
    reading,
    release_if_empty,
    replace_files,
)
from planner.plans.schema import Plan
from planner.types import RunCheck, RunResult


def _train(session: Session, data: Dataset, steps: int, seed: int | None, augment_seed: int):
    """Val loss and the task's metric (by its name) before and after `steps` steps, and the weights."""
    metric = data.task.metric.name
    loss0, score0 = evaluate(session, data.val)
    losses = finetune(session, data, steps, seed, augment_seed)
    if not np.isfinite(losses[-1]):
        raise MeasureFailed(f"training diverged at step {len(losses)} (loss {losses[-1]}); no weights written")
    loss1, score1 = evaluate(session, data.val)
    return {"loss": loss0, metric: score0}, {"loss": loss1, metric: score1}, session.weights()


def _check(usage: selfcheck.Usage, plan: Plan, device: str) -> RunCheck:
    m = plan.metrics
    return selfcheck.check(
        step_seconds=usage.step_seconds,
        heap_gained=usage.heap_gained,
        resident_bytes=usage.resident_bytes,
        planned_step_ms=m.step_latency_ms.median,
        planned_memory_bytes=m.peak_memory_bytes.total,
        device=device,
    )


def run_plan(
    plan_dir: Path,
    data: Path | None = None,
    steps: int = DEFAULT_RUN_STEPS,
    out: Path | None = None,
    shuffle: bool = True,
    seed: int = 0,
    target: HardwareTarget | None = None,
) -> RunResult:
    """Train `steps` steps from the plan's weights; write weights.npz and model.onnx to `out`.

    Without `target`, runs the plan's library in this process. With an RPC target, runs on one of
    its boards (the plan is recompiled for the target if it was built for another).
    """
    plan_dir = Path(plan_dir)
    if steps < 1:
        raise BadInput("`steps` must be at least 1")
    with reading(plan_dir):  # no `plan --out` replaces the files between their check and their use
        plan = read_plan(plan_dir)  # every file checked against plan.json's sha256 before anything loads
        # the lengths the plan was measured at (a sequence length): its step takes no other
        model = plan_model(plan_dir, plan)
        dataset = _dataset(plan_dir, plan, Path(data or plan.dataset.source), model.exported)
        dataset.check_batch(plan.signature.batch_size, "the plan")
        weights = _weights(plan_dir / WEIGHTS_FILE, model)
        out = _out_dir(plan_dir, Path(out) if out else plan_dir / "finetuned", model)
        order_seed = seed if shuffle else None

        artifact = _artifact(plan_dir, plan)
        if target is None and artifact.kind not in LocalRunner.kinds:
            target = _own_target(plan)
        if target is not None and not _built_for(plan, target):
            artifact = backend_for(target, cache_dir=default_cache_dir()).build(model, plan.candidate)
        # no target: the plan's step runs here, as on the machine that planned it
        runner = runner_for(target if target is not None else load_target("host"))
        device = runner.device

        def work(session: Session) -> tuple[dict, dict, dict]:
            return _train(session, dataset, steps, order_seed, seed)

        try:  # as many threads as the plan's step was timed on, where it runs in this process
            trained, usage = runner.train(
                artifact, weights, selfcheck.checked(work, weights), threads=plan.metrics.step_latency_ms.threads
            )
        except StepNotLoadable as exc:
            raise StepNotLoadable(
                f"{exc}: it is built for {plan.target.name} ({plan.target.tvm_target.get('mtriple', 'llvm')}); "
                "run it on the board, or give a `target`"
            ) from None
        before, after, final = trained
        check = _check(usage, plan, device) if usage is not None else None

    def fill(staged: Path) -> None:
        np.savez(staged / WEIGHTS_FILE, **final)
        save_onnx(model, final, staged / MODEL_FILE)

    created = not out.exists()
    out = prepare_out_dir(out, kind="run")
    try:
        with locked(out):
            replace_files(out, fill)  # the previous run's files stay whole until the new ones are complete
    except OutputUnwritable as exc:
        release_if_empty(out, created)
        raise OutputUnwritable(f"{exc}; the training is lost, rerun with an `out` that has room") from None
    return RunResult(before, after, steps, out, device, check, dataset.task.metric.name)


def _dataset(plan_dir: Path, plan: Plan, path: Path, model) -> Dataset:
    """The data, made into model inputs as the plan's were: images by the plan's preprocessing,
    text by the plan's own copy of its tokenizer, as recorded; class names mapped to the plan's
    indices. Arrays are the model's input as they are."""
    kind = data_format(path)
    measured = format_named(plan.dataset.format).description
    preprocess, tokenizer = None, None
    if kind.tokenized:
        copy = plan_tokenizer(plan_dir, plan)
        if plan.dataset.tokenizer is None or copy is None:
            raise BadInput(f"{path} holds text, but the plan was made with {measured} and has no tokenizer; plan with the text")
        tokenizer = Tokenization.from_json(plan.dataset.tokenizer.model_dump(), copy)
    elif kind.preprocessed:
        recorded = plan.dataset.preprocess
        if recorded is None:
            raise BadInput(
                f"{path} holds images, but the plan was made with {measured} and records no preprocessing; "
                "give data like it, or plan with the images"
            )
        preprocess = Preprocess.from_json(recorded, "plan.json's dataset.preprocess")
    return load_dataset(
        path,
        model,
        preprocess=preprocess,
        tokenizer=tokenizer,
        classes=plan.dataset.classes,
        cache_dir=default_cache_dir(),
        task=plan.dataset.task,
    )


def _weights(path: Path, model) -> dict[str, np.ndarray]:
    """weights.npz, checked against the model's initializers (names, shapes, dtypes): a file
    that does not fit is one line naming what differs, not a crash inside the step."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            weights = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise BadInput(f"{path} is not a readable weights file: {exc}") from None
    expected = model.initializers
    missing, extra = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    if missing or extra:
        what = f"lacks {', '.join(missing[:3])}" if missing else f"has weights the model lacks: {', '.join(extra[:3])}"
        raise BadInput(f"{path} does not fit {MODEL_FILE}: it {what}")
    for name, ref in expected.items():
        got = weights[name]
        if got.shape != ref.shape or got.dtype != ref.dtype:
            raise BadInput(f"{path}: weight {name} is {got.dtype}{list(got.shape)}, the model needs {ref.dtype}{list(ref.shape)}")
    return weights


def _out_dir(plan_dir: Path, out: Path, model) -> Path:
    """`--out`, checked before any training: not the plan itself (its weights and model are
    what the plan's hashes vouch for), not a directory of someone else's files, writable, with
    room for the weights and the model."""
    if out.resolve() == plan_dir.resolve():
        raise BadInput(f"`out` {out} is the plan directory; the plan's own weights must stay — give another directory")
    prepare_out_dir(out, create=False, kind="run")
    probe = next(p for p in (out, *out.absolute().parents) if p.exists())
    need = 2 * sum(w.nbytes for w in model.initializers.values()) + model.path.stat().st_size
    free = shutil.disk_usage(probe).free
    if free < need:
        raise OutputUnwritable(f"cannot write the fine-tuned model into {out}: {free:,} bytes free, it needs about {need:,}")
    return out


def _artifact(plan_dir: Path, plan: Plan) -> Artifact:
    """The plan's step, as plan.json records it (its files verified by `read_plan`)."""
    if plan.step.kind != backend_class(plan.target.backend).kind:
        raise BadInput(f"the plan's step is a {plan.step.kind!r}, which this planner cannot run")
    return Artifact(
        kind=ArtifactKind(plan.step.kind),
        files=tuple(plan_dir / f for f in plan.step.files),
        signature=plan.signature,
        requires=tuple(plan.step.requires),
    )


def _own_target(plan: Plan) -> HardwareTarget:
    """The shipped target a plan was made for, when its step runs only there (firmware for an
    emulated board): `planner run PLAN` then runs it where it was measured."""
    where = f"the plan's step is a {plan.step.kind}, which runs on {plan.target.device}"
    try:
        target = load_target(plan.target.name)
    except BadInput:
        raise BadInput(f"{where}: give the target it was made for (`target`, --target)") from None
    if not _built_for(plan, target):
        raise BadInput(f"{where}: the target {plan.target.name} here is not the one it was made for; give that target")
    return target


def _built_for(plan: Plan, target: HardwareTarget) -> bool:
    t = plan.target
    return (t.tvm_target, t.toolchain, t.backend) == (target.tvm_target, target.toolchain, target.backend)
