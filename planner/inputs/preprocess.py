"""The preprocessing spec: how an image becomes the model's input, as data rather than code.

People who fine-tune a PyTorch model already wrote this once, as torchvision transforms:
`Compose([Resize(72), CenterCrop(64), ToTensor(), Normalize(mean, std)])`. planner takes the same
steps by the same names and parameters — on the command line as that very text, or in a YAML
list — completes what the model makes unambiguous (its channels, its input size), checks the
result against the model, and records the completed spec in plan.json, so `planner run` (and a
board) applies exactly the steps that were measured. This module is the spec's one owner: its
parsing, its JSON form and its application (on Pillow images, the library torchvision's PIL path
uses, so the pixels match torchvision's for the same steps).

`Random*` steps are train-time augmentation: applied to training batches only, drawn from a
seeded generator (the fine-tune's seed and step), so a study's fine-tune is reproducible. On the
val split and in evaluation, `RandomCrop` is a centre crop of its size and a flip is no flip.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
import yaml
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from planner.errors import BadInput
from planner.types import Encoding

Interpolation = Literal["nearest", "bilinear", "bicubic", "box", "hamming", "lanczos"]
_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
    "lanczos": Image.Resampling.LANCZOS,
}
Size = Annotated[int, Field(ge=1)]


def _hw(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else size


class Step(BaseModel):
    """One transform. `args` names the parameters a positional argument fills, in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    args: ClassVar[tuple[str, ...]] = ()
    on_tensor: ClassVar[bool] = False  # applies after ToTensor (to the float array), not to the image

    def apply(self, image: Any, rng: np.random.Generator | None) -> Any:
        raise NotImplementedError

    def to_json(self) -> dict:
        return {type(self).__name__: self.model_dump(mode="json")}


class Grayscale(Step):
    """PIL's "L" conversion (ITU-R 601-2 luma), as torchvision's Grayscale on an image."""

    args = ("num_output_channels",)
    num_output_channels: Literal[1, 3] = 1

    def apply(self, image, rng):
        grey = image.convert("L")
        return grey if self.num_output_channels == 1 else grey.convert("RGB")


class ToBGR(Step):
    """Reverse the colour channels (models trained on OpenCV's BGR images)."""

    def apply(self, image, rng):
        if image.mode != "RGB":
            return image
        r, g, b = image.split()
        return Image.merge("RGB", (b, g, r))


class Resize(Step):
    """An int resizes the shorter side to it, keeping the aspect ratio; [height, width] is exact."""

    args = ("size", "interpolation")
    size: Size | tuple[Size, Size]
    interpolation: Interpolation = "bilinear"

    def apply(self, image, rng):
        w, h = image.size
        if isinstance(self.size, int):  # torchvision's rule, to the pixel: the long side is truncated
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = self.size, int(self.size * long / short)
            new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
        else:
            new_h, new_w = self.size
        return image.resize((new_w, new_h), _RESAMPLE[self.interpolation])


