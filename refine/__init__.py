"""refine: prove that a distributed model implementation refines its sequential model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refine.report.schema import Report

from refine.version import __version__  # noqa: F401 - the package's version


def _exporters_of_a_checkout() -> None:
    """In a source checkout (an editable install, the tests) the exporters are the repository's
    top-level folder exporters/, which the wheel ships as refine/exporters: there, the import
    system is told that `refine.exporters` is that folder (nothing installs a top-level
    `exporters` package, and nothing else is mapped)."""
    import importlib.abc
    import importlib.util
    import sys

    here = Path(__file__).resolve().parent
    folder = here.parent / "exporters"
    if (here / "exporters").is_dir() or not (folder / "__init__.py").is_file():
        return

    class CheckoutExporters(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
            if name != "refine.exporters":
                return None
            return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])

    sys.meta_path.append(CheckoutExporters())


_exporters_of_a_checkout()


def verify(model_dir: str | Path, *, rules: list[str | Path] | None = None, simulate: bool = True,
           memo: bool = True) -> Report:
    """Verify a model directory (seq.onnx, rank*.onnx, refine.json) as `refine verify` does and
    return its report (`report.verdict`: verified, refuted or unproven). Bad input raises
    refine.errors.InputError, whose text names the file and the problem."""
    from refine.pipeline import verify_dir  # (imported here: `import refine` stays light)

    return verify_dir(Path(model_dir), [Path(r) for r in rules] if rules else None, simulate=simulate, memo=memo)
