"""HF's token-moving expert parallelism (`AllToAllEP`), captured at static capacity (issue 42).

`DistributedConfig(ep_implementation="all_to_all")`, and what HF's `auto` picks for a training
step: each rank of the TP group takes its slice of the shared batch, sorts its routes by expert,
exchanges the per-expert counts (an all-to-all), reads the split sizes back to the host and sends
every route to its expert's rank with a ragged all-to-all; the experts run on the rows they
receive, a second ragged all-to-all brings the results back, and the slices are all-gathered.

HF's code runs unmodified. While a rank is captured (`all_to_all_at_static_capacity`):
- the split sizes and the ragged exchanges are exporters/capture/ragged.py's: the counts stay
  tensors of the program and each exchange is a `dist.AllToAllV` (no route leaves a rank more
  than `ceil(T / TP) * K` times, the bound of the receive buffer);
- the count exchange, c10d's in-place `all_to_all_single`, is its functional form copied back
  (exporters/capture/functional.py), as c10d's in-place all-reduce is.

The twin `ep_counts_unexchanged` (exporters/frameworks/transformers_bugs.py) skips the count
exchange: each rank takes the counts it sends for the counts it receives.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch


def _unexchanged(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> None:  # noqa: A002
    """The twin: the counts this rank sends taken for the counts it receives (no exchange)."""
    output.copy_(input)


@contextlib.contextmanager
def all_to_all_at_static_capacity(bug: str | None = None) -> Iterator[None]:
    """While the block runs, HF's `AllToAllEP` calls run at static capacity (module doc); with
    `bug` "ep_counts_unexchanged", without the count exchange."""
    import transformers.distributed.expert_parallel as hf_ep

    from refine.exporters.capture.functional import all_to_all_single_in_place
    from refine.exporters.capture.ragged import static_splits

    hf_dispatch, hf_combine = hf_ep.AllToAllEP._dispatch_tokens, hf_ep.AllToAllEP._combine_tokens

    # (the two exchanges only: the experts' own forward, which runs between them, keeps torch's ops)
    def dispatch(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        bound = math.ceil(hidden_states.shape[0] / self.tp_mesh.size()) * top_k_index.shape[-1]
        with static_splits(bound, hf_ep):
            return hf_dispatch(self, hidden_states, top_k_index, top_k_weights)

    def combine(self: Any, expert_output: torch.Tensor, state: Any) -> Any:
        with static_splits(max(state.send_sizes, default=0), hf_ep):
            return hf_combine(self, expert_output, state)

    saved = hf_ep.all_to_all_single
    hf_ep.AllToAllEP._dispatch_tokens, hf_ep.AllToAllEP._combine_tokens = dispatch, combine  # type: ignore[method-assign]
    hf_ep.all_to_all_single = _unexchanged if bug == "ep_counts_unexchanged" else all_to_all_single_in_place
    try:
        yield
    finally:
        hf_ep.AllToAllEP._dispatch_tokens, hf_ep.AllToAllEP._combine_tokens = hf_dispatch, hf_combine  # type: ignore[method-assign]
        hf_ep.all_to_all_single = saved