def _pad_to(image: Image.Image, th: int, tw: int, fill: int = 0) -> Image.Image:
    """Pad (centred, with `fill`) an image smaller than th x tw, as torchvision's CenterCrop does."""
    w, h = image.size
    if w >= tw and h >= th:
        return image
    left, top = max(0, (tw - w) // 2), max(0, (th - h) // 2)
    out = Image.new(image.mode, (max(w, tw), max(h, th)), (fill,) * len(image.getbands()))
    out.paste(image, (left, top))
    return out


def _centre_crop(image: Image.Image, th: int, tw: int) -> Image.Image:
    image = _pad_to(image, th, tw)
    w, h = image.size
    top, left = int(round((h - th) / 2.0)), int(round((w - tw) / 2.0))
    return image.crop((left, top, left + tw, top + th))


class CenterCrop(Step):
    args = ("size",)
    size: Size | tuple[Size, Size]

    def apply(self, image, rng):
        return _centre_crop(image, *_hw(self.size))


class RandomCrop(Step):
    """Train: pad by `padding` on every side, then crop `size` at a random place. Eval: a centre crop."""

    args = ("size", "padding")
    size: Size | tuple[Size, Size]
    padding: int = Field(default=0, ge=0)
    fill: int = Field(default=0, ge=0, le=255)

    def apply(self, image, rng):
        th, tw = _hw(self.size)
        if rng is None:
            return _centre_crop(image, th, tw)
        if self.padding:
            w, h = image.size
            padded = Image.new(image.mode, (w + 2 * self.padding, h + 2 * self.padding), (self.fill,) * len(image.getbands()))
            padded.paste(image, (self.padding, self.padding))
            image = padded
        image = _pad_to(image, th, tw, self.fill)
        w, h = image.size
        top, left = int(rng.integers(0, h - th + 1)), int(rng.integers(0, w - tw + 1))
        return image.crop((left, top, left + tw, top + th))


class RandomHorizontalFlip(Step):
    args = ("p",)
    p: float = Field(default=0.5, ge=0.0, le=1.0)

    def apply(self, image, rng):
        if rng is not None and rng.random() < self.p:
            return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return image


class ToTensor(Step):
    """8-bit image -> float32 array, channels first, scaled to [0, 1] (torchvision's ToTensor)."""

    def apply(self, image, rng):
        array = np.asarray(image, dtype=np.float32) / 255.0
        return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)


class Normalize(Step):
    """(x - mean) / std per channel; one value applies to every channel."""

    args = ("mean", "std")
    on_tensor = True
    mean: tuple[float, ...] = Field(min_length=1)
    std: tuple[float, ...] = Field(min_length=1)

    @field_validator("mean", "std", mode="before")
    @classmethod
    def _sequence(cls, v):
        return (v,) if isinstance(v, int | float) else v

    @field_validator("mean", "std")
    @classmethod
    def _finite(cls, v):
        with np.errstate(over="ignore"):
            if not np.isfinite(np.asarray(v, np.float32)).all():
                raise ValueError("must be finite numbers within float32's range")
        return v

    @field_validator("std")
    @classmethod
    def _nonzero(cls, v):
        if any(s == 0 for s in v):
            raise ValueError("std must not be 0")
        return v

    def apply(self, array, rng):
        mean = np.asarray(self.mean, np.float32).reshape(-1, 1, 1)
        std = np.asarray(self.std, np.float32).reshape(-1, 1, 1)
        return (array - mean) / std


STEPS: dict[str, type[Step]] = {
    c.__name__: c for c in (Grayscale, ToBGR, Resize, CenterCrop, RandomCrop, RandomHorizontalFlip, ToTensor, Normalize)
}
_GEOMETRY = (Resize, CenterCrop, RandomCrop)


