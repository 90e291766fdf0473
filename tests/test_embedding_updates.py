"""An embedding table's SGD step touches only the rows the batch looked up (`backend.sparse`).

Checked against PyTorch autograd in float64 on the same weights, from both exporters and both
update modes, at a learning rate a fine-tune uses: rows no token looked up stay bit for bit, and
each looked-up row is the float64 step rounded once — a row looked up dozens of times (padding,
a frequent word) has its rows summed before the subtraction, not subtracted one by one.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm

torch = pytest.importorskip("torch", reason="PyTorch is in the test extra: pip install -e '.[test]'")
import torch_families as tf  # noqa: E402
from planner import api  # noqa: E402
from planner.backend.lower.pipeline import BuildOptions  # noqa: E402
from planner.backend.vm.compile import compile_candidate  # noqa: E402
from planner.runtime.session import TrainingSession  # noqa: E402
from planner.types import Candidate  # noqa: E402

HOST = tvm.target.Target({"kind": "llvm"})
BATCH = 8
LR = 0.05


def _batch() -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
    """token_bag's batch with padding id 0 at every masked position, id 7 at a third of the
    others, and ids 40 to 63 never used."""
    (ids, mask), y = tf.sample_batch("token_bag", BATCH)
    ids = np.where(mask == 0, 0, ids % 40)
    ids[:, ::3] = 7
    return (ids, mask), y


@pytest.mark.parametrize("updates", ["in-place", "copy"])
@pytest.mark.parametrize("exporter", tf.EXPORTERS)
def test_sgd_updates_the_looked_up_rows_as_pytorch_does(exporter, updates):
    path = tf.export("token_bag", exporter)
    model = api.inspect(path)
    # the one (vocabulary, width) tensor: named embed.weight (dynamo) or onnx::Gather_… (legacy)
    table = next(p for layer in model.layers for p in layer.params_for("full") if model.initializers[p].shape == (64, 16))
    candidate = Candidate(tuple((layer.name, "full") for layer in model.layers), BATCH, "sgd", LR, updates=updates)
    step = compile_candidate(model, candidate, BuildOptions(HOST))
    assert any(k.name.startswith("embedding_sgd") for k in step.kernel_table), [k.name for k in step.kernel_table]
    x, y = _batch()
    before = {name: value.copy() for name, value in model.initializers.items()}
    session = TrainingSession(step.library, step.signature, before)
    session.step(x, y)
    after = session.weights()[table]
    expected = tf.reference_update("token_bag", path, x, y, LR, [table])[table]
    looked_up = np.isin(np.arange(after.shape[0]), x[0])
    assert np.array_equal(after[~looked_up], before[table][~looked_up])
    # the float64 step rounded once, give or take the float32 gradient's own error
    step64 = expected - before[table].astype(np.float64)
    slack = 2 * np.spacing(np.abs(expected).astype(np.float32)) + 1e-5 * np.abs(step64).max()
    off = np.abs(after[looked_up] - expected[looked_up])
    assert (off <= slack[looked_up]).all(), off.max()
    assert np.abs(step64[7]).max() > 0  # the row looked up most did move
