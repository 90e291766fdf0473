"""The bundled example as image files: the digits task in the form a camera leaves it.

The same transfer task as `examples/digits/digits.npz`, written as grey PNG files of 8 to 32
pixels, one folder per digit under `train/` and `val/`, with the preprocessing spec that brings
them back to the model's input (`examples/digits/preprocess.yaml`). Generated on first use rather
than shipped as 899 files; written to a temporary folder and renamed, so an interrupted write
leaves no half-made example behind.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from planner.errors import BadInput, OutputUnwritable
from planner.inputs.defaults import DEFAULT_DATA, EXAMPLE_DIR

SPEC = "preprocess.yaml"
SIZES = (8, 12, 16, 20, 24, 28, 32)  # each image at one of these, as photos come in any size


def write_image_example(out: Path) -> Path:
    """The image example in `out` (made if missing); `out` already holding it is kept as it is."""
    out = Path(out)
    if (out / SPEC).is_file() and (out / "train").is_dir() and (out / "val").is_dir():
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"`out` {out} exists and is not the image example; give a new directory")
    with np.load(DEFAULT_DATA) as npz:
        arrays = {k: npz[k] for k in npz.files}
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=out.absolute().parent, prefix=f".{out.name}-"))
    except OSError as exc:
        raise OutputUnwritable(f"cannot write the example into {out}: {exc.strerror or exc}") from None
    try:
        for split in ("train", "val"):
            for i, (x, y) in enumerate(zip(arrays[f"x_{split}"], arrays[f"y_{split}"])):
                # the sensor's range, -0.1..1.1, as 8-bit grey; the spec's Normalize maps it back
                grey = Image.fromarray(np.clip(np.round((x[0] + 0.1) / 1.2 * 255), 0, 255).astype(np.uint8))
                size = SIZES[i % len(SIZES)]
                folder = staging / split / str(int(y))
                folder.mkdir(parents=True, exist_ok=True)
                grey.resize((size, size), Image.Resampling.NEAREST).save(folder / f"{split}-{i:04d}.png")
        shutil.copyfile(EXAMPLE_DIR / SPEC, staging / SPEC)
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except OSError as exc:
        raise OutputUnwritable(f"cannot write the example into {out}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
