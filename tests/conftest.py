"""Shared fixtures: the bundled examples, built once per test session."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = REPO / "examples"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/harness.py


def load_example_builder():
    """examples/build.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("examples_build", EXAMPLES_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules.setdefault("examples_build", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def example_builder():
    return load_example_builder()


@pytest.fixture(scope="session")
def fresh_examples(tmp_path_factory, example_builder) -> Path:
    """The examples rebuilt from examples/build.py into a temporary directory."""
    out = tmp_path_factory.mktemp("examples")
    assert example_builder.main(["--out", str(out)]) == 0
    return out
