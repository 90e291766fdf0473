"""The Typer application every command module registers with, and the options they share."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

# TVM's FFI imports PyTorch eagerly whenever it is installed (a work-around for Windows in
# tvm_ffi/__init__.py): 2-3 s on every command, for a library planner never calls. The command
# keeps it out; a script that imports planner as a library is not affected.
sys.modules.setdefault("torch", None)  # type: ignore[arg-type]

GIL_TURN_S = 0.0005  # Python's own switch interval is 5 ms: two batch-1 training steps


@contextlib.contextmanager
def short_gil_turns() -> Iterator[None]:
    """Shorter turns on the GIL while a search's trials run in threads side by side: a setting of
    the whole process, so the command sets it, not the library (a script calling `planner.plan`
    may set `sys.setswitchinterval` itself).

    A fine-tune is C (the step) between short stretches of Python; each time a step returns, its
    thread needs the GIL back, and a compile beside it, running TVM's passes, keeps the GIL until
    the switch interval ends. At Python's 5 ms a batch-1 fine-tune (2 ms steps) waited longer than
    it computed: 200 steps of MobileNetV2-0.35@96 beside compiles took 1.18-1.34 s, 1.04-1.22 s at
    0.2 ms (0.87-0.99 s alone), and the compiles beside them ran no slower."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(GIL_TURN_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


def _version(shown: bool) -> None:
    if shown:
        from planner import __version__

        print(f"planner {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print planner's version and exit")
    ] = False,
) -> None:
    """Plan on-device training: which layers to update, in what precision, with what batch size —
    measured with TVM on the target, searched with Optuna."""


TrackerOpt = Annotated[
    str | None, typer.Option(help="HOST:PORT of a TVM RPC tracker: measure on its boards instead of the target's runner")
]
KeyOpt = Annotated[str | None, typer.Option(help="board key at the tracker (with --tracker)")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="one line per trial and planner's debug log on stderr")]
QuietOpt = Annotated[
    bool, typer.Option("--quiet", "-q", help="no progress on stderr (it is off anyway when stderr is not a terminal)")
]
DATA_HELP = (
    "dataset: a .npz (x_train/y_train/x_val/y_val, or x/y; labels as indices or names) or a folder of "
    "the same arrays as .npy files, a folder of images with one subfolder per class (train/ and val/ "
    "inside, or a 20 % split is drawn), a CSV of path,label rows, or text: a CSV with a text,label header "
    'or a .jsonl of {"text", "label"} (with --tokenizer)'
)
TokenizerOpt = Annotated[
    Path | None,
    typer.Option(
        help="text: the tokenizer.json (Hugging Face tokenizers) that makes each text the model's token ids, "
        "truncated and padded to the model's length; the plan keeps a copy, and `planner run` tokenises with it",
        show_default=False,
    ),
]
PreprocessOpt = Annotated[
    str | None,
    typer.Option(
        help="images: how a file becomes the model's input, as torchvision transforms — "
        "'Resize(72), CenterCrop(64), Normalize(mean=[0.5], std=[0.5])' — or a YAML list of them; "
        "Random* steps augment training only. Channels, size and ToTensor are completed from the model "
        "[default: Resize and CenterCrop to the model's input, scaled to 0..1]",
        show_default=False,
    ),
]
