"""Back ends and runners are seams: the pipeline reaches a step only through `Backend` and `Runner`.

A back end registered under a new name is what `measure`, the plan, `run` and `compile` use once a
target names it; a target pairing a back end with a runner that cannot execute its artifacts, or
naming one that does not exist, is one line before anything is built.
"""

from __future__ import annotations

import json

import pytest

from builders import write_plan_json
from planner import api
from planner.backend import BACKENDS
from planner.backend.vm import VmBackend
from planner.errors import BadInput
from planner.inputs.targets import load_target
from planner.measurement import RUNNERS, runner_for
from planner.measurement.local import LocalRunner

SCHEME = "trainable:\n  - layer: fc\n    mode: full\nbatch_size: 4\noptimizer: {name: sgd, lr: 0.05}\n"


class CountingBackend(VmBackend):
    """The VM back end under another name, counting its builds: what a second back end is to the pipeline."""

    name = "counting"
    builds: list[str] = []

    def build(self, model, candidate):
        CountingBackend.builds.append("target")
        return super().build(model, candidate)

    def host_build(self, model, candidate):
        CountingBackend.builds.append("host")
        return super().host_build(model, candidate)


class NothingRunner(LocalRunner):
    """A runner that executes no artifact kind this planner builds."""

    name = "nothing"
    kinds = frozenset()


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "counting", f"{__name__}:CountingBackend")
    monkeypatch.setitem(RUNNERS, "nothing", f"{__name__}:NothingRunner")
    monkeypatch.setattr(CountingBackend, "builds", [])


def _target(tmp_path, **fields) -> str:
    path = tmp_path / f"t-{len(list(tmp_path.glob('t-*.yaml')))}.yaml"
    path.write_text("tvm_target: {kind: llvm}\nram_budget_bytes: 64MiB\n" + "".join(f"{k}: {v}\n" for k, v in fields.items()))
    return str(path)


def test_a_registered_back_end_builds_every_step_of_measure_plan_and_run(registered, tiny_model, tiny_data, tmp_path):
    scheme = tmp_path / "s.yaml"
    scheme.write_text(SCHEME)
    target = _target(tmp_path, backend="counting")
    result = api.measure(tiny_model, scheme=scheme, data=tiny_data, out=tmp_path / "m", target=target, accuracy_steps=20)
    # the trial's build, measured here, also fine-tunes (the local runner runs it as is); then the plan's
    assert CountingBackend.builds == ["target", "target"]
    plan = json.loads((tmp_path / "m" / "plan.json").read_text())
    assert plan["target"]["backend"] == "counting" and plan["step"]["kind"] == "relax-vm"
    assert plan["measurement"]["latency"].startswith("TVM VM time_evaluator in-process")
    assert result.plan.step.files == ["train_step.so"]
    # run with the target it was built for: the plan's own step, nothing rebuilt
    ran = api.run(tmp_path / "m", data=tiny_data, steps=2, out=tmp_path / "r", target=target)
    assert ran.device == "local" and CountingBackend.builds == ["target", "target"]
    # compile for the VM back end's target: built by that back end, recorded as such
    retargeted = api.compile(tmp_path / "m", target="host", out=tmp_path / "c")
    assert retargeted.target.backend == "vm" and CountingBackend.builds == ["target", "target"]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"backend": "nope"}, "unknown back end 'nope' (known: "),
        ({"runner": "nope"}, "unknown runner 'nope' (known: "),
        ({"runner": "nothing"}, "the nothing runner cannot execute what the vm back end builds (relax-vm)"),
    ],
    ids=["unknown back end", "unknown runner", "runner that cannot run the artifact"],
)
def test_a_target_naming_a_back_end_and_runner_that_do_not_fit_is_refused_first(registered, tmp_path, fields, message):
    with pytest.raises(BadInput, match="^target t-0: .*" + message.replace("(", r"\(").replace(")", r"\)")):
        api.resolve_target(_target(tmp_path, **fields))


def test_a_target_s_back_end_checks_its_settings_where_the_target_is_resolved(tmp_path):
    """Reading a target loads no compiler (a study's report reads one); its back end checks the
    settings it builds from when a command resolves the target."""
    path = tmp_path / "bad.yaml"
    path.write_text("tvm_target: {kind: no-such-kind}\nram_budget_bytes: 64MiB\n")
    assert load_target(str(path)).tvm_target == {"kind": "no-such-kind"}
    with pytest.raises(BadInput, match="^target bad: tvm_target is not a valid TVM target: "):
        api.resolve_target(str(path))
    assert json.loads(api.check_target("host")["tvm"])["kind"] == "llvm"


def test_runner_for_a_target_behind_a_tracker_is_the_rpc_runner_and_names_its_boards(tmp_path):
    runner = runner_for(api.resolve_target("host", tracker="127.0.0.1:9190", key="pi"))
    assert (runner.name, runner.device, runner.runs_here) == ("rpc", "rpc:pi", False)
    assert runner_for(api.resolve_target("host")).device == "local"


def test_a_plan_whose_step_is_of_an_unknown_kind_is_refused_before_loading(tiny_model, tiny_data, tmp_path):
    scheme = tmp_path / "s.yaml"
    scheme.write_text(SCHEME)
    api.measure(tiny_model, scheme=scheme, data=tiny_data, out=tmp_path / "m", accuracy_steps=10)
    raw = json.loads((tmp_path / "m" / "plan.json").read_text())
    raw["step"]["kind"] = "c-sources"
    write_plan_json(tmp_path / "m", raw)
    with pytest.raises(BadInput, match="the plan's step is a 'c-sources', which this planner cannot run"):
        api.run(tmp_path / "m", data=tiny_data, steps=1, out=tmp_path / "r")
