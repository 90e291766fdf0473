"""Tasks: what a model's output means and how its training is judged, each task one module,
registered here.

`TASKS` maps a task's name to its `Task` (`_base.py`), in the order `--help` and errors list them
and inference tries them. A new task is a module beside these and one line below; the data, the
step's loss, the scoring, the search's direction, plans and reports take it from here.
"""

from __future__ import annotations

import numpy as np

from planner.errors import BadInput
from planner.tasks._base import IGNORE_INDEX, LossGraph, Score, Task
from planner.tasks.classification import Classification
from planner.tasks.loss import LossInModel
from planner.tasks.multilabel import Multilabel
from planner.tasks.regression import AnomalyDetection, Reconstruction, Regression, RegressionHuber, RegressionL1
from planner.tasks.tokens import CausalLM, TokenClassification
from planner.types import ModelInput

# in the order inference tries them: whole-number labels of one per sample are classes before
# they are numbers to regress, 0/1 matrices are labels before they are targets
TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Classification(),
        Multilabel(),
        TokenClassification(),
        CausalLM(),
        Regression(),
        RegressionL1(),
        RegressionHuber(),
        Reconstruction(),
        AnomalyDetection(),
        LossInModel(),
    )
}
CLASSIFICATION = TASKS["classification"]


def task_named(name: str) -> Task:
    """The task called `name`, or BadInput listing the tasks."""
    task = TASKS.get(str(name))
    if task is None:
        raise BadInput(f"no task {name!r}: planner trains {', '.join(TASKS)}")
    return task


def infer_task(
    where: str, y: np.ndarray | None, output: ModelInput, inputs: tuple[ModelInput, ...], named: str | None = None
) -> Task:
    """The task a model trains for on labels `y` (None: the data holds none): `named` if given
    (checked against the model), else the first of `TASKS` the model's output and the labels fit."""
    if named is not None:
        task = task_named(named)
        if (why := task.refuses(output, inputs)) is not None:
            raise BadInput(f"{where}: the model cannot be trained for {task.name}: {why}")
        if y is None and task.labelled:
            raise BadInput(f"{where}: {task.name} needs labels, and the data holds none")
        return task
    possible = [t for t in TASKS.values() if t.refuses(output, inputs) is None]
    for task in possible:
        if task.fits(y, output):
            return task
    if y is not None:  # what the first task the model could train for finds wrong with the labels
        for task in (t for t in possible if t.labelled):
            task.targets(f"{where}: train", y, output)
    shape = "[batch" + "".join(f", {d}" for d in output.shape) + "]"
    held = "no labels" if y is None else f"labels of shape {tuple(y.shape)} ({y.dtype})"
    raise BadInput(
        f"{where}: no task fits a model whose output is {shape} and data with {held}; name one with --task ({', '.join(TASKS)})"
    )


__all__ = ["CLASSIFICATION", "IGNORE_INDEX", "TASKS", "LossGraph", "Score", "Task", "infer_task", "task_named"]