class Preprocess:
    """A checked, complete list of steps from a decoded image to one model input (C, H, W)."""

    def __init__(self, steps: Sequence[Step]) -> None:
        self.steps = tuple(steps)

    @property
    def augments(self) -> bool:
        return any(isinstance(s, RandomCrop | RandomHorizontalFlip) for s in self.steps)

    def to_json(self) -> list[dict]:
        return [s.to_json() for s in self.steps]

    def __eq__(self, other) -> bool:
        return isinstance(other, Preprocess) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(str(self.to_json()))

    def __str__(self) -> str:
        """The steps as torchvision code would write them."""

        def call(step: Step) -> str:
            given = step.model_dump(exclude_defaults=True)
            return f"{type(step).__name__}({', '.join(f'{k}={_literal(v)}' for k, v in given.items())})"

        return ", ".join(call(s) for s in self.steps)

    def pixel_encoding(self, channels: int) -> Encoding:
        """The model input as an affine map of the 8-bit pixels the image steps give: `ToTensor`'s
        division by 255, then each `Normalize` (the steps after `ToTensor`). Encoding a model input
        with it gives back its pixels (the map's float32 rounding is far below half a code)."""
        scale, offset = np.full(channels, 1 / 255), np.zeros(channels)
        for step in self.steps:
            if isinstance(step, Normalize):
                mean, std = np.broadcast_to(step.mean, channels), np.broadcast_to(step.std, channels)
                scale, offset = scale / std, (offset - mean) / std
        return Encoding(tuple(map(float, scale)), tuple(map(float, offset)))

    def apply(self, image: Image.Image, rng: np.random.Generator | None = None) -> np.ndarray:
        """The model input for a decoded RGB image; `rng` given: the training view (augmented)."""
        out: Any = image
        for step in self.steps:
            out = step.apply(out, rng)
        return out

    @classmethod
    def from_json(cls, raw: Any, where: str) -> Preprocess:
        return cls(_parse_list(raw, where))

    @classmethod
    def complete(cls, given: Sequence[Step] | None, input_shape: tuple[int, ...], where: str) -> Preprocess:
        """`given`, completed where the model leaves no choice and checked against its input.

        Added: `Grayscale()` first for a one-channel model; `Resize(max(H, W))` and
        `CenterCrop([H, W])` when no step sets the size (torchvision's evaluation recipe);
        `ToTensor()` after the image steps. Refused: steps out of order, a size or channel count
        the model does not take, a Normalize with neither one value nor one per channel.
        """
        if len(input_shape) != 3 or input_shape[0] not in (1, 3):
            raise BadInput(
                f"images need a model whose input is (channels, height, width) with 1 or 3 channels; "
                f"this model's input is {tuple(input_shape)}"
            )
        channels, height, width = input_shape
        steps = list(given or [])
        kinds = [2 if s.on_tensor else 1 if isinstance(s, ToTensor) else 0 for s in steps]
        if kinds != sorted(kinds) or kinds.count(1) > 1:
            got = ", ".join(type(s).__name__ for s in steps)
            raise BadInput(f"{where}: the order is image steps, then ToTensor once, then Normalize; got {got}")
        if 1 not in kinds:
            steps.insert(kinds.count(0), ToTensor())
        if channels == 1 and not any(isinstance(s, Grayscale) for s in steps):
            steps.insert(0, Grayscale())
        if not any(isinstance(s, _GEOMETRY) for s in steps):
            at = next(i for i, s in enumerate(steps) if isinstance(s, ToTensor))
            steps[at:at] = [Resize(size=max(height, width)), CenterCrop(size=(height, width) if height != width else height)]
        out_channels = 3
        for s in steps:
            if isinstance(s, Grayscale):
                out_channels = s.num_output_channels
            if isinstance(s, Normalize):
                for what in ("mean", "std"):
                    n = len(getattr(s, what))
                    if n not in (1, out_channels):
                        raise BadInput(f"{where}: Normalize's {what} has {n} values; the images have {out_channels} channels")
        if out_channels != channels:
            raise BadInput(f"{where}: the steps give {out_channels}-channel images; the model takes {channels} channels")
        size = next((_hw(s.size) for s in reversed(steps) if isinstance(s, CenterCrop | RandomCrop)), None)
        last = next(s for s in reversed(steps) if isinstance(s, _GEOMETRY))
        if isinstance(last, Resize) and not isinstance(last.size, int):
            size = last.size
        elif isinstance(last, Resize):
            size = None  # the other side follows each image's aspect ratio: checked per image
        if size is not None and size != (height, width):
            raise BadInput(f"{where}: the steps give {size[0]}x{size[1]} images; the model takes {height}x{width}")
        return cls(steps)


def _literal(v: Any) -> str:
    return repr(list(v) if isinstance(v, tuple) else v)


def _make(name: str, args: Sequence[Any], kwargs: dict[str, Any], where: str) -> Step:
    cls = STEPS.get(name)
    if cls is None:
        raise BadInput(f"{where}: unknown step {name!r} (known: {', '.join(STEPS)})")
    if len(args) > len(cls.args):
        raise BadInput(f"{where}: {name} takes at most {len(cls.args)} positional arguments, got {len(args)}")
    values = dict(zip(cls.args, args))
    for k in values.keys() & kwargs.keys():
        raise BadInput(f"{where}: {name} got {k} twice")
    try:
        return cls.model_validate({**values, **kwargs})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise BadInput(f"{where}: {name}{f'.{loc}' if loc else ''}: {err['msg']}") from None


