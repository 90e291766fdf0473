"""The operator table (`planner.inputs.operators`) holds: every form of every operator that trains
passes a float64 finite-difference check against ONNX's reference runtime through planner's own
import and gradients, every form that runs compiles and runs in planner's pipeline (a frozen-only
one in the frozen part, stopping the gradient of what is before it), and docs/operators.md is the
table as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
from operator_cases import differentiated, form_support, gradient_check, pipeline_check
from operator_forms import CASES

from planner.inputs.operators import OPERATORS, Support, markdown

DOCS = Path(__file__).resolve().parent.parent / "docs" / "operators.md"
TRAINS = [pytest.param(c, id=c.id) for c in CASES if form_support(c) == "trains" and differentiated(c)]
RUNS = [pytest.param(c, id=c.id) for c in CASES if form_support(c) != "refused" and not c.scalar]
# one form of each operator that trains, in the frozen part: a frozen op needs no gradient, and must compile
FROZEN = [pytest.param(c, id=c.id) for c in {c.op: c for c in reversed(CASES) if form_support(c) == "trains"}.values()]


def test_docs_hold_the_table_as_it_is():
    """docs/operators.md is `planner operators --markdown`: regenerate it when the table changes."""
    assert DOCS.read_text() == markdown(), "run: planner operators --markdown > docs/operators.md"


def test_every_row_that_runs_is_proven_in_several_forms():
    """A row the table says trains has at least two forms proven here (one shape of Relu is not
    enough of a claim), and one that runs frozen at least one form; each case's form is one the
    table lists (a form is not silently refused)."""
    forms: dict[str, int] = {}
    trained: dict[str, int] = {}
    for case in CASES:
        assert case.op in OPERATORS, f"{case.id}: not in the table"
        level = form_support(case)
        assert level != "refused", f"{case.id}: the table refuses this form; a case for it proves nothing"
        forms[case.op] = forms.get(case.op, 0) + 1
        trained[case.op] = trained.get(case.op, 0) + (level == "trains" and bool(differentiated(case)))
    # a straight-through row's gradient is by design not its derivative: tests/test_qdq.py proves it against PyTorch's
    by_derivative = [op for op in OPERATORS.values() if not op.straight_through]
    unproven = [op.name for op in by_derivative if op.support is Support.TRAINS and trained.get(op.name, 0) < 2]
    assert not unproven, f"rows that claim to train with no form proven: {unproven}"
    untested = [op.name for op in by_derivative if op.support is not Support.REFUSED and not op.folded and not forms.get(op.name)]
    assert not untested, f"rows that claim to run with no form tested: {untested}"


@pytest.mark.parametrize("case", TRAINS)
def test_gradient_matches_finite_differences_in_float64(case):
    errors = gradient_check(case)
    assert errors and all(e < case.allowed for e in errors.values()), errors


@pytest.mark.parametrize("case", RUNS)
def test_runs_in_planners_pipeline(case, tmp_path):
    """Trained through (a form that trains) or in the frozen part (a frozen-only one)."""
    errors = pipeline_check(case, tmp_path)
    assert errors["logits"] < 1e-4 and errors["loss"] < 1e-4, errors
    assert all(e < 2e-3 for e in errors.values()), errors


@pytest.mark.parametrize("case", FROZEN)
def test_an_operator_that_trains_also_compiles_frozen(case, tmp_path):
    """Only the head trained: the operator runs in the frozen part, before the differentiated one."""
    errors = pipeline_check(case, tmp_path, frozen=True)
    assert errors["logits"] < 1e-4 and errors["loss"] < 1e-4, errors
