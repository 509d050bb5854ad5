"""The one exception of the exporters: a request that cannot be exported as asked.

Kept apart from torch so that `refine export` can report bad arguments (one line, exit 2)
before importing anything heavy.
"""

from __future__ import annotations


class ExportError(Exception):
    """Bad arguments or a model/plan the exporter cannot turn into a model directory."""
