"""`planner measure`: one explicit scheme, measured like a trial, written as a runnable plan."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from planner import api
from planner.errors import BadInput, MeasureFailed, NoFeasiblePlan
from processes import planner

SCHEME = """
trainable:
  - layer: c2
    mode: full
  - layer: c1
    mode: ratio
    ratio: 0.5
  - params: [fc.b]
batch_size: 4
optimizer: {name: momentum, lr: 0.05}
precision: bf16
frozen_weights: int8
"""


def test_measure_writes_a_plan_that_runs(tiny_model, tiny_data, tmp_path):
    scheme = tmp_path / "paper.yaml"
    scheme.write_text(SCHEME)
    res = planner(
        "measure",
        tiny_model,
        "--scheme",
        scheme,
        "--data",
        tiny_data,
        "--out",
        tmp_path / "m",
        "--accuracy-steps",
        "20",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert [(t["layer"], t["mode"], t["params"]) for t in plan["choice"]["trainable"]] == [
        ("c1", "ratio:0.5", ["c1.w", "c1.b"]),
        ("c2", "full", ["c2.w", "c2.b"]),
        ("fc", "bias", ["fc.b"]),
    ]
    assert plan["step"]["signature"]["layouts"] == {"c1.w": ["ratio", 0, 2]}
    assert plan["choice"]["precision"] == "bf16" and plan["choice"]["frozen_weights"] == "int8"
    assert plan["step"]["signature"]["quantized"] == {"fc.w": 0}  # the one frozen Conv/Gemm weight
    assert plan["choice"]["optimizer"] == {"name": "momentum", "lr": 0.05} and plan["choice"]["batch_size"] == 4
    assert plan["selection"]["policy"] == "scheme" and plan["selection"]["feasible"] is True
    assert plan["metrics"]["step_latency_ms"]["repeats"] >= 5
    assert plan["step"]["requires"] == []  # bf16 convolutions are TVM's: the step needs no OpenBLAS
    run = api.run(tmp_path / "m", steps=10, out=tmp_path / "ft")
    assert run.steps == 10 and (tmp_path / "ft" / "model.onnx").is_file()


def test_an_over_budget_scheme_is_still_written_and_flagged(tiny_model, tiny_data, tmp_path):
    scheme = tmp_path / "s.yaml"
    scheme.write_text(SCHEME)
    target = tmp_path / "tiny.yaml"
    target.write_text("tvm_target: {kind: llvm}\nram_budget_bytes: 1KiB\nprecisions: [fp32, bf16]\n")
    result = api.measure(
        tiny_model, scheme=scheme, data=tiny_data, target=str(target), out=tmp_path / "m", accuracy_steps=5, latency_repeats=3
    )
    assert result.plan.selection.feasible is False and "ram_budget" in result.plan.selection.over_budget
    assert (tmp_path / "m" / "plan.json").is_file()


@pytest.mark.parametrize(
    "body, message",
    [
        ("trainable: [{params: [nope.w]}]\nbatch_size: 4\noptimizer: {lr: 0.1}\n", "no parameter 'nope.w'"),
        ("trainable: [{layer: c9}]\nbatch_size: 4\noptimizer: {lr: 0.1}\n", "no layer named 'c9'"),
        ("trainable: [{layer: c1, params: [c1.w]}]\nbatch_size: 4\noptimizer: {lr: 0.1}\n", "either a `layer` or `params`"),
        ("trainable: [{layer: c1}]\nbatch_size: 4\noptimizer: {lr: 0.1}\ngrad_accum: 0\n", "grad_accum"),
        ("trainable: [{layer: c1, mode: ratio}]\nbatch_size: 4\noptimizer: {lr: 0.1}\n", "goes with `ratio: R`"),
        (
            "trainable: [{layer: bn, mode: ratio, ratio: 0.5}]\nbatch_size: 4\noptimizer: {lr: 0.1}\n",
            "need a Conv, Gemm or MatMul",
        ),
        (
            "trainable: [{layer: c1}]\nbatch_size: 4\noptimizer: {lr: 0.1}\nprecision: fp16\n",
            "target host supports only fp32, bf16",
        ),
    ],
)
def test_bad_schemes_are_refused_before_any_compile(body, message, tiny_model, tiny_data, tmp_path):
    scheme = tmp_path / "bad.yaml"
    scheme.write_text(body)
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace("[", r"\[").replace("`", "`")):
        api.measure(tiny_model, scheme=scheme, data=tiny_data, out=tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_a_diverging_run_fails_clearly_and_writes_no_weights(tiny_model, tiny_data, tmp_path):
    """`planner run` on data that blows the loss up: it stops at the first non-finite loss with a
    clear error, and leaves no NaN weights behind."""
    scheme = tmp_path / "s.yaml"
    scheme.write_text(SCHEME)
    api.measure(tiny_model, scheme=scheme, data=tiny_data, out=tmp_path / "m", accuracy_steps=5, latency_repeats=3)
    with np.load(tiny_data) as d:
        arrays = {k: d[k] * 1e30 if k.startswith("x") else d[k] for k in d.files}
    np.savez(tmp_path / "huge.npz", **arrays)
    with pytest.raises(MeasureFailed, match="diverged at step"):
        api.run(tmp_path / "m", data=tmp_path / "huge.npz", steps=50, out=tmp_path / "ft")
    assert not (tmp_path / "ft" / "weights.npz").exists()


def test_a_diverging_fine_tune_is_a_measured_infeasible_result(tiny_model, tiny_data, tmp_path):
    """A candidate whose fine-tune blows up is measured (latency, memory, the accuracy it leaves)
    and marked infeasible, so the search learns to avoid it rather than ignoring a failed trial."""
    space = tmp_path / "hot.yaml"
    space.write_text(
        "strategy: all\nmodes: [full]\nbatch_size: [4]\noptimizer: [sgd]\nlr: {low: 1.0e+30, high: 1.0e+31, log: true}\n"
    )
    with pytest.raises(NoFeasiblePlan, match="2 of them diverged while fine-tuning"):
        api.plan(
            model=tiny_model,
            data=tiny_data,
            space=str(space),
            out=tmp_path / "p",
            storage=api.default_storage(tmp_path / "p"),
            trials=2,
            accuracy_steps=30,
            latency_repeats=3,
        )
    from planner.search.records import load_records

    records, _, _ = load_records(f"sqlite:///{tmp_path / 'p' / 'study.db'}", "planner")
    for rec in records:
        assert rec.state == "COMPLETE" and not rec.feasible and rec.over_budget == {"diverged": 1.0}
        assert 1 <= rec.accuracy.diverged_at <= 30 and rec.accuracy.loss_after is None
        assert rec.latency.median > 0 and rec.memory.total > 0


def test_measure_verbose_prints_where_the_step_time_goes(tiny_model, tiny_data, tmp_path):
    """`measure -v` ends with the step's kernel profile: the convolutions by name, with a rate
    computed from their work; the API returns the same profile, whose kernels account for the
    instrumented step's time and whose convolution work is the model's."""
    scheme = tmp_path / "all.yaml"
    scheme.write_text(
        "trainable:\n  - layer: c1\n  - layer: c2\n  - layer: fc\nbatch_size: 8\noptimizer: {name: sgd, lr: 0.01}\n"
    )
    args = ["--scheme", scheme, "--data", tiny_data, "--accuracy-steps", "5"]
    res = planner("measure", tiny_model, *args, "--out", tmp_path / "m", "-v")
    assert res.returncode == 0, res.stderr
    assert "kernel profile" in res.stdout and "conv2d_gemm" in res.stdout and "GFLOP/s" in res.stdout
    result = api.measure(tiny_model, scheme=scheme, data=tiny_data, out=tmp_path / "m2", accuracy_steps=5, profile=True)
    assert result.plan.step.requires == ["scipy-openblas32"]  # fp32 convolutions call OpenBLAS
    profile = result.profile
    assert profile is not None and profile.steps >= 1
    assert 0 < sum(k.seconds for k in profile.kernels) <= profile.step_seconds
    convs = [k for k in profile.kernels if k.name.startswith("conv2d_")]
    assert convs and all(k.flops > 0 and k.gflops for k in convs)
    forward = 0
    for layer in api.inspect(tiny_model).layers:
        if layer.op == "Conv":
            o, c, kh, kw = layer.param_shapes[layer.weight]
            forward += 2 * 8 * math.prod(int(d) for d in layer.output_shape[1:]) * c * kh * kw
    assert sum(k.flops for k in convs if "grad" not in k.name) == forward
    with pytest.raises(BadInput, match="`profile` times kernels on this machine"):
        api.measure(tiny_model, scheme=scheme, data=tiny_data, out=tmp_path / "m3", profile=True, tracker="127.0.0.1:9", key="k")
