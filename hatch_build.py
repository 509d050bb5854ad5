"""Build hook: the wheel ships the lemma library and the exporters inside the one import package
(rules/ -> refine/rules, exporters/ -> refine/exporters). An editable install copies nothing: it
maps `refine` to the checkout (dev-mode-exact), where refine finds ../rules and ../exporters
itself (refine.run.engine.builtin_rules_dir, refine/__init__.py); a copy in site-packages would
stand in front of the checkout and go stale."""

from __future__ import annotations

from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SHIPPED_INSIDE = {"rules": "refine/rules", "exporters": "refine/exporters"}


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name == "wheel" and version == "standard":
            build_data["force_include"].update(SHIPPED_INSIDE)
