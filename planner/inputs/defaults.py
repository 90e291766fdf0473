"""Defaults shared by the API and the CLI (kept free of heavy imports so `--help` stays fast)."""

from planner.inputs.resources import shipped

EXAMPLE_DIR = shipped("examples/digits")
DEFAULT_MODEL = EXAMPLE_DIR / "model.onnx"
DEFAULT_DATA = EXAMPLE_DIR / "digits.npz"
DEFAULT_TARGET = "host"
DEFAULT_TRIALS = 20
DEFAULT_ACCURACY_STEPS = 200
DEFAULT_RUN_STEPS = 100
