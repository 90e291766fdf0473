"""The `c` back end: a candidate's step as bare-metal C for a microcontroller, linked into firmware.

What planner builds for a Linux board is already a static program once its passes have run, so the
same lowered step becomes C (`planner.backend.mcu.cstep`): TVM's C for every kernel, a driver with every
tensor at a fixed offset of one static arena, the weights as flash constants and SRAM buffers, and
an ELF for the target's emulated board (`_firmware`), where the `qemu` runner measures it. The plan
directory carries the sources too, for a real board's firmware project.
"""

from planner.backend.mcu._backend import C_FIRMWARE, CBackend, CFirmware

__all__ = ["C_FIRMWARE", "CBackend", "CFirmware"]
