"""Pipeline-parallel (PP) export of zoo models, forward only: one stage per rank, GPipe order
(the training step of these stages: exporters/strategies/pipeline_train.py).

Rank s of P holds the blocks [lo_s, hi_s) of a balanced contiguous split of the layers; the
first stage also embeds, the last applies the final norm and the LM head. The batch is cut
into M micro-batches along the batch axis, unrolled in GPipe order: stage 0 embeds micro-batch
k, runs its blocks and sends the activations to stage 1; every later stage receives them (a
zero buffer of the micro-batch's activation shape), runs its blocks and sends on; the last
stage concatenates the M micro-batches' logits along the batch axis into `logits`.

Models: the zoo's MegatronGPT2 (`GPT2Stage`) and the HF Llama-style models llama and qwen2
(`LlamaStage`, run as HF's LlamaModel.forward runs its layers). With more than one
micro-batch, a Llama-style stage builds the causal mask of its micro-batch (batch B/M): a
constant whose slices along the batch are the sequential mask's (refine relates the two as
`bc`, rules/core.lp), so these verify as GPT-2 does with any M.

What the programs share with the sequential model:
- parameters keep their sequential FQNs (the layers are a ModuleList at their sequential indices,
  the earlier stages' layers parameterless placeholders, so a stage's blocks are `h.3.attn...` /
  `model.layers.3...`; GPT-2's first and last stage both
  hold the tied embedding under both its names, `wte` and `lm_head`, so that torch.export names
  it as in seq.onnx); a parameter lives on the stages that use it, and refine.json declares it
  a replica (refine skips the ranks that lack it);
- every stage takes `input_ids` (only stage 0 reads it), so all programs have the sequential
  model's inputs;
- only the last stage returns `logits` (declared `rep`: a replica on that stage); the other
  stages return what they send, which keeps the sends in the program (exporters/capture/collectives.py).

Point-to-point calls are `refine.exporters.capture.collectives.send` / `recv` (custom ops translated to
`dist.Send` / `dist.Recv`), all on tag 0: the k-th send of stage s meets the k-th receive of
stage s + 1. Bug twins (`PIPELINE_BUGS`, docs/bugs.md class 13) are injected into the stages
only; the sequential model and refine.json stay those of the correct export.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from refine.exporters.capture.collectives import recv, send
from refine.exporters.zoo.configs import ZooConfig, validate
from refine.exporters.errors import ExportError, PlanBug, named_bug

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

PP_MODELS = ("gpt2", "llama", "qwen2")  # the zoo models with a stage module


@dataclass(frozen=True)
class PipelineBug(PlanBug):
    """One injected pipeline mistake (docs/bugs.md class 13)."""

    bug_class: ClassVar[int] = 13
    min_micro_batches: int = 1
    min_tp: int = 1  # a bug of a PP x TP export (exporters/strategies/pipeline_mesh.py) needs TP ranks
    train: bool = False  # a bug of the pipeline training step (exporters/strategies/pipeline_train.py)


PIPELINE_BUGS: dict[str, PipelineBug] = {
    b.name: b for b in (
        PipelineBug("pp_micro_batch_order", "stage 0 sends micro-batch 1 before micro-batch 0, while the next "
                    "stage treats the arrivals in order", min_micro_batches=2),
        PipelineBug("pp_layer_twice", "the last layer of stage 0 is run again at the start of stage 1"),
        PipelineBug("pp_wrong_tp_peer", "each TP rank of stage 0 sends its activations to the next TP position of "
                    "stage 1 (t+1 mod T), which receives from its own position t", min_tp=2),
        PipelineBug("pp_tied_grad_not_reduced", "the tied embedding's gradient is not all-reduced over the embedding "
                    "group (first and last stage): each keeps its own part, the embedding's or the LM head's",
                    train=True),
        PipelineBug("pp_grad_not_accumulated", "each stage keeps only the last micro-batch's parameter gradients "
                    "(assigned, not accumulated over the micro-batches)", min_micro_batches=2, train=True),
        PipelineBug("pp_loss_not_scaled", "each micro-batch's loss is the mean over its own tokens, not divided by "
                    "the number of micro-batches (the loss and gradients M times too large)", min_micro_batches=2,
                    train=True),
        PipelineBug("pp_1f1b_send_first", "1F1B with blocking sends: in the steady state each stage sends its "
                    "forward's activations on before it receives the gradient of its backward, so neighbouring "
                    "stages both wait in a send (needs the 1f1b schedule)", min_micro_batches=2, train=True),
    )
}


def pipeline_bug(name: str, micro_batches: int, tp: int = 1, train: bool = False) -> PipelineBug:
    """The bug named `name` if it applies with `micro_batches` and `tp` to the forward (or, with
    `train`, the training step); an ExportError otherwise."""
    bug = named_bug(PIPELINE_BUGS, name, "pipeline")
    if bug.train != train:
        raise ExportError(f"pipeline bug {name!r} is " + ("in the training step: pass --train" if bug.train
                                                          else "a forward bug: drop --train"))
    if micro_batches < bug.min_micro_batches:
        raise ExportError(f"pipeline bug {name!r} needs --micro-batches {bug.min_micro_batches} or more")
    if tp < bug.min_tp:
        raise ExportError(f"pipeline bug {name!r} is a PP x TP bug: it needs --tp {bug.min_tp} or more")
    return bug


def validate_pipeline(model: str, config: str, pp: int, micro_batches: int, *, layers: int | None = None,
                      meta: bool = False, bug: str | None = None, batch: int | None = None, tp: int = 1,
                      train: bool = False) -> ZooConfig:
    """The config (with `batch` rows if given), if `pp` stages and `micro_batches` split it (and
    `bug` applies with `tp` TP ranks per stage); an ExportError naming the clash otherwise."""
    cfg = validate(model, config, 1, False, layers=layers, meta=meta)  # sizes; TP 1 splits anything
    if batch is not None:
        if batch < 1:
            raise ExportError(f"--batch must be at least 1, got {batch}")
        cfg = replace(cfg, batch=batch)
    if model not in PP_MODELS:
        raise ExportError(f"--pp exports {', '.join(PP_MODELS)} only, not {model}")
    if pp < 2:
        raise ExportError(f"--pp must be at least 2 (pipeline stages), got {pp}")
    if pp > cfg.layers:
        raise ExportError(f"--pp {pp} is more stages than {model} config {config!r} has layers ({cfg.layers}); "
                          "pass --layers to deepen it")
    if micro_batches < 1:
        raise ExportError(f"--micro-batches must be at least 1, got {micro_batches}")
    if cfg.batch % micro_batches:
        raise ExportError(f"--micro-batches {micro_batches} does not divide the batch {cfg.batch}"
                          + (f" of config {config!r}" if batch is None else ""))
    if train and meta:
        raise ExportError("--pp --train exports a training step with weights: drop --meta")
    if bug is not None:
        pipeline_bug(bug, micro_batches, tp, train)
    return cfg


def stage_layers(layers: int, stages: int) -> list[range]:
    """The layers of each stage: a balanced contiguous split (where the layers do not split
    evenly, the later stages hold one more)."""
    return [range(s * layers // stages, (s + 1) * layers // stages) for s in range(stages)]


def stage_outputs(rank: int, stages: int, micro_batches: int) -> list[str]:
    """Stage `rank`'s output names: `logits` on the last stage, its sends (`sent.K`) on the others."""
    return ["logits"] if rank == stages - 1 else [f"sent.{k}" for k in range(micro_batches)]


