"""The `qemu` runner: a C step's firmware run on an emulated Cortex-M board, its instructions counted.

`qemu-system-arm` boots the ELF the `c` back end linked (`-machine`/`-cpu` from the target's `mcu.qemu`)
with `-icount shift=0`: the guest's clock then advances one nanosecond per instruction, so the
board's SysTick counts instructions, deterministically, whatever the host is doing. The firmware
(`planner/backend/mcu/runtime/main.c`) serves the step over two named pipes in a private folder,
opened through Arm semihosting: weights and batches go in, losses, logits, instruction counts and
trained weights come out. A latency is the instruction count at the target's clock: an estimate
at one instruction per cycle, labelled so.
"""

from __future__ import annotations

import errno
import os
import select
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import numpy as np

from planner.backend._base import Artifact
from planner.backend.mcu import C_FIRMWARE, CFirmware
from planner.backend.mcu.cvalues import label_dtype
from planner.errors import BadInput, CandidateFailed, EnvironmentFailure
from planner.inputs.targets import HardwareTarget, Mcu
from planner.measurement._base import Measurement, Runner, Session
from planner.runtime.session import Inputs, example_batch, padded, score, step_inputs
from planner.runtime.weights import from_step, to_step
from planner.types import Latency, StepSignature

T = TypeVar("T")
QEMU = "qemu-system-arm"
INSTALL_HINT = "install qemu-system-arm (Debian/Ubuntu: apt-get install qemu-system-arm)"
PROTOCOL_VERSION = 1
START_TIMEOUT_S = 30.0  # from launch to the firmware's greeting
COMMAND_TIMEOUT_S = 600.0  # one command (a step of a large model runs minutes emulated)


def _board(target: HardwareTarget) -> Mcu:
    if target.mcu is None:
        raise BadInput(f"target {target.name}: the qemu runner needs an `mcu:` section (its `qemu:` machine and core, the clock)")
    return target.mcu


