"""The Relax VM back end: a candidate's step as one shared library that TVM's Relax VM runs, on
this machine or on a Linux board behind a tracker (`compile` builds it into the build cache;
`_backend` is the `Backend` the targets' `backend: vm` names).
"""

from planner.backend.vm._backend import HOST_TARGET, VmBackend
from planner.backend.vm.compile import VM_LIBRARY, CompiledStep

__all__ = ["HOST_TARGET", "VM_LIBRARY", "CompiledStep", "VmBackend"]
