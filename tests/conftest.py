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


SLOW_TESTS = [line.strip() for line in (Path(__file__).resolve().parent / "slow_tests.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]


def _in_slow_tier(nodeid: str) -> bool:
    """`file::function` names every case of the function; `file::function[prefix` the cases whose
    id starts so (tests/slow_tests.txt)."""
    key = nodeid.removeprefix("tests/")
    return any(key.startswith(entry) if "[" in entry else key.split("[", 1)[0] == entry for entry in SLOW_TESTS)


def pytest_collection_modifyitems(config, items) -> None:
    """The slow tier (tests/slow_tests.txt) gets the `slow` mark: the default run leaves it out
    (pyproject's `-m "not slow"`), `pytest -m slow` runs it."""
    for item in items:
        if _in_slow_tier(item.nodeid):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def example_builder():
    return load_example_builder()


@pytest.fixture(scope="session")
def fresh_examples(tmp_path_factory, example_builder) -> Path:
    """The examples rebuilt from examples/build.py into a temporary directory."""
    out = tmp_path_factory.mktemp("examples")
    assert example_builder.main(["--out", str(out)]) == 0
    return out


# --- exports several test files read, made once per session ------------------------------------


def load_megatron_examples():
    """examples/megatron.py as a module (the hand-written Megatron blocks), loaded once."""
    module = sys.modules.get("examples_megatron")
    if module is None:
        spec = importlib.util.spec_from_file_location("examples_megatron", EXAMPLES_DIR / "megatron.py")
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        sys.modules["examples_megatron"] = module
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def megatron_export(tmp_path_factory):
    """name -> (directory, sequential module) of examples/megatron.py's block `name` exported at
    TP 2 with `refine.exporters.export`, made on first use (tests/test_real_bugs.py, tests/test_causes.py).
    Readers must not write into the directory (copy it first)."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    import refine.exporters

    mt = load_megatron_examples()
    root = tmp_path_factory.mktemp("megatron")
    done: dict = {}

    def get(name: str):
        if name not in done:
            seq, factory, inputs = mt.build(name)
            refine.exporters.export(seq, factory, inputs, 2, root / name, **seq.export_options())
            done[name] = (root / name, seq)
        return done[name]

    return get


@pytest.fixture(scope="session")
def zoo_export(tmp_path_factory):
    """(model, config, tp, sp, bug name or None) -> `refine.exporters.export_model` of that zoo model,
    plan and bug (exporters/zoo/bugs.py: BUGS or CONTROLS), made on first use and shared by the test
    files that read the same export (tests/test_exporters.py, tests/test_plain_zoo.py). Readers
    must not write into the directory (copy it first)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    import refine.exporters
    from refine.exporters.zoo import bugs

    root = tmp_path_factory.mktemp("zoo_exports")
    done: dict = {}

    def get(model: str, config: str, tp: int, sp: bool, bug: str | None = None) -> Path:
        key = (model, config, tp, sp, bug)
        if key not in done:
            out = root / "_".join(str(k) for k in key)
            injected = (bugs.BUGS.get(bug) or bugs.CONTROLS[bug]) if bug else None
            refine.exporters.export_model(model, config, tp, sp, out, bug=injected)
            done[key] = out
        return done[key]

    return get


@pytest.fixture(scope="session")
def zoo_slice(tmp_path_factory):
    """`refine zoo` of Llama TP 2 with the plain TP plan: the correct model, missing_allreduce and
    the faulty_rowwise_none control (tests/test_zoo.py; tests/test_names.py reads the bug)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    from harness import invoke

    out = tmp_path_factory.mktemp("zoo") / "zoo"
    result = invoke("zoo", "--out", out, "--models", "llama", "--tp", "2", "--plans", "tp",
                    "--bugs", "none,missing_allreduce,faulty_rowwise_none")
    assert result.exit_code == 0, result.output
    assert "3 entries: 3 written" in result.stdout
    return out
