"""`planner example`: the bundled example as image files, to plan from a folder of images."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from planner.cli._app import app
from planner.cli._errors import guard
from planner.cli._output import stdout


@app.command()
def example(out: Annotated[Path, typer.Argument(help="folder to write")] = Path("digits-images")) -> None:
    """Write the bundled example as image files: one folder per digit, train/ and val/.

    Grey PNG files of 8 to 32 pixels and preprocess.yaml, the steps that make each file the
    model's input — the form a camera leaves data in. Then plan from it:

        planner plan --data digits-images --preprocess digits-images/preprocess.yaml --out plan-images
    """
    from planner import api

    folder = guard(lambda: api.example_images(out=out))
    stdout.print(
        f"wrote {folder}/: train/ and val/, a folder of PNG files per digit, and preprocess.yaml. Plan it:\n"
        f"  planner plan --data {folder} --preprocess {folder}/preprocess.yaml --out plan-images",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
