"""Pipeline-parallel (PP) training steps of zoo models: GPipe or 1F1B order, backward per micro-batch.

The stages are exporters/strategies/pipeline.py's (stage s of P holds a balanced contiguous split of the
layers; the first also embeds, the last applies the final norm and the LM head; GPT-2's tied
embedding is held by the first and the last stage). One training step, GPipe order:

- forward: for each of the M micro-batches (batch chunks), stage 0 embeds it, every stage runs
  its blocks on what it got and sends the activations on (`dist.Send` / `dist.Recv`); the last
  stage applies the head and computes the micro-batch's loss share: its tokens' summed
  cross-entropy over the number of counted tokens of the WHOLE batch (labels equal to
  IGNORE_INDEX do not count; the last stage holds every label), so the M shares add up to the
  sequential step's loss (mean over the batch's counted tokens), whatever tokens are ignored;
- backward: for each micro-batch in the same order, the last stage differentiates its loss share
  through its layers and sends the gradient of its input (what it received) to the previous
  stage, which receives it and backpropagates it through its own layers, and so on to stage 0;
  every stage adds up its parameter gradients over the micro-batches;
- the tied embedding (GPT-2's wte = lm_head): stage 0 holds the gradient through the embedding
  lookup, the last stage the gradient through the LM head; both all-reduce it with sum over the
  embedding group {first stage, last stage} (Megatron's embedding group), so each holds the whole
  gradient of the one sequential parameter.

Outputs: `loss` on the last stage, `grad.<fqn>` for each parameter a stage holds (refine.json:
a replica on the stages that hold it), and the values each stage sends (`sent.K` forward,
`sent_grad.K` backward; outputs so that the sends stay in the program, exporters/capture/collectives.py)
and the gradients it receives (`received_grad.K`: so that a receive stays in the program, as the
real job posts it, even where a bug leaves its value unused).

How it is traced: exporters/capture/train.py's make_fx over eager autograd (trace_step), the stage
running its own step (its `training_step` hook). The point-to-point custom ops have no
autograd, so a stage's backward is written per segment: one `torch.autograd.grad` per
micro-batch over the stage's layers (from its loss share on the last stage, else from the
received output gradient), with the Send / Recv between segments placed by hand.

Bug twins (exporters/strategies/pipeline.py PIPELINE_BUGS with `train`, docs/bugs.md class 13):
`pp_tied_grad_not_reduced` (the embedding group's all-reduce left out), `pp_grad_not_accumulated`
(only the last micro-batch's parameter gradients kept), `pp_loss_not_scaled` (each micro-batch's
loss the mean over its own tokens: the sum over micro-batches M times the sequential mean),
`pp_1f1b_send_first` (1F1B's steady state sending before receiving: a deadlock).

Schedules (`schedule`): GPipe (above), or 1F1B (`order="1f1b"`, `--schedule 1f1b`): each stage
runs a few forwards ahead, then alternates one forward and one backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine.exporters.capture.collectives import recv, send
from refine.exporters.strategies.data_parallel import IGNORE_INDEX, example_labels
from refine.exporters.errors import ExportError
from refine.exporters.strategies.pipeline import GPT2Stage, LlamaStage, PipelineBug, pipeline_bug, stage_layers, validate_pipeline
from refine.exporters.capture.train import LOSS, grad_name, module_stack, traced_grad

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult



class PipelineTrainStep:
    """A stage's training step, mixed into its stage class (exporters/strategies/pipeline.py GPT2Stage or
    LlamaStage, so that parameters keep their sequential FQNs). exporters/capture/train.py's trace_step
    runs `training_step` in place of its own loss-and-gradients step; `forward(x, part)` runs
    one part of the stage (embed, blocks, head) under the traced parameters."""

    bug: PipelineBug | None = None
    embedding_group: Any = None  # the process group {first stage, last stage} (None: no tied parameter here)
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
        return total / (all_labels.flatten() != IGNORE_INDEX).sum()

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
                seeds = [self._receive_grad(end)]
                received_grads.append(seeds[0])
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
        head = [loss] if self.last else [*(sent for _, _, sent in forward), *received_grads]  # type: ignore[attr-defined]
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
                buffer = torch.zeros(size, seq_len, self.hidden, dtype=self.act_dtype,  # type: ignore[attr-defined]
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


def _keep_frames(*functions: Callable[..., Any]) -> None:
    """Keep `functions`' frames in the traced nodes' stack traces: make_fx keeps only frames of
    functions named `forward` (and registered anchors), and a stage's step runs its sends,
    receives, loss shares and gradient sums in functions of other names; without their frames a
    node of the step would name no source line (or the dispatching `forward`'s)."""
    from torch.fx import proxy

    for fn in functions:
        proxy._register_stack_trace_anchor(fn)


_keep_frames(*(getattr(PipelineTrainStep, name) for name in ("_forward_micro_batch", "_loss_share", "_add_loss",
                                                               "_receive_grad", "_send_grad", "_send_on", "_accumulate",
                                                               "_reduce_tied")),
             GPT2Stage.embed, GPT2Stage.run_blocks, GPT2Stage.head, LlamaStage.embed, LlamaStage.run_blocks,
             LlamaStage.head)


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
def _step_class(stage_class: type[nn.Module]) -> type[nn.Module]:
    return type(f"PipelineTrain{stage_class.__name__}", (PipelineTrainStep, stage_class), {})


def tied_parameters(model: nn.Module) -> set[str]:
    """The parameters of `model` under more than one name (a tied embedding and LM head), each by
    its first name (named_parameters'); a pipeline holds them on its first and last stage."""
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    return {aliases[0] for aliases in names.values() if len(aliases) > 1}


def embedding_group(stages: int) -> Any:
    """The process group of the first and the last stage (the ranks holding the tied embedding):
    the world with two stages."""
    return dist.group.WORLD if stages == 2 else dist.new_group([0, stages - 1])


def stage_train_module(model: str, config: str, seed: int, stage: int, stages: int, micro_batches: int, *,
                       layers: int | None = None, bug: PipelineBug | None = None, order: str = "gpipe") -> nn.Module:
    """Stage `stage`'s training step (module doc) of the zoo model built from `seed`."""
    from refine.exporters.zoo import models as zoo

    full = zoo.build(model, config, seed, layers=layers)
    stage_class = GPT2Stage if model == "gpt2" else LlamaStage
    module = stage_class(full, stage, stages, micro_batches, bug)
    group = embedding_group(stages)  # (every rank makes the group, as torch.distributed requires)
    module.__class__ = _step_class(stage_class)
    module.bug = bug  # type: ignore[assignment]
    module.schedule = order  # type: ignore[assignment]
    module.tied = tuple(fqn for fqn in dict(module.named_parameters()) if fqn in tied_parameters(full))  # type: ignore[assignment]
    module.embedding_group = group if module.tied else None  # type: ignore[assignment]
    return module.eval()


def export_pipeline_train(
    model: str,
    config: str,
    pp: int,
    micro_batches: int,
    out: Path | str,
    seed: int = 0,
    *,
    layers: int | None = None,
    bug: str | None = None,
    workers: int | None = None,
    order: str = "gpipe",
) -> ExportResult:
    """Export one training step of a zoo model as `pp` pipeline stages running `micro_batches`
    micro-batches in `order` (`schedule`: gpipe or 1f1b) to the model directory `out`, with the
    pipeline training bug `bug` injected into the stages if given. Every layer is inline."""
    from refine.exporters.zoo import models as zoo
    from refine.exporters.capture.export import bug_words, export

    if order not in SCHEDULES:
        raise ExportError(f"unknown pipeline schedule {order!r}: one of {', '.join(SCHEDULES)}")
    if bug == "pp_1f1b_send_first" and order != "1f1b":
        raise ExportError("pipeline bug 'pp_1f1b_send_first' is a 1F1B bug: pass --schedule 1f1b")
    cfg = validate_pipeline(model, config, pp, micro_batches, layers=layers, bug=bug, train=True)
    injected = pipeline_bug(bug, micro_batches, train=True) if bug is not None else None
    depth = f", {cfg.layers} layers" if layers is not None else ""
    split = ", ".join(f"{r.start}..{r.stop - 1}" for r in stage_layers(cfg.layers, pp))
    input_ids, labels = zoo.example_inputs(model, config, seed, labels=True)
    labels = example_labels(labels, micro_batches)  # some tokens ignored, unevenly between micro-batches
    return export(
        zoo.build(model, config, seed, layers=layers),
        functools.partial(stage_train_module, model, config, seed, stages=pp, micro_batches=micro_batches,
                          layers=layers, bug=injected, order=order),  # rank -> its stage
        (input_ids, labels),
        pp,
        out,
        # labels may take the ignore index, so that counterexamples meet micro-batches that count differently
        input_layouts={"labels": {"layout": "rep", "range": [0, cfg.vocab], "also": [IGNORE_INDEX]}},
        input_ranges={"input_ids": cfg.vocab, "labels": cfg.vocab},
        description=f"{model} config {config!r}{depth}, PP over {pp} stages (layers {split}), {micro_batches} "
        f"micro-batch{'es' if micro_batches > 1 else ''} in {'GPipe' if order == 'gpipe' else '1F1B'} order, one training step (loss normalised by the "
        "batch's token count, gradients accumulated over the micro-batches"
        + (", the tied embedding's all-reduced over the first and last stage" if model == "gpt2" else "")
        + "), exported by `refine export`" + (bug_words(injected) if injected is not None else ""),
        zoo={"model": model, "config": config, "pp": pp, "micro_batches": micro_batches, "seed": seed,
             "layers": layers, "meta": False, "flat": True, "bug": bug, "train": True,
             **({"schedule": order} if order != "gpipe" else {})},
        layers=None,
        workers=workers,
        train=True,
    )
