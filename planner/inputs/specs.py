"""Load a YAML spec (a target, a search space) by shipped name or path, validated by pydantic."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from planner.errors import BadInput

T = TypeVar("T", bound=BaseModel)


def load_spec(name_or_path: str, directory: Path, kind: str, cls: type[T]) -> T:
    """`NAME` means `directory/NAME.yaml`; anything with a suffix is a user's file.

    Errors name the file and the offending key in one line, e.g.
    `space.yaml: batch_size.0: Input should be a valid integer`.
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = directory / f"{name_or_path}.yaml"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in directory.glob("*.yaml")))
        raise BadInput(f"unknown {kind} {name_or_path!r} (shipped: {shipped}; or a path to a YAML file)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        if not isinstance(raw, dict):
            raise BadInput(f"{path}: a {kind} must be a YAML mapping")
        return cls.model_validate({"name": path.stem, **raw})
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not a YAML {kind} (the file is not text)") from None
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        raise BadInput(f"{path}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from None
