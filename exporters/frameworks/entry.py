"""What a framework's zoo entry (torchtitan_zoo, transformers_zoo) shares: the attributes
refine.exporters.zoo.entries' generate / export_entry read of an entry that is no zoo plan."""

from __future__ import annotations


class FrameworkEntry:
    """A mixin for the frozen dataclasses of the framework zoos: no zoo plan, no FSDP, no DP
    degree, and `train` read off the entry's `step` ("infer" or "train")."""

    parallel = None
    fsdp = False
    dp_degree = None
    step: str

    @property
    def train(self) -> bool:
        return self.step == "train"