def _parse_list(raw: Any, where: str) -> list[Step]:
    """The YAML/JSON form: a list whose items are a name (`ToTensor`) or a one-key mapping from a
    name to its argument (`Resize: 72`), its positional arguments (`Resize: [[64, 80]]`) or its
    keyword arguments (`Normalize: {mean: [0.5], std: [0.5]}`)."""
    if not isinstance(raw, list):
        raise BadInput(f"{where}: a preprocessing spec is a list of steps, e.g. [Resize: 72, CenterCrop: 64, ToTensor]")
    steps = []
    for item in raw:
        if isinstance(item, str):
            steps.append(_make(item, (), {}, where))
        elif isinstance(item, dict) and len(item) == 1:
            ((name, arg),) = item.items()
            if isinstance(arg, dict):
                steps.append(_make(str(name), (), arg, where))
            elif isinstance(arg, list) and (name not in ("Resize", "CenterCrop", "RandomCrop") or _nested(arg)):
                steps.append(_make(str(name), arg, {}, where))
            else:  # a size given as [height, width] is one argument, not two
                steps.append(_make(str(name), () if arg is None else (arg,), {}, where))
        else:
            raise BadInput(f"{where}: each step is a name or a one-key mapping of a name to its arguments; got {item!r}")
    return steps


def _nested(arg: list) -> bool:
    """`[[64, 80]]` or `[[64, 80], bicubic]`: positional arguments, the first a size."""
    return bool(arg) and isinstance(arg[0], list)


def _call_name(node: ast.expr) -> str | None:
    """`Resize`, `T.Resize`, `transforms.Resize`, `torchvision.transforms.Resize`: the last name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _value(node: ast.expr, where: str) -> Any:
    """A literal argument; `InterpolationMode.BICUBIC` is read as "bicubic"."""
    if isinstance(node, ast.Attribute) and _call_name(node.value) == "InterpolationMode":
        return node.attr.lower()
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # `{[1]: 2}` is a TypeError
        raise BadInput(f"{where}: arguments must be literal numbers, lists or strings; got {ast.unparse(node)!r}") from None


def parse_text(text: str, where: str = "--preprocess") -> list[Step]:
    """The command-line form, written as torchvision code: `Resize(72), CenterCrop(64), ToTensor(),
    Normalize(mean=[0.5], std=[0.5])`, optionally inside `Compose([...])`. Parsed, never run."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as exc:
        raise BadInput(f"{where}: not a list of steps like 'Resize(72), CenterCrop(64)' ({exc.msg})") from None
    if isinstance(tree, ast.Call) and _call_name(tree.func) == "Compose" and len(tree.args) == 1:
        tree = tree.args[0]
    nodes = tree.elts if isinstance(tree, ast.Tuple | ast.List) else [tree]
    steps = []
    for node in nodes:
        if isinstance(node, ast.Call) and (name := _call_name(node.func)):
            keys = [k.arg for k in node.keywords]
            if None in keys or any(isinstance(a, ast.Starred) for a in node.args):
                raise BadInput(f"{where}: {ast.unparse(node)!r}: write the arguments out; * and ** are not read")
            if len(set(keys)) != len(keys):
                raise BadInput(f"{where}: {ast.unparse(node)!r} gives an argument twice")
            kwargs = {k.arg: _value(k.value, where) for k in node.keywords if k.arg}
            steps.append(_make(name, [_value(a, where) for a in node.args], kwargs, where))
        elif name := _call_name(node):
            steps.append(_make(name, (), {}, where))
        else:
            raise BadInput(f"{where}: {ast.unparse(node)!r} is not a step like Resize(72)")
    return steps


def parse_spec(spec: str | Path) -> list[Step]:
    """A YAML file's steps (a path ending in .yaml, .yml or .json) or the command-line text."""
    path = Path(spec)
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        if not path.is_file():
            raise BadInput(f"preprocessing spec not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text())
        except UnicodeDecodeError:
            raise BadInput(f"{path}: not a YAML preprocessing spec (the file is not text)") from None
        except yaml.YAMLError as exc:
            raise BadInput(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        return _parse_list(raw, str(path))
    return parse_text(str(spec))
