"""Bad input: one clear line on stderr, exit code 2 (1 when no plan fits), nothing half-written."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from builders import blobs, tiny_cnn


def planner(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def _cases(tmp, tiny_model, tiny_data):
    corrupt = tmp / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07this is not a protobuf" * 10)
    blocked = tiny_cnn(tmp / "blocked.onnx", extra_op="Floor")
    wrong_shape = blobs(tmp / "wrong_shape.npz", shape=(1, 8, 8))
    bad_labels = blobs(tmp / "bad_labels.npz", y=np.full(240, 7, dtype=np.int64))
    bad_target = tmp / "bad-target.yaml"
    bad_target.write_text("tvm_target: {kind: llvm}\nram_budget_bytes: lots\n")
    bad_space = tmp / "bad-space.yaml"
    bad_space.write_text("batch_size: [8]\nlayerz: [c1]\n")
    fp16_space = tmp / "fp16-space.yaml"
    fp16_space.write_text("precision: [fp16]\n")
    truncated = tmp / "truncated.onnx"
    truncated.write_bytes(tiny_model.read_bytes()[: tiny_model.stat().st_size // 2])
    dynamic = tmp / "dynamic.onnx"
    proto = onnx.load(tiny_model)
    proto.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "height"
    onnx.save(proto, dynamic)
    with np.load(tiny_data) as npz:
        arrays = dict(npz)
    x_key, y_keys = ("x_train" if "x_train" in arrays else "x"), [k for k in arrays if k.startswith("y")]
    nan_data = tmp / "nan.npz"
    np.savez(nan_data, **{**arrays, x_key: np.where(np.arange(arrays[x_key].size).reshape(arrays[x_key].shape) == 5, np.nan, arrays[x_key])})
    one_class = tmp / "one-class.npz"
    np.savez(one_class, **{**arrays, **{k: np.zeros_like(arrays[k]) for k in y_keys}})
    return {
        "missing model": (["--model", str(tmp / "nope.onnx"), "--data", str(tiny_data)], "model file not found"),
        "corrupt model": (["--model", str(corrupt), "--data", str(tiny_data)], "not a valid ONNX model"),
        "op without gradient": (["--model", str(blocked), "--data", str(tiny_data)], "node 'blocker' (Floor)"),
        "data shape": (["--model", str(tiny_model), "--data", str(wrong_shape)], "needs (1, 6, 6)"),
        "labels out of range": (["--model", str(tiny_model), "--data", str(bad_labels)], "labels must lie in [0, 2]"),
        "unknown target": (["--model", str(tiny_model), "--data", str(tiny_data), "--target", "toaster"], "unknown target 'toaster'"),
        "target with a bad size": (["--model", str(tiny_model), "--data", str(tiny_data), "--target", str(bad_target)], "ram_budget_bytes"),
        "space with an unknown key": (["--model", str(tiny_model), "--data", str(tiny_data), "--space", str(bad_space)], "layerz: Extra inputs are not permitted"),
        "precision the target lacks": (["--model", str(tiny_model), "--data", str(tiny_data), "--space", str(fp16_space)], "proposes precision fp16; the target supports only"),
        "truncated model": (["--model", str(truncated), "--data", str(tiny_data)], "not a valid ONNX model"),
        "non-batch dynamic dims": (["--model", str(dynamic), "--data", str(tiny_data)], "dynamic non-batch dimensions"),
        "NaN in data": (["--model", str(tiny_model), "--data", str(nan_data)], "contain NaN or Inf"),
        "a single class": (["--model", str(tiny_model), "--data", str(one_class)], "with a single class"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing model", "corrupt model", "op without gradient", "data shape", "labels out of range",
        "unknown target", "target with a bad size", "space with an unknown key", "precision the target lacks",
        "truncated model", "non-batch dynamic dims", "NaN in data", "a single class",
    ],
)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, tiny_model, tiny_data):
    args, expected = _cases(tmp_path, tiny_model, tiny_data)[case]
    out = tmp_path / "plan-out"
    res = planner("plan", *args, "--out", str(out))
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists(), "a failed plan must not leave an output directory"


def test_inspect_names_the_blocking_node(tmp_path):
    blocked = tiny_cnn(tmp_path / "blocked.onnx", extra_op="Floor")
    res = planner("inspect", str(blocked), "--json")
    assert res.returncode == 0, res.stderr
    import json

    layers = {row["layer"]: row for row in json.loads(res.stdout)["layers"]}
    assert not layers["c1"]["trainable"] and "blocker" in layers["c1"]["reason"]
    assert layers["fc"]["trainable"]  # downstream of the blocker: still trainable
    assert layers["c1"]["params"] == {"c1.w": [4, 1, 3, 3], "c1.b": [4]}
    assert layers["c1"]["param_bytes"] == (36 + 4) * 4
    assert layers["c1"]["output_shape"] == ["N", 4, 6, 6]


def test_no_feasible_plan_exits_1(tmp_path, tiny_model, tiny_data):
    target = tmp_path / "tiny-ram.yaml"
    target.write_text("tvm_target: {kind: llvm}\nram_budget_bytes: 1KiB\n")
    res = planner("plan", "--model", str(tiny_model), "--data", str(tiny_data), "--target", str(target),
                  "--out", str(tmp_path / "p"), "--trials", "2", "--accuracy-steps", "5")
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: no feasible plan")
    assert not (tmp_path / "p" / "plan.json").exists()


def test_run_without_a_plan_is_bad_input(tmp_path):
    res = planner("run", str(tmp_path))
    assert res.returncode == 2 and "holds no plan" in res.stderr
