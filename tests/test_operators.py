"""The operator table (`planner.inputs.operators`) holds: every form of every operator that trains
passes a float64 finite-difference check against ONNX's reference runtime, every form that runs
compiles and runs in planner's pipeline, and docs/operators.md is the table as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
from operator_cases import CASES, form_support, gradient_check, pipeline_check

from planner.inputs.operators import markdown

DOCS = Path(__file__).resolve().parent.parent / "docs" / "operators.md"
TRAINS = [pytest.param(c, id=c.id) for c in CASES if form_support(c) == "trains"]
RUNS = [pytest.param(c, id=c.id) for c in CASES if form_support(c) != "refused"]


def test_docs_hold_the_table_as_it_is():
    """docs/operators.md is `planner operators --markdown`: regenerate it when the table changes."""
    assert DOCS.read_text() == markdown(), "run: planner operators --markdown > docs/operators.md"


@pytest.mark.parametrize("case", TRAINS)
def test_gradient_matches_finite_differences_in_float64(case):
    errors = gradient_check(case)
    assert errors and all(e < case.tolerance for e in errors.values()), errors


@pytest.mark.parametrize("case", RUNS)
def test_runs_in_planners_pipeline(case, tmp_path):
    errors = pipeline_check(case, tmp_path)
    assert errors["logits"] < 1e-4 and errors["loss"] < 1e-4, errors
    assert all(e < 2e-3 for e in errors.values()), errors
