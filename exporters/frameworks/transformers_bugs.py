"""HF transformers' twins: the bug catalogue of `refine export --framework transformers --bug NAME`.

Pure Python (no torch), so that a bad name is rejected before anything heavy is imported. Each
twin is one of HF's own parallel styles with one line changed, put in its place while the ranks
are captured (exporters/frameworks/transformers.py `hf_twin`), so that a report names the twin's
changed line.

HF's expert parallelism, `AllReduceEP.__call__` (transformers/distributed/expert_parallel.py;
`--ep N`):

- `ep_global_ids` (class 12, forward): the experts handed the router's global expert ids where
  their local ids belong (`local_index = top_k_index`): the experts' forward clamps every id into
  the rank's rows, so a route to expert r*e + j runs through local expert min(r*e + j, e - 1).
- `ep_output_mean` (class 14, forward): the partial outputs averaged over the group
  (`expert_output / ep_size` before the sum), as a data-parallel average would: every output is
  1/EP of the sequential one.
- `ep_router_grad_unreduced` (class 4, training step): the routing weights enter without
  `_AllReduceBackward`: each rank's gradient of the routing weights, and of the router's gate
  weight, covers the routes to its own experts only.
- `ep_input_grad_unreduced` (class 1, training step): the hidden states enter without
  `_AllReduceBackward`: each rank's gradient of the experts' input is its own experts' share.
- `ep_shared_before_reduce` (class 3, forward, Qwen2-MoE): the shared expert's output (each rank
  computes it whole) added to the rank's partial output before the all-reduce, not after: the
  sum holds it EP times. Also HF's `Qwen2MoeSparseMoeBlock.forward` with the all-reduce moved
  after its add.

HF's token-moving expert parallelism, `AllToAllEP` (`--ep N --ep-implementation all_to_all`,
exporters/frameworks/transformers_all_to_all.py):
- `ep_counts_unexchanged` (class 12, forward): the count exchange skipped, each rank taking the
  per-expert counts it sends for those it receives: its split sizes disagree with its peers'
  (the simulator's count check) and its received rows get the wrong local expert ids.
- `ep_combine_forward_order` (class 12, forward): `_combine_tokens` gathers the rows brought back
  at the sort's order (`recv_out[order]`) where it scatters them by it (`out[order] = recv_out`):
  each route gets another route's expert output.

HF's TP styles (transformers/distributed/tensor_parallel.py):
- `mla_rope_grad_unreduced` (class 1, training step, MLA models such as GLM-4-MoE-Lite):
  `MlaKvAProjParallel` without the `_AllReduceBackward` it puts on the rope part of
  kv_a_proj_with_mqa's output. That part bypasses the column-parallel kv_b_proj, so each rank's
  gradient of it covers its own heads only, and so does the gradient of the projection's weight
  and of everything before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from refine.exporters.errors import ExportError


@dataclass(frozen=True)
class TransformersBug:
    """A twin of one of HF's parallel styles: its name, what goes wrong, its class in
    docs/bugs.md, and whether it shows in a training step only."""

    name: str
    title: str
    bug_class: int
    train: bool = False
    model_types: tuple[str, ...] = ()  # the model types whose code it edits (none: every type with an EP plan)
    ep: bool = True  # a twin of HF's expert parallelism (needs --ep), else of a TP style
    implementation: str = "all_reduce"  # the expert-parallel dispatch whose code it edits (--ep-implementation)


BUGS: dict[str, TransformersBug] = {b.name: b for b in (
    TransformersBug("ep_global_ids", "AllReduceEP hands its experts the router's global expert ids where their local "
                    "ids belong: every id is clamped into the rank's rows", 12),
    TransformersBug("ep_output_mean", "AllReduceEP divides its partial outputs by the group size before the "
                    "all-reduce sums them: the experts' output is 1/EP of the sequential one", 14),
    TransformersBug("ep_router_grad_unreduced", "AllReduceEP takes the routing weights without _AllReduceBackward: "
                    "each rank's gradient of the routing weights covers its own experts' routes only", 4, train=True),
    TransformersBug("ep_input_grad_unreduced", "AllReduceEP takes the hidden states without _AllReduceBackward: each "
                    "rank's gradient of the experts' input covers its own experts' routes only", 1, train=True),
    TransformersBug("ep_shared_before_reduce", "the shared expert's output added to each rank's partial experts' "
                    "output before the all-reduce: the sum holds it EP times", 3, model_types=("qwen2_moe",)),
    TransformersBug("mla_rope_grad_unreduced", "HF's mla_kv_a_proj style without its _AllReduceBackward on the rope "
                    "part: each rank's gradient of it covers its own heads only", 1, train=True,
                    model_types=("glm4_moe_lite",), ep=False),
    TransformersBug("ep_counts_unexchanged", "AllToAllEP skips the count exchange: each rank takes the per-expert "
                    "counts it sends for those it receives, so its split sizes disagree with its peers'", 12,
                    implementation="all_to_all"),
    TransformersBug("ep_combine_forward_order", "AllToAllEP's combine gathers the rows brought back at the sort's "
                    "order where it scatters them by it: each route gets another route's expert output", 12,
                    implementation="all_to_all"),
)}


def transformers_bug(name: str, *, ep: int | None, train: bool, model_type: str | None = None,
                     ep_implementation: str = "all_reduce") -> TransformersBug:
    """The bug `name`, if it applies to this export; an ExportError saying why not otherwise."""
    if name not in BUGS:
        raise ExportError(f"unknown transformers bug {name!r} (known: {', '.join(BUGS)})")
    bug = BUGS[name]
    if bug.model_types and model_type not in bug.model_types:
        raise ExportError(f"transformers bug {name!r} edits {'/'.join(bug.model_types)}'s code: pass --model-type "
                          f"{bug.model_types[0]}")
    if bug.ep and ep is None:
        raise ExportError(f"transformers bug {name!r} is in HF's expert parallelism: pass --ep N (= --tp)")
    if bug.ep and bug.implementation != ep_implementation:
        raise ExportError(f"transformers bug {name!r} edits HF's {bug.implementation} dispatch: pass "
                          f"--ep-implementation {bug.implementation}")
    if bug.train and not train:
        raise ExportError(f"transformers bug {name!r} shows in the backward only: pass --train")
    return bug
