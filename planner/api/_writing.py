"""A plan directory written for a plan: its step's files, the model, the data's, the reports."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from planner.inputs.model import Model
from planner.plans.directory import REPORT_HTML, REPORT_MD, STUDY_FILE, TRIALS_FILE, model_files, write_plan_dir
from planner.plans.schema import Plan
from planner.reports import content as report_content
from planner.reports import html as report_html
from planner.reports import markdown
from planner.types import TrialRecord

if TYPE_CHECKING:
    from planner.backend import Artifact


def default_storage(out: str | Path) -> str:
    """The study storage the CLI keeps inside a plan directory: `sqlite:///OUT/study.db`."""
    return f"sqlite:///{(Path(out) / STUDY_FILE).resolve()}"


def write(out: Path, plan: Plan, compiled: Artifact, model: Model, trials: list[TrialRecord], data: dict[str, Path]) -> Plan:
    """The plan directory, with the files its data needs (`data`: `data_files`); returns the plan
    with its files' hashes."""
    content = report_content.from_plan(plan, model, trials)
    return write_plan_dir(
        out,
        plan,
        files={**{f.name: f for f in compiled.files}, **model_files(model), **data},
        weights=model.initializers,
        texts={
            REPORT_MD: markdown.render(content),
            REPORT_HTML: report_html.render(content),
            TRIALS_FILE: report_content.write_trials(trials),
        },
    )
