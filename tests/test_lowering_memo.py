"""A study lowers the same ops for candidate after candidate, so `legalize` remembers each op's
lowering (`planner.backend.lower.kernels._Remembered`). A remembered lowering must be exactly the one a
fresh lowering would give — the same kernels, called on the same operands — whatever came before
it in the process: other batch sizes, other trainable sets, other kernel libraries, other tiles."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax

import zoo
from planner.backend.graph.training import build_training_module
from planner.backend.lower import kernels
from planner.backend.lower.kernels import legalize
from planner.backend.sgemm import gemm_kernels
from planner.inputs.model import load_model
from planner.types import Candidate, Kernels

TARGET = tvm.target.Target({"kind": "llvm"})


@pytest.fixture
def fresh(monkeypatch):
    """Empties the memo now and returns a switch that lowers every op afresh from then on."""
    monkeypatch.setattr(kernels._Remembered, "memo", type(kernels._Remembered.memo)())

    def forget() -> None:
        monkeypatch.setattr(kernels._Remembered, "__call__", lambda self, bb, call: self.lower(bb, call))

    return forget


def _lowered(mods: list[tvm.IRModule], flavors: list[tuple[Kernels, int]], monkeypatch) -> list[tvm.IRModule]:
    out = []
    for mod, (kind, band) in zip(mods, flavors):
        monkeypatch.setattr(gemm_kernels, "LIMITS", gemm_kernels.Limits(band, gemm_kernels.LIMITS.private_bytes))
        with TARGET:
            out.append(legalize(TARGET, kind)(mod))
    return out


def test_remembered_lowerings_equal_fresh_ones_across_candidates(tmp_path, fresh, monkeypatch):
    model = load_model(zoo.save(zoo.resnet(8, resolution=32), tmp_path / "resnet8.onnx"))
    layers = [layer.name for layer in model.layers]

    def candidate(batch: int, trained: list[str], mode: str = "full", optimizer: str = "sgd", lr: float = 0.01):
        return Candidate(tuple((name, mode) for name in trained), batch_size=batch, optimizer=optimizer, lr=lr)

    candidates = [
        candidate(4, layers),  # every layer
        candidate(4, layers[-3:]),  # the same ops at the same batch, fewer of them
        candidate(3, layers[-3:], optimizer="momentum", lr=0.05),  # an odd batch, another optimizer
        candidate(3, layers[-4:], mode="bias"),
        candidate(4, layers),  # the first again, after all that
    ]
    mods = [build_training_module(model, c)[0] for c in candidates]
    # OpenBLAS and TVM's own kernels in one process; OpenBLAS with other tiles
    flavors = [
        (Kernels.OPENBLAS, gemm_kernels.LIMITS.band_bytes),
        (Kernels.TVM, gemm_kernels.LIMITS.band_bytes),
        (Kernels.OPENBLAS, 6000),
        (Kernels.OPENBLAS, gemm_kernels.LIMITS.band_bytes),
        (Kernels.TVM, gemm_kernels.LIMITS.band_bytes),
    ]
    remembered = _lowered(mods, flavors, monkeypatch)
    assert len(kernels._Remembered.memo) > 0
    fresh()
    for mine, theirs in zip(remembered, _lowered(mods, flavors, monkeypatch)):
        tvm.ir.assert_structural_equal(mine, theirs)


def _product(same: bool) -> tvm.IRModule:
    """`x * x` (one operand twice) or `x * y`, of the same types."""
    bb = relax.BlockBuilder()
    x, y = (relax.Var(n, relax.TensorType((4, 5), "float32")) for n in "xy")
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.multiply(x, x if same else y))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("first", ["x * x", "x * y"])
def test_an_operand_used_twice_is_not_confused_with_two_operands(first, fresh, monkeypatch):
    order = [_product(first == "x * x"), _product(first != "x * x")]
    flavors = [(Kernels.TVM, gemm_kernels.LIMITS.band_bytes)] * 2
    remembered = _lowered(order, flavors, monkeypatch)
    fresh()
    for mine, theirs in zip(remembered, _lowered(order, flavors, monkeypatch)):
        tvm.ir.assert_structural_equal(mine, theirs)