class Stage(nn.Module):
    """Stage `stage` of `stages`: the GPipe loop over `micro_batches` micro-batches, the sends and
    receives between stages. A model's stage class registers its modules under their sequential
    names and says how to embed, run its blocks on one micro-batch and apply the head."""

    def __init__(self, stage: int, stages: int, micro_batches: int, layers: int, hidden: int, dtype: torch.dtype,
                 bug: PipelineBug | None, tp: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.stage, self.stages, self.micro_batches = stage, stages, micro_batches
        self.tp, self.tp_rank = tp, tp_rank  # a pp x tp mesh: stage s's TP rank t is global rank s*tp + t
        self.first, self.last = stage == 0, stage == stages - 1
        self.hidden, self.act_dtype = hidden, dtype  # what a stage receives: [micro-batch, tokens, hidden]
        self.blocks = self.blocks_of(stage, stages, layers, bug)
        schedule = list(range(micro_batches))
        if bug is not None and bug.name == "pp_micro_batch_order" and self.first:
            schedule[:2] = [1, 0]  # the bug: micro-batch 1 goes first, the next stage takes arrivals in order
        self.schedule = schedule
        # the bug: stage 0's TP rank t sends to TP position t+1 of stage 1, which receives from t
        self.send_shift = 1 if bug is not None and bug.name == "pp_wrong_tp_peer" and self.first else 0

    @staticmethod
    def blocks_of(stage: int, stages: int, layers: int, bug: PipelineBug | None) -> list[int]:
        """The layers stage `stage` runs, in order."""
        blocks = list(stage_layers(layers, stages)[stage])
        if bug is not None and bug.name == "pp_layer_twice" and stage == 1:
            blocks.insert(0, blocks[0] - 1)  # the bug: stage 0's last layer again
        return blocks

    def peer(self, stage: int) -> int:
        """The global rank of `stage`'s rank at this rank's TP position (the same TP position of
        consecutive stages pass activations to each other)."""
        shift = self.send_shift if stage > self.stage else 0
        return stage * self.tp + (self.tp_rank + shift) % self.tp

    def stack(self, layers: list[nn.Module]) -> nn.ModuleList:
        """This stage's layers in a ModuleList at their sequential indices (so that they keep their
        sequential names, `h.3`, and refine.exporters.capture.layers can make functions of them): the layers of the
        earlier stages are parameterless placeholders, the later ones are left out."""
        return nn.ModuleList([layers[i] if i in self.blocks else nn.Identity() for i in range(max(self.blocks) + 1)])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """This stage's blocks (`self.blocks`, in order) on one micro-batch's activations."""
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        batch, seq_len = input_ids.shape
        size = batch // self.micro_batches
        sent, logits = [], []
        for k in self.schedule:
            if self.first:
                x = self.embed(input_ids[k * size:(k + 1) * size])
            else:
                buffer = torch.zeros(size, seq_len, self.hidden, dtype=self.act_dtype, device=input_ids.device)
                x = recv(buffer, self.peer(self.stage - 1))
            x = self.run_blocks(x)
            if self.last:
                logits.append(self.head(x))
            else:
                sent.append(send(x, self.peer(self.stage + 1)))
        if not self.last:
            return tuple(sent)
        return torch.cat(logits, dim=0) if len(logits) > 1 else logits[0]


class GPT2Stage(Stage):
    """A stage of the zoo's MegatronGPT2 (wte + wpe, blocks `h`, ln_f, the LM head tied to wte)."""

    def __init__(self, full: nn.Module, stage: int, stages: int, micro_batches: int,
                 bug: PipelineBug | None = None, tp: int = 1, tp_rank: int = 0) -> None:
        super().__init__(stage, stages, micro_batches, len(full.h), full.wte.weight.shape[1], full.wte.weight.dtype, bug,
                         tp, tp_rank)
        # registered in the sequential order: wte, wpe, h, ln_f, lm_head. torch.export names a tied
        # parameter by its last alias (`lm_head.weight` in seq.onnx), so both stages holding the
        # tied weight register both aliases, each running one: wte on the first, lm_head on the last
        tied = self.first or self.last
        if tied:
            self.wte = full.wte
        if self.first:
            self.wpe = full.wpe
        self.h = self.stack(list(full.h))
        if self.last:
            self.ln_f = full.ln_f
        if tied:
            self.lm_head = full.lm_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.wte(ids) + self.wpe(pos)

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.blocks:
            x = self.h[i](x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class LlamaStage(Stage):
    """A stage of an HF Llama-style causal LM (`model.embed_tokens`, `model.layers`, `model.norm`,
    `model.rotary_emb`, `lm_head`), run the way HF's LlamaModel.forward runs its layers; every
    stage holds the rotary embedding and builds the causal mask of its micro-batch itself."""

    def __init__(self, full: nn.Module, stage: int, stages: int, micro_batches: int,
                 bug: PipelineBug | None = None, tp: int = 1, tp_rank: int = 0) -> None:
        inner = full.model
        super().__init__(stage, stages, micro_batches, len(inner.layers), inner.embed_tokens.weight.shape[1],
                         inner.embed_tokens.weight.dtype, bug, tp, tp_rank)
        self.config = full.config
        self.model = nn.Module()  # the sequential `model.` prefix, in its order
        if self.first:
            self.model.embed_tokens = inner.embed_tokens
        self.model.layers = self.stack(list(inner.layers))
        if self.last:
            self.model.norm = inner.norm
        self.model.rotary_emb = inner.rotary_emb
        if self.last:
            self.lm_head = full.lm_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=position_ids)
        embeddings = self.model.rotary_emb(x, position_ids=position_ids)
        for i in self.blocks:
            x = self.model.layers[i](x, attention_mask=mask, position_embeddings=embeddings,
                                          position_ids=position_ids)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x))


