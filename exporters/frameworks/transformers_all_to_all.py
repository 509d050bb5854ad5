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

The twins (exporters/frameworks/transformers_bugs.py): `ep_counts_unexchanged` skips the count
exchange (each rank takes the counts it sends for the counts it receives);
`ep_combine_forward_order` is HF's `_combine_tokens` with the rows brought back gathered at the
sort's order where they are scattered by it.
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


def _combine_at_forward_order(self: Any, expert_output: torch.Tensor, state: Any) -> torch.Tensor:
    """The twin `ep_combine_forward_order`: HF's `AllToAllEP._combine_tokens` (transformers 5.x) with
    one line changed, the rows back in the order they were sent gathered at the order."""
    from torch.distributed.tensor import DTensor, Shard
    from transformers.distributed.expert_parallel import all_to_all_single_autograd

    hidden_dim = expert_output.size(-1)
    recv_out = all_to_all_single_autograd(expert_output, state.send_sizes, state.recv_sizes, self.ep_mesh.get_group())
    token_outputs = recv_out[state.order]  # the twin: HF writes `token_outputs[state.order] = recv_out`
    token_outputs = token_outputs.view(*state.top_k_weights.shape, hidden_dim)
    output = (token_outputs * state.top_k_weights.unsqueeze(-1)).sum(dim=1)
    if self.tp_mesh.size() == 1:
        return output
    output = DTensor.from_local(output.contiguous(), self.tp_mesh, [Shard(0)], shape=(state.num_tokens, hidden_dim),
                                stride=(hidden_dim, 1))
    return output.full_tensor()


@contextlib.contextmanager
def all_to_all_at_static_capacity(bug: str | None = None) -> Iterator[None]:
    """While the block runs, HF's `AllToAllEP` calls run at static capacity (module doc); with
    `bug` "ep_counts_unexchanged", without the count exchange; "ep_combine_forward_order", with
    the twin's combine."""
    import transformers.distributed.expert_parallel as hf_ep

    from refine.exporters.capture.functional import all_to_all_single_in_place
    from refine.exporters.capture.ragged import static_splits

    hf_dispatch, hf_combine = hf_ep.AllToAllEP._dispatch_tokens, hf_ep.AllToAllEP._combine_tokens

    # (the two exchanges only: the experts' own forward, which runs between them, keeps torch's ops)
    def dispatch(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        bound = math.ceil(hidden_states.shape[0] / self.tp_mesh.size()) * top_k_index.shape[-1]
        with static_splits(bound, hf_ep):
            return hf_dispatch(self, hidden_states, top_k_index, top_k_weights)

    combined = _combine_at_forward_order if bug == "ep_combine_forward_order" else hf_combine

    def combine(self: Any, expert_output: torch.Tensor, state: Any) -> Any:
        with static_splits(max(state.send_sizes, default=0), hf_ep):
            return combined(self, expert_output, state)

    saved = hf_ep.all_to_all_single
    hf_ep.AllToAllEP._dispatch_tokens, hf_ep.AllToAllEP._combine_tokens = dispatch, combine  # type: ignore[method-assign]
    hf_ep.all_to_all_single = _unexchanged if bug == "ep_counts_unexchanged" else all_to_all_single_in_place
    try:
        yield
    finally:
        hf_ep.AllToAllEP._dispatch_tokens, hf_ep.AllToAllEP._combine_tokens = hf_dispatch, hf_combine  # type: ignore[method-assign]
        hf_ep.all_to_all_single = saved
