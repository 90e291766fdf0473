"""Gradients TVM 0.27 lacks, gets wrong, or keeps more memory for, set as Relax's own op attributes.

One module per kind of op (`elementwise`, `convolution`, `normalization`, `indexing`,
`reduction`, `pooling`), each
with its `GRADIENTS`. Each is checked against float64 finite differences of ONNX's reference
runtime through the ops that lower to it (tests/test_operators.py) and, in the models PyTorch
exports, against PyTorch autograd (tests/test_pytorch_families.py). They are in force only inside
`installed()`, which the training graph builder holds while it builds: other TVM users in the
process keep TVM's gradients.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import tvm

from planner.backend.graph.gradients import convolution, elementwise, indexing, normalization, pooling, reduction
from planner.backend.graph.gradients._common import Gradients

_GRADIENTS: Gradients = {
    **elementwise.GRADIENTS,
    **convolution.GRADIENTS,
    **normalization.GRADIENTS,
    **indexing.GRADIENTS,
    **reduction.GRADIENTS,
    **pooling.GRADIENTS,
}
_ATTR = "FPrimalGradient"
_TVM_LEVEL = 10  # the level TVM registers its own gradients at (`register_gradient`'s default)

_lock = threading.Lock()
_users = 0  # planner differentiations in progress, in any thread
_theirs: dict[str, object | None] = {}  # while installed: what each op planner set had before (None: nothing)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Planner's gradients in force for the duration, TVM's own again after, even on an exception.

    Relax keeps one gradient per op for the whole process, so registering planner's for good
    (`register_gradient`) changed TVM's ReLU, conv2d, take, triu and astype gradients for every
    other TVM user in the process. The first of planner's differentiations in progress (in any
    thread: planner builds in several, and nests this freely) sets planner's gradients; the last to
    end puts back exactly what each op had, or none where TVM has none. Between the two no gradient
    changes, so a gradient pass running in another planner thread never sees one half set.
    """
    global _users
    with _lock:
        if not _users:
            _install()
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if not _users:
                _restore()


def _install() -> None:
    try:
        for name, (grad, replaces) in _GRADIENTS.items():
            op = tvm.ir.Op.get(name)
            theirs = op.get_attr(_ATTR)
            if theirs is not None and not replaces:
                continue
            _theirs[name] = theirs
            op.reset_attr(_ATTR)  # (TVM refuses a second value at the same level and ignores one at a lower)
            op.set_attr(_ATTR, grad, _TVM_LEVEL + 1)
    except BaseException:
        _restore()
        raise


def _restore() -> None:
    for name, theirs in _theirs.items():
        op = tvm.ir.Op.get(name)
        op.reset_attr(_ATTR)
        if theirs is not None:
            op.set_attr(_ATTR, theirs, _TVM_LEVEL)
    _theirs.clear()
