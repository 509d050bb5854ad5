"""Versions, read off the installed packages' metadata (never written down twice): refine's own,
and the frameworks' an export ran (torch, transformers, Megatron-Core) for refine.json and reports."""

from __future__ import annotations

from importlib import metadata


def installed(package: str) -> str | None:
    """The installed version of a distribution package, or None where it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


__version__ = installed("refine") or "unknown (not installed)"


def framework_versions(*packages: str) -> dict[str, str]:
    """{distribution: installed version} of those of `packages` that are installed (what an
    export's manifest records of the frameworks it ran)."""
    return {name: version for name in packages if (version := installed(name)) is not None}
