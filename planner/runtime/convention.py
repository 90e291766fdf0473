"""A step's calling convention, which the back ends build to and the runners call: its two
functions (`planner.backend.graph.training` says what each takes and returns) and its targets are the task's (`planner.tasks`)
convention. Apart from `session`, so that what builds a step need not import what runs one.
"""

STEP_FUNC = "train_step"
PREDICT_FUNC = "backbone"
