"""The Python API as a script uses it: `import planner`, keyword arguments, typed results, no CLI."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import planner
from planner.errors import BadInput
from planner.plans.schema import json_schema

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = ("plan", "work", "measure", "run", "compile", "report", "inspect")


def test_import_planner_and_every_export_load_no_compiler_and_no_optuna():
    """A report, a plan or a target read from a script must not pay for TVM (seconds) or Optuna."""
    code = (
        "import sys, planner\n"
        "bare = sorted(m for m in ('tvm', 'optuna') if m in sys.modules)\n"
        "for name in planner.__all__: getattr(planner, name)\n"
        "print(bare, sorted(m for m in ('tvm', 'optuna') if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[] []"


def test_the_board_side_needs_no_onnx_yaml_pydantic_or_optuna():
    """`planner board serve` runs on a board with TVM's runtime, typer and rich beside planner."""
    code = (
        "import sys\n"
        "sys.modules.update(dict.fromkeys(['onnx', 'yaml', 'pydantic', 'optuna'], None))\n"
        "import planner.cli, planner.measurement.board\n"
        "from planner.inputs.addresses import parse_host_port\n"
        "print(parse_host_port('127.0.0.1:9190'))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip() == "('127.0.0.1', 9190)", res.stderr


def test_the_pipeline_is_keyword_only_and_documented_with_an_example():
    for name in PIPELINE:
        fn = getattr(planner, name)
        params = list(inspect.signature(fn).parameters.values())
        positional = [p.name for p in params if p.kind not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)]
        assert len(positional) <= 1, f"planner.{name} takes {positional} positionally: only its subject may be"
        assert f"planner.{name}(" in (fn.__doc__ or ""), f"planner.{name}'s docstring shows no example call"
    assert set(planner.__all__) == set(planner._EXPORTS)
    assert {*PIPELINE, "Plan", "PlanResult", "RunResult", "Mode", "TrialState", "load_target", "load_space"} <= set(
        planner.__all__
    )


def test_library_errors_name_parameters_and_the_cli_names_flags(tiny_model, tiny_data, tmp_path):
    with pytest.raises(BadInput) as err:
        planner.plan(model=tiny_model, data=tiny_data, out=tmp_path / "p", trials=0)
    assert "`trials` must be at least 1" in str(err.value) and "--" not in str(err.value)
    res = subprocess.run(
        [sys.executable, "-m", "planner", "plan", "--trials", "0", "--out", str(tmp_path / "p")], capture_output=True, text=True
    )
    assert res.returncode == 2 and res.stderr.strip() == "error: --trials must be at least 1"


def test_without_storage_the_study_lives_in_memory_and_a_stop_is_a_field_of_the_result(tiny_model, tiny_data, tmp_path):
    stop = threading.Event()
    seen = []

    def on_trial(record, finished, total):
        seen.append(record)
        stop.set()  # after the first trial: finish what runs, start nothing new

    result = planner.plan(
        model=tiny_model,
        data=tiny_data,
        out=tmp_path / "p",
        trials=4,
        accuracy_steps=10,
        latency_repeats=2,
        on_trial=on_trial,
        stop=stop,
    )
    # a trial in flight at the stop may end cut short (PRUNED): reported, not counted as finished
    assert result.interrupted and result.finished == sum(r.state.finished for r in seen) < 4
    assert not (tmp_path / "p" / "study.db").exists(), "no storage given: nothing but the plan is written"
    if result.plan is not None:  # the first trial was feasible: the plan comes from it
        assert result.plan.study.storage is None
        assert isinstance(result.plan.choice.trainable[0].update_mode, planner.Mode)
        assert planner.read_plan(result.out).choice == result.plan.choice


def test_the_committed_json_schema_is_the_plan_models():
    """docs/plan.schema.json is what `python -m planner.plans.schema` writes today."""
    assert (ROOT / "docs" / "plan.schema.json").read_text() == json_schema()
    schema = json.loads(json_schema())
    assert {"choice", "metrics", "measurement", "files"} <= set(schema["properties"])


def test_modes_and_states_are_types_that_read_and_write_the_plan_strings():
    mode = planner.Mode.parse("ratio:0.25")
    assert (mode.kind, mode.value, str(mode)) == ("ratio", 0.25, "ratio:0.25") and mode == "ratio:0.25"
    assert planner.Mode.parse("lora:4").value == 4 and isinstance(planner.Mode.parse("lora:4").value, int)
    with pytest.raises(ValueError):
        planner.Mode("full", 0.5)  # a number only with a mode that carries one
    for bad in ("ratio", "ratio:0", "ratio:1.5", "lora:2.5", "lora:0", "sideways"):
        with pytest.raises(ValueError):
            planner.Mode.parse(bad)
    cand = planner.Candidate(trainable=(("fc", "full"), ("c2", "ratio:0.5")), batch_size=4, optimizer="adam", lr=0.01)
    assert cand.optimizer is planner.Optimizer.ADAM and cand.trainable[1][1].value == 0.5
    assert planner.Candidate.from_json(json.loads(json.dumps(cand.to_json()))) == cand
    assert planner.TrialState("FAIL").finished and not planner.TrialState.PRUNED.finished
