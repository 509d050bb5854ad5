"""A pipeline stage's training step, written out: the micro-batch cut, the forwards with their
sends and receives, one backward segment per micro-batch (`torch.autograd.grad` from the loss
share on the last stage, else from the received output gradient), the gradient sums over the
micro-batches and the tied embedding's all-reduce, in GPipe or 1F1B order.

The point-to-point custom ops (exporters/capture/collectives.py) have no autograd, so a stage's
backward is written per segment, with the Send / Recv between segments placed by hand; the
stage classes that mix `PipelineTrainStep` in say how to embed, run their blocks and apply the
head (refine's own stages, exporters/strategies/pipeline_train.py; torchtitan's model chunks,
exporters/frameworks/torchtitan_pipeline.py). exporters/capture/train.py's trace_step runs
`training_step` in place of its own loss-and-gradients step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from refine.exporters.capture.collectives import recv, send
from refine.exporters.capture.train import IGNORE_INDEX, LOSS, grad_name, module_stack, traced_grad

PipelineBug = Any  # a strategy's bug twin (exporters/strategies/pipeline.py PipelineBug): its `name` is read


class PipelineTrainStep:
    """A stage's training step, mixed into its stage class (exporters/strategies/pipeline.py GPT2Stage or
    LlamaStage, so that parameters keep their sequential FQNs). exporters/capture/train.py's trace_step
    runs `training_step` in place of its own loss-and-gradients step; `forward(x, part)` runs
    one part of the stage (embed, blocks, head) under the traced parameters."""

    bug: PipelineBug | None = None
    seq_parts: int = 1  # the activations between stages hold 1/seq_parts of the sequence (sequence parallelism)
    embedding_group: Any = None  # the process group {first stage, last stage} (None: no tied parameter here)
    data_group: Any = None  # the ranks holding other batch rows or sequence slices of the same stage (None: none)
    tied: tuple[str, ...] = ()  # the tied parameters this stage holds (GPT-2's wte.weight, alias lm_head.weight)

    def forward(self, input_ids: torch.Tensor, part: str) -> torch.Tensor:
        """(The first argument is named as the model input the step takes: exporters/capture/train.py
        input_names; it is the part's input, token ids or activations.)"""
        return {"embed": self.embed, "blocks": self.run_blocks, "head": self.head}[part](input_ids)  # type: ignore[attr-defined]

    def step_output_names(self) -> list[str]:
        """`loss` (last stage) or the sends and receives to and from the next stage (`sent.K`,
        `received_grad.K`), the sends to the previous stage (`sent_grad.K`), then one gradient per
        parameter (named_parameters order)."""
        m = self.micro_batches  # type: ignore[attr-defined]
        names = [LOSS] if self.last else [f"sent.{k}" for k in range(m)] + [f"received_grad.{k}" for k in range(m)]  # type: ignore[attr-defined]
        if not self.first:  # type: ignore[attr-defined]
            names += [f"sent_grad.{k}" for k in range(m)]
        return names + [grad_name(fqn) for fqn, _ in self.named_parameters()]  # type: ignore[attr-defined]

    def _bug(self, name: str) -> bool:
        return self.bug is not None and self.bug.name == name

    def _loss_share(self, logits: torch.Tensor, labels: torch.Tensor, all_labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the step's loss: its tokens' summed cross-entropy over the
        counted tokens of the whole batch (module doc)."""
        flat_logits, flat_labels = logits.flatten(0, -2).float(), labels.flatten()
        if self._bug("pp_loss_not_scaled"):  # BUG: the micro-batch's own mean, not divided by M
            return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)
        total = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return total / self._counted_tokens(all_labels)

    def _counted_tokens(self, all_labels: torch.Tensor) -> torch.Tensor:
        """The counted tokens of the whole batch: this rank's, summed over the data group (the
        ranks of the other batch rows and sequence slices) where there is one."""
        count = (all_labels.flatten() != IGNORE_INDEX).sum()
        if self.data_group is None or self._bug("mesh_local_token_count"):  # BUG: this rank's own count
            return count
        return funcol.all_reduce(count, "sum", self.data_group)

    def _reduce_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The step's loss: the shares summed over the data group."""
        assert loss is not None
        if self.data_group is None:
            return loss
        return funcol.all_reduce(loss, "sum", self.data_group)

    def _reduce_data(self, value: torch.Tensor) -> torch.Tensor:
        """A loss share or gradient summed over the data group: each member's is the term of its
        own batch rows or sequence slice (identity without a data group)."""
        if self.data_group is None:
            return value
        op = "avg" if self._bug("mesh_grad_avg") else "sum"  # BUG (avg): the global normalisation twice
        return funcol.all_reduce(value, op, self.data_group)

    def training_step(self, call: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], labels: torch.Tensor,
                      leaves: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The stage's step (module doc); its outputs in `step_output_names` order. `call(x, part=...)`
        runs a part of the stage on the traced parameters `leaves` (FQN -> leaf).

        (The work is done by the methods below, whose frames the nodes' stack traces keep
        (`_keep_frames`); this one's frame is left out, so that a backward node keeps the line of
        the forward op it differentiates, as in exporters/capture/train.py.)"""
        (input_ids,) = inputs
        params = list(leaves.values())
        forward: list[list[Any]] = []  # per micro-batch: [its input as received, its end, the send's output]
        loss: torch.Tensor | None = None
        total: list[torch.Tensor | None] = [None] * len(params)
        sent_grads: list[torch.Tensor] = []
        received_grads: list[torch.Tensor] = []
        held: int | None = None  # a micro-batch whose activations wait to be sent (1F1B's steady state)
        for step, k in schedule(self.schedule, self.stage, self.stages, self.micro_batches):  # type: ignore[attr-defined]
            if step == "F":
                steady = (self.schedule == "1f1b" and not self.last and k >= self.stages - 1 - self.stage  # type: ignore[attr-defined]
                          and not self._bug("pp_1f1b_send_first"))  # BUG: sent on at once, before the receive
                forward.append(list(self._forward_micro_batch(call, input_ids, labels, k, send_on=not steady)))
                held = k if steady else None
                continue
            x_in, end, _ = forward[k]  # micro-batch k's backward
            if self.last:  # type: ignore[attr-defined]
                loss, seeds = self._add_loss(loss, end), None
            else:
                received = self._receive_grad(end)
                received_grads.append(received)
                seeds = [self._as_seed(received, end)]
            if held is not None:  # (received before sending on: both stages' steady states would wait on a send)
                forward[held][2] = self._send_on(forward[held][1])
                held = None
            grads = traced_grad([end], params + ([x_in] if x_in is not None else []), seeds)
            if x_in is not None:
                sent_grads.append(self._send_grad(grads[-1]))
            total = self._accumulate(total, list(grads[:len(params)]))
        out = {fqn: torch.zeros_like(p) if g is None else g for (fqn, p), g in zip(leaves.items(), total)}
        for fqn in self.tied:
            out[fqn] = self._reduce_tied(out[fqn])
        out = {fqn: self._reduce_data(g) for fqn, g in out.items()}
        head = [self._reduce_loss(loss)] if self.last else [*(sent for _, _, sent in forward), *received_grads]  # type: ignore[attr-defined]
        return [*head, *sent_grads, *out.values()]  # type: ignore[list-item]

    def _forward_micro_batch(self, call: Callable[..., torch.Tensor], input_ids: torch.Tensor, labels: torch.Tensor,
                             k: int, send_on: bool = True) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Micro-batch k's forward on this stage: (its input as received, None on the first stage;
        its loss share on the last stage, else the activations it sends on; the send's output,
        None where not `send_on`: sent later by `_send_on`)."""
        m, stage = self.micro_batches, self.stage  # type: ignore[attr-defined]
        size, seq_len = input_ids.shape[0] // m, input_ids.shape[1]
        with module_stack(self):  # type: ignore[arg-type]
            if self.first:  # type: ignore[attr-defined]
                x_in, x = None, call(input_ids[k * size:(k + 1) * size], part="embed")
            else:
                buffer = torch.zeros(size, seq_len // self.seq_parts, self.hidden, dtype=self.act_dtype,  # type: ignore[attr-defined]
                                     device=input_ids.device)
                x_in = x = recv(buffer, self.peer(stage - 1)).requires_grad_()  # type: ignore[attr-defined]
            x = call(x, part="blocks")
            if self.last:  # type: ignore[attr-defined]
                return x_in, self._loss_share(call(x, part="head"), labels[k * size:(k + 1) * size], labels), None
            return x_in, x, self._send_on(x) if send_on else None

    def _send_on(self, x: torch.Tensor) -> torch.Tensor:
        """A micro-batch's activations, to the next stage."""
        return send(x, self.peer(self.stage + 1))  # type: ignore[attr-defined]

    def _add_loss(self, loss: torch.Tensor | None, share: torch.Tensor) -> torch.Tensor:
        return share if loss is None else loss + share

    def _receive_grad(self, sent: torch.Tensor) -> torch.Tensor:
        """The gradient of what this stage sent on, from the next stage."""
        return recv(torch.zeros_like(sent), self.peer(self.stage + 1))  # type: ignore[attr-defined]

    def _as_seed(self, received: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """The received gradient as the backward's seed for `end` (a stage whose outputs are
        DTensors rebuilds one here)."""
        return received

    def _send_grad(self, grad: torch.Tensor | None) -> torch.Tensor:
        """The gradient of what this stage received, to the previous stage."""
        assert grad is not None
        return send(grad, self.peer(self.stage - 1))  # type: ignore[attr-defined]

    def _accumulate(self, total: list[torch.Tensor | None], grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The parameter gradients summed over the micro-batches so far."""
        if self._bug("pp_grad_not_accumulated"):  # BUG: the last micro-batch's gradients only
            return grads
        return [g if t is None else t if g is None else t + g for t, g in zip(total, grads)]

    def _reduce_tied(self, grad: torch.Tensor) -> torch.Tensor:
        """The tied embedding's gradient all-reduced over the embedding group: the first stage's
        lookup gradient plus the last stage's LM head gradient."""
        if self._bug("pp_tied_grad_not_reduced"):  # BUG: each stage keeps its own part
            return grad
        return funcol.all_reduce(grad, "sum", self.embedding_group)


def keep_step_frames(*functions: Callable[..., Any]) -> None:
    """Keep `functions`' frames in the traced nodes' stack traces: make_fx keeps only frames of
    functions named `forward` (and registered anchors), and a stage's step runs its sends,
    receives, loss shares and gradient sums in functions of other names; without their frames a
    node of the step would name no source line (or the dispatching `forward`'s)."""
    from torch.fx import proxy

    for fn in functions:
        proxy._register_stack_trace_anchor(fn)


keep_step_frames(*(getattr(PipelineTrainStep, name) for name in ("_forward_micro_batch", "_loss_share", "_add_loss",
                                                                   "_receive_grad", "_send_grad", "_send_on",
                                                                   "_accumulate", "_reduce_tied", "_counted_tokens",
                                                                   "_reduce_loss", "_reduce_data")))


SCHEDULES = ("gpipe", "1f1b")


def schedule(name: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order of stage `stage`'s forward ("F", k) and backward ("B", k) of the micro-batches.
    GPipe: every forward, then every backward. 1F1B (PipeDream-Flush, Megatron's default): the
    stage runs stages - 1 - stage forwards ahead (at most M), then alternates one forward and
    one backward, then the remaining backwards; at most that many micro-batches' activations
    are held. Both run each direction's sends and receives in micro-batch order. In 1F1B's
    steady state a stage receives the gradient of its backward before it sends the forward's
    activations on (Megatron posts the two together, send_forward_recv_backward): with blocking
    point-to-point calls, sending first deadlocks (each stage waits in a send to the other)."""
    if name == "gpipe":
        return [("F", k) for k in range(micro_batches)] + [("B", k) for k in range(micro_batches)]
    warm = min(stages - 1 - stage, micro_batches)
    order = [("F", k) for k in range(warm)]
    for i in range(micro_batches - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", k) for k in range(micro_batches - warm, micro_batches)]


@functools.cache
def step_class(stage_class: type, *parts: type) -> type:
    """`stage_class` running its training step: PipelineTrainStep mixed in (after the classes in
    `parts` that say how a framework's stage embeds, runs its blocks and applies its head), one
    class per combination so that every rank's module shares it."""
    return type(f"PipelineTrain{stage_class.__name__}", (*parts, PipelineTrainStep, stage_class), {})