class _Board:
    """One qemu process running one firmware image, spoken to through two named pipes."""

    def __init__(self, elf: Path, board: Mcu):
        if shutil.which(QEMU) is None:
            raise EnvironmentFailure(f"the qemu runner needs {QEMU}, not found ({INSTALL_HINT})")
        self.folder = Path(tempfile.mkdtemp(prefix="planner-qemu-"))
        self.proc: subprocess.Popen | None = None
        self.to_board = self.from_board = -1
        try:
            for name in ("in", "out"):
                os.mkfifo(self.folder / name, 0o600)
            # the reading end first: a reader that never had a writer waits for one in poll()
            self.from_board = os.open(self.folder / "out", os.O_RDONLY | os.O_NONBLOCK)
            self.log = open(self.folder / "qemu.log", "wb")
            argv = [QEMU, "-machine", board.qemu.machine, "-cpu", board.qemu.cpu, "-nographic", "-monitor", "none"]
            argv += ["-serial", "null", "-semihosting-config", "enable=on,target=native"]
            argv += ["-icount", "shift=0,align=off,sleep=off", "-kernel", str(elf.resolve())]
            self.proc = subprocess.Popen(argv, cwd=self.folder, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
            self.to_board = self._open_writer(time.monotonic() + START_TIMEOUT_S)
            greeting = self.read(12, START_TIMEOUT_S)
            magic, version, self.per_tick = struct.unpack("<4sIf", greeting)
            if magic != b"PLNR" or version != PROTOCOL_VERSION:
                raise CandidateFailed(f"the firmware speaks {magic!r} v{version}, not planner's protocol v{PROTOCOL_VERSION}")
        except BaseException:
            self.close()
            raise

    def _open_writer(self, deadline: float) -> int:
        """The pipe into the board, once the firmware has opened its end (it does so first thing)."""
        while True:
            try:
                fd = os.open(self.folder / "in", os.O_WRONLY | os.O_NONBLOCK)
                os.set_blocking(fd, True)
                return fd
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise
            self._alive("starting")
            if time.monotonic() > deadline:
                raise CandidateFailed(f"the firmware did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.005)

    def _alive(self, doing: str) -> None:
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None:
            raise CandidateFailed(f"the emulated board stopped while {doing} (exit {code}): {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            lines = (self.folder / "qemu.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1] if lines else "no output"

    def read(self, n: int, timeout: float = COMMAND_TIMEOUT_S) -> bytes:
        out = bytearray()
        deadline = time.monotonic() + timeout
        poller = select.poll()
        poller.register(self.from_board, select.POLLIN)
        while len(out) < n:
            if time.monotonic() > deadline:
                raise CandidateFailed(f"the emulated board did not answer within {timeout:.0f} s (a hung step?)")
            if not poller.poll(200):
                self._alive("computing")
                continue
            chunk = os.read(self.from_board, n - len(out))
            if not chunk:  # every writer gone: the firmware stopped
                time.sleep(0.05)
                self._alive("answering")
                raise CandidateFailed("the emulated board closed its output")
            out += chunk
        return bytes(out)

    def write(self, *chunks: bytes | np.ndarray) -> None:
        try:
            for chunk in chunks:
                _write_all(self.to_board, chunk if isinstance(chunk, bytes) else np.ascontiguousarray(chunk).tobytes())
        except BrokenPipeError:
            self._alive("reading")
            raise CandidateFailed("the emulated board stopped reading") from None

    def close(self) -> None:
        for fd in (self.to_board, self.from_board):
            if fd >= 0:
                os.close(fd)
        self.to_board = self.from_board = -1
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if hasattr(self, "log"):
            self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def kernel_instructions(firmware: CFirmware, weights: dict[str, np.ndarray], board: Mcu, *, seed: int = 0) -> list[int]:
    """The instructions each kernel call of one step takes on `board`'s emulated core, in order,
    on an example batch drawn with `seed` (`firmware.calls` names the kernels)."""
    session = QemuSession(firmware, weights, board)
    try:
        x, y = example_batch(firmware.signature, np.random.default_rng(seed))
        return session.profile(x, y, len(firmware.calls))
    finally:
        session.close()


class QemuSession:
    """A firmware image running on its emulated board, holding a full set of weights."""

    def __init__(self, artifact: Artifact, weights: dict[str, np.ndarray], board: Mcu):
        self.sig: StepSignature = artifact.signature
        sig = self.sig
        stored = to_step(weights, sig.layouts, sig.quantized)
        missing = [n for n in (*sig.frozen, *sig.trainable) if n not in stored]
        if missing:
            raise KeyError(f"weights lack {', '.join(missing)}")
        self.frozen = {n: stored[n] for n in sig.frozen}
        self._state = [np.ascontiguousarray(stored[n]) for n in sig.trainable]
        self._state += [np.full(shape, fill, dtype) for shape, dtype, fill in sig.optim_states]
        self.board = _Board(artifact.entry, board)
        try:
            self.board.write(b"C", *(np.ascontiguousarray(stored[n]) for n in sig.frozen))
            if self.board.read(1) != b"k":
                raise CandidateFailed(
                    "the firmware's frozen weights (constants in its flash) are not the weights given; build it from them"
                )
            self.board.write(b"L", *self._state)
            self.board.read(1)
        except BaseException:
            self.board.close()
            raise
        self.last_instructions = 0

    def step(self, x: Inputs, y: np.ndarray) -> float:
        self.board.write(b"S", *step_inputs(self.sig, x), np.ascontiguousarray(y, dtype=label_dtype(self.sig)))
        rc, loss, ticks = struct.unpack("<ifQ", self.board.read(16))
        if rc != 0:
            raise CandidateFailed(f"the step failed on the emulated board (code {rc}: its scratch pool ran out?)")
        self.last_instructions = round(ticks * self.board.per_tick)
        return loss / self.sig.loss_scale

    def profile(self, x: Inputs, y: np.ndarray, calls: int) -> list[int]:
        """One step on a batch, the instructions of each of its `calls` kernel calls, in order."""
        self.board.write(b"K", *step_inputs(self.sig, x), np.ascontiguousarray(y, dtype=label_dtype(self.sig)))
        ticks = np.frombuffer(self.board.read(4 * calls), np.uint32)
        rc, _, _ = struct.unpack("<ifQ", self.board.read(16))
        if rc != 0:
            raise CandidateFailed(f"the step failed on the emulated board (code {rc})")
        return [round(int(t) * self.board.per_tick) for t in ticks]

    def outputs(self, x: Inputs) -> np.ndarray:
        B, C = self.sig.micro_batch, self.sig.output_shape
        arrays, chunks = step_inputs(self.sig, x), []
        for i in range(0, len(arrays[0]), B):
            parts = [a[i : i + B] for a in arrays]
            pad = B - len(parts[0])
            parts = padded(parts, arrays, B, self.sig.batched_output)
            self.board.write(b"P", *parts)
            (rc,) = struct.unpack("<i", self.board.read(4))
            logits = np.frombuffer(self.board.read(4 * B * int(np.prod(C))), np.float32).reshape(B, *C)
            if rc != 0:
                raise CandidateFailed(f"a prediction failed on the emulated board (code {rc})")
            chunks.append(logits[: B - pad] if self.sig.batched_output else np.full(B - pad, logits.flat[0], np.float32))
        return np.concatenate(chunks) if chunks else np.zeros((0, *C), np.float32)

    def evaluate_chunks(self, chunks: Iterable[tuple[Inputs, np.ndarray]]) -> tuple[float, float]:
        return score(self.sig.task, self.outputs, chunks)

    def weights(self) -> dict[str, np.ndarray]:
        self.board.write(b"W")
        for k, array in enumerate(self._state):
            self._state[k] = np.frombuffer(self.board.read(array.nbytes), array.dtype).reshape(array.shape).copy()
        parts = {**self.frozen, **dict(zip(self.sig.trainable, self._state))}
        return from_step(parts, self.sig.layouts, self.sig.quantized)

    def close(self) -> None:
        try:
            self.board.write(b"Q")
            self.board.read(1, timeout=10)
        except CandidateFailed:
            pass
        finally:
            self.board.close()


class QemuRunner(Runner):
    name = "qemu"
    latency_estimated = True  # an instruction count at one per cycle (see `latency_method`)
    kinds = frozenset({C_FIRMWARE})
    runs_here = False  # the fine-tune that measures accuracy runs on the host's VM build

    def __init__(self, target: HardwareTarget) -> None:
        super().__init__(target)
        self.board = _board(target)

    @property
    def device(self) -> str:
        return f"qemu:{self.board.qemu.machine}"

    def capacity(self) -> int:
        """Instruction counts do not depend on the host's load: as many boards as cores."""
        if shutil.which(QEMU) is None:
            raise EnvironmentFailure(f"the qemu runner needs {QEMU}, not found ({INSTALL_HINT})")
        return max(1, os.cpu_count() or 1)

    def status(self) -> dict[str, str]:
        return {"emulator": f"{QEMU} -machine {self.board.qemu.machine} -cpu {self.board.qemu.cpu}"}

    def _session(self, artifact: Artifact, weights: dict[str, np.ndarray]) -> QemuSession:
        self.check_kind(artifact)
        return QemuSession(artifact, weights, self.board)

    def measure(self, artifact: Artifact, weights: dict[str, np.ndarray], repeats: int) -> Measurement:
        session = self._session(artifact, weights)
        try:
            x, y = example_batch(session.sig, np.random.default_rng(0))
            counts = []
            for _ in range(max(1, repeats)):
                session.step(x, y)
                counts.append(session.last_instructions)
        finally:
            session.close()
        ms = np.asarray(counts, np.float64) / self.board.clock_hz * 1e3
        latency = Latency(
            median=float(np.median(ms)),
            p90=float(np.percentile(ms, 90)),
            min=float(ms.min()),
            max=float(ms.max()),
            repeats=len(counts),
            number=1,
            device=self.device,
        )
        return Measurement(latency=latency, board=self.device)

    def train(self, artifact: Artifact, weights: dict[str, np.ndarray], work: Callable[[Session], T], *, threads: int = 0) -> T:
        session = self._session(artifact, weights)
        try:
            return work(session)
        finally:
            session.close()

    def latency_method(self, latency: Latency) -> str:
        clock = self.board.clock_hz
        median, low, high = (round(v * clock / 1e3) for v in (latency.median, latency.min, latency.max))
        return (
            f"instructions counted on {QEMU} -machine {self.board.qemu.machine} -cpu {self.board.qemu.cpu} with "
            f"-icount shift=0 (SysTick ticks calibrated in instructions), whole step (forward+backward+update); "
            f"median {median:,} instructions per step over {latency.repeats} steps (spread {low:,}-{high:,}); the ms are "
            f"an estimate: those instructions at one per cycle at {clock / 1e6:g} MHz"
        )