def stage_module(model: str, config: str, seed: int, stage: int, stages: int, micro_batches: int, *,
                 layers: int | None = None, meta: bool = False, bug: PipelineBug | None = None) -> nn.Module:
    """Stage `stage` of the zoo model built from `seed` (the same weights as the sequential one)."""
    from refine.exporters.zoo import models as zoo

    full = zoo.build(model, config, seed, layers=layers, meta=meta)
    stage_class = GPT2Stage if model == "gpt2" else LlamaStage
    return stage_class(full, stage, stages, micro_batches, bug).eval()


def stage_tp_module(model: str, config: str, seed: int, stage: int, stages: int, micro_batches: int, tp: int,
                    tp_rank: int, *, layers: int | None = None, meta: bool = False,
                    bug: PipelineBug | None = None) -> nn.Module:
    """TP rank `tp_rank` of stage `stage` (a pp x tp mesh, exporters/strategies/pipeline_mesh.py): the zoo model
    built from `seed`, its stage's blocks parallelized by the zoo's TP plan (exporters/zoo/plans.py,
    DTensor, `src_data_rank=None` as refine.exporters.zoo.tensor_parallel.zoo_rank_factory) on a 1-D device mesh of the
    `tp` ranks of the running (fake) process group, then cut to the stage; its sends and receives
    go to the same TP position of the neighbouring stages. Call it inside a process group of `tp`
    ranks in which this process is `tp_rank`: exporters/strategies/pipeline_mesh.py moves the collectives'
    groups to the stage's own TP group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from refine.exporters.zoo import plans, models as zoo

    full = zoo.build(model, config, seed, layers=layers, meta=meta)
    stage_class = GPT2Stage if model == "gpt2" else LlamaStage
    prefix = plans.layer_stack(model)
    blocks = set(Stage.blocks_of(stage, stages, len(full.get_submodule(prefix)), bug))
    plan = {key: style for key, style in plans.make_plan(model, full, False).items()
            if not key.startswith(prefix + ".") or int(key[len(prefix) + 1:].split(".")[0]) in blocks}  # its blocks'
    parallelize_module(full, init_device_mesh("cpu", (tp,)), plan, src_data_rank=None)
    return stage_class(full, stage, stages, micro_batches, bug, tp, tp_rank).eval()


def export_pipeline(
    model: str,
    config: str,
    pp: int,
    micro_batches: int,
    out: Path | str,
    seed: int = 0,
    *,
    layers: int | None = None,
    meta: bool = False,
    bug: str | None = None,
    workers: int | None = None,
) -> ExportResult:
    """Export a zoo model as `pp` pipeline stages running `micro_batches` micro-batches in GPipe
    order (module doc) to the model directory `out`, with the pipeline bug `bug` injected into
    the stages if given. Every layer is inline (exporters/strategies/pipeline_mesh.py, the stages with tensor
    parallelism inside, exports layers as functions)."""
    from refine.exporters.zoo import models as zoo
    from refine.exporters.capture.export import bug_words, export
    from refine.exporters.capture.layouts import REP

    cfg = validate_pipeline(model, config, pp, micro_batches, layers=layers, meta=meta, bug=bug)
    injected = pipeline_bug(bug, micro_batches) if bug is not None else None
    depth = f", {cfg.layers} layers" if layers is not None else ""
    split = ", ".join(f"{r.start}..{r.stop - 1}" for r in stage_layers(cfg.layers, pp))
    return export(
        zoo.build(model, config, seed, layers=layers, meta=meta),
        functools.partial(stage_module, model, config, seed, stages=pp, micro_batches=micro_batches, layers=layers,
                          meta=meta, bug=injected),  # rank -> its stage
        zoo.example_inputs(model, config, seed, meta=meta),
        pp,
        out,
        output_names=["logits"],
        output_layouts={"logits": dict(REP)},
        rank_output_names=functools.partial(stage_outputs, stages=pp, micro_batches=micro_batches),
        input_ranges={"input_ids": cfg.vocab},
        description=f"{model} config {config!r}{depth}, PP over {pp} stages (layers {split}), {micro_batches} "
        f"micro-batch{'es' if micro_batches > 1 else ''} in GPipe order, forward, exported by `refine export`"
        + (" (meta: no weight data)" if meta else "") + (bug_words(injected) if injected is not None else ""),
        # no "tp": refine/diagnose/reduced.py re-exports TP recipes only
        zoo={"model": model, "config": config, "pp": pp, "micro_batches": micro_batches, "seed": seed,
             "layers": layers, "meta": meta, "flat": True, "bug": bug, "train": False},
        layers=None,
        workers=workers,
    )
