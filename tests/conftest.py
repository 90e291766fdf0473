from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from builders import blobs, tiny_cnn  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """One compile cache for the whole run, never the user's."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("planner-cache")
    mp.setenv("PLANNER_CACHE_DIR", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_cnn(tmp_path_factory.mktemp("model") / "tiny.onnx")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return blobs(tmp_path_factory.mktemp("data") / "blobs.npz")
