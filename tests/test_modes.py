"""Update modes are a seam: a mode registered in `planner.modes.MODES` is what schemes, search
spaces, the step's stored weights, plan.json, `run` and the reports use — nothing else changes.

The mode here, `last:S`, trains the last S·C output channels of a weight (where `ratio` trains the
first): it stores the weight as two parts of its own and rebuilds it in the step, so it goes
through every hook a mode has.
"""

from __future__ import annotations

import json

import numpy as np
import optuna
import pytest
import yaml

from planner import api
from planner.errors import BadInput
from planner.inputs.model import load_model
from planner.inputs.schemes import load_scheme
from planner.inputs.spaces import SearchSpace
from planner.modes import MODES, Argument, Layout, Part
from planner.modes.ratio import Ratio
from planner.types import Mode


class Last(Ratio):
    """`last:S`: the last S·C output channels of a weight train, and the bias; the first stay frozen."""

    name = "last"
    description = "the last output channels of the weight, and the bias"
    color = "#756bb1"
    argument = Argument("share", "shares", float, (0.5,), "in (0, 1]", lambda s: 0 < s <= 1)
    suffixes = ("first", "last")

    def parts(self, layout: Layout, weight: str, shape) -> list[Part]:
        first, last = list(shape), list(shape)
        first[layout.axis], last[layout.axis] = shape[layout.axis] - layout.size, layout.size
        return [Part(f"{weight}@last", tuple(last), True), Part(f"{weight}@first", tuple(first), False)]

    def to_step(self, layout, weight, weights):
        w = weights[weight]
        first, last = np.split(w, [w.shape[layout.axis] - layout.size], axis=layout.axis)
        return {f"{weight}@first": first, f"{weight}@last": last}

    def from_step(self, layout, weight, parts):
        return np.concatenate([parts[f"{weight}@first"], parts[f"{weight}@last"]], axis=layout.axis)

    def rebuild(self, layout, op, weight, parts, shape):
        return op.concat([parts["first"], parts["last"]], axis=layout.axis)


@pytest.fixture
def last_mode(monkeypatch):
    monkeypatch.setitem(MODES, "last", Last())


def test_a_registered_mode_is_measured_planned_run_and_reported(last_mode, tiny_model, tiny_data, tmp_path):
    scheme = tmp_path / "last.yaml"
    scheme.write_text(
        yaml.safe_dump(
            {
                "name": "last",
                "trainable": [{"layer": "c2", "mode": "last", "share": 0.5}, {"layer": "fc"}],
                "batch_size": 4,
                "optimizer": {"name": "momentum", "lr": 0.1},
            }
        )
    )
    api.measure(tiny_model, scheme=scheme, data=tiny_data, out=tmp_path / "m", accuracy_steps=20)
    plan = json.loads((tmp_path / "m" / "plan.json").read_text())
    assert [(t["layer"], t["mode"]) for t in plan["choice"]["trainable"]] == [("c2", "last:0.5"), ("fc", "full")]
    assert plan["step"]["signature"]["layouts"] == {"c2.w": ["last", 0, 3]}
    assert "c2.w@last" in plan["step"]["signature"]["trainable"] and "c2.w@first" in plan["step"]["signature"]["frozen"]
    # momentum keeps a velocity for the trained part only: 3 of c2's 6 output channels
    assert [3, 4, 3, 3] in [s["shape"] for s in plan["step"]["signature"]["optim_states"]]
    assert [6, 4, 3, 3] not in [s["shape"] for s in plan["step"]["signature"]["optim_states"]]

    api.run(tmp_path / "m", data=tiny_data, steps=20, out=tmp_path / "r")
    before = load_model(tiny_model).initializers["c2.w"]
    after = np.load(tmp_path / "r" / "weights.npz")["c2.w"]
    moved = np.abs(after - before).reshape(6, -1).max(axis=1)
    assert (moved[:3] == 0).all() and (moved[3:] > 0).all(), moved  # the weight whole again, its first channels as they were
    assert "c2 | Conv | last 0.5 |" in api.report(tmp_path / "m", fmt="md")


def test_a_registered_mode_is_drawn_by_a_space_with_its_own_list(last_mode, tiny_model):
    model = load_model(tiny_model)
    space = SearchSpace.model_validate({"name": "s", "modes": ["frozen", "last"], "shares": [0.25, 0.5]})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    drawn = {str(mode) for _ in range(30) for _, mode in space.sample(study.ask(), model).trainable}
    assert drawn == {"last:0.25", "last:0.5"}  # never on fc's Gemm bias alone: a share needs output channels, and fc has them
    assert all(
        p.startswith(
            (
                "mode:",
                "share:",
                "batch_size",
                "optimizer",
                "lr",
                "precision",
                "grad_accum",
                "frozen_weights",
                "updates",
                "recompute",
            )
        )
        for p in study.trials[0].params
    )


def test_a_mode_s_number_is_checked_where_it_is_read(last_mode, tmp_path):
    with pytest.raises(ValueError, match=r"share must be in \(0, 1\]"):
        Mode.parse("last:1.5")
    with pytest.raises(ValueError, match="shares must list at least one share"):
        SearchSpace.model_validate({"name": "s", "modes": ["last"], "shares": []})
    scheme = tmp_path / "bad.yaml"
    scheme.write_text(
        yaml.safe_dump({"name": "b", "trainable": [{"layer": "c2", "mode": "last"}], "batch_size": 4, "optimizer": {"lr": 0.1}})
    )
    with pytest.raises(BadInput, match="`mode: last` goes with `share: R`"):
        load_scheme(str(scheme))
