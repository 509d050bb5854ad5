"""Expert-parallel (EP) export of the zoo Mixtral, forward only: tokens dispatched to the ranks
holding their experts and combined back with all-to-all, in the dense dispatch formulation.

The sequential model is the zoo's Mixtral (exporters/zoo/moe.py) whose MoE blocks compute their
experts in grouped form, as Megatron's GroupedMLP does (`GroupedMoE`): the expert weights
stacked ([E, H, F] for w1 and w3, [E, F, H] for w2), every token expanded to every expert
([E, T, H]), batched matmuls, each expert's outputs weighted with its column of the dense
[T, E] routing matrix (zero for experts a token did not pick), summed over the experts. It
equals exporters/zoo/moe.py's DenseDispatchMoE, and so HF's block (tests/test_expert.py).

EP rank r of N (N divides the experts E and the batch): holds experts [r*E/N, (r+1)*E/N) (the
stacked weights' chunk r along axis 0, DTensor Shard(0): declared `shard` axis 0 in
refine.json) and the batch rows [r*B/N, (r+1)*B/N) (`input_ids` shard axis 0). Attention,
norms, embedding and head are replicated and run on the rank's own rows (data parallel). In
each MoE block the rank
  1. routes its own tokens (the replicated router: [T/N, E] routing weights);
  2. dispatches: its tokens expanded to every expert [E, T/N, H], torch's equal-split
     all_to_all_single (dist.AllToAll(0, 0): block k of the E/N experts to rank k), the
     received [N*E/N, T/N, H] regrouped to [E/N, T, H] (view [N, E/N, T/N, H], swap the first
     two axes, view [E/N, N*T/N, H]): its experts, every rank's tokens in rank order;
  3. runs its experts as batched matmuls on its weight chunk;
  4. weights each local expert's outputs with the routing weights of every token for that
     expert: the routing matrices all-gathered along the tokens ([T, E]), the columns of its
     experts' global ids r*E/N .. (r+1)*E/N - 1 taken (weighting on the experts' side, before
     the combine, as fused MoE kernels do: the step where a rank maps its local experts to
     global expert ids);
  5. combines: the weighted outputs regrouped by destination rank ([E/N, T, H] -> view
     [E/N, N, T/N, H], swap, view [N*E/N, T/N, H]) and all-to-all'ed back: [E, T/N, H], every
     expert's weighted outputs for its own tokens, expert order = group order;
  6. sums over the experts.
With `weigh="tokens"` (GShard's combine) step 4 is skipped and the rank weights the combined
[E, T/N, H] with its own tokens' routing matrix (transposed, [E, T/N, 1]) before step 6: the
received outputs come in group order, which is the experts' order because each rank holds a
contiguous block of them. rules/experts.lp holds the lemmas of steps 2 and 5 (an all-to-all
between the regrouping views) and of the router's TopK on a token slice.

Bug twins (BUGS.md class 12), injected into the ranks only:
- `ep_global_expert_ids`: a rank weights its local expert i with routing column i, the local
  id, where the global id r*E/N + i is expected (right on rank 0 only);
- `ep_combine_wrong_indices`: the combine sends the expert-major buffer without regrouping it
  by destination rank, so each rank gets back rows of other ranks' tokens and sums them as its
  own;
- `ep_combine_expert_order` (with `weigh="tokens"`, which it implies): the rank weights the
  combined outputs, which arrive in group order (rank-major: slot r*E/N + i is rank r's local
  expert i, global expert r*E/N + i), with its routing columns in the order of a round-robin
  placement (slot r*E/N + i taken as global expert i*N + r): group order vs expert order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from refine.exporters.zoo.configs import ZooConfig, check_plan, zoo_config
from refine.exporters.errors import ExportError, PlanBug, named_bug
from refine.exporters.zoo.moe import TOP_K, DenseDispatchMoE

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

EP_MODELS = ("mixtral",)
BATCH_AXIS = 0  # of input_ids [batch, seq] and of the logits [batch, seq, vocab]


@dataclass(frozen=True)
class ExpertBug(PlanBug):
    """One injected expert-parallel mistake (BUGS.md class 12)."""

    bug_class: ClassVar[int] = 12
    weigh: str = "experts"  # where the routing weights are applied (module doc): the stock twin's


EXPERT_BUGS: dict[str, ExpertBug] = {
    b.name: b for b in (
        ExpertBug("ep_global_expert_ids", "each rank weights its local expert i with routing column i (the local id) "
                  "instead of the global id r*E/N + i"),
        ExpertBug("ep_combine_wrong_indices", "the combine sends the experts' outputs without regrouping them by "
                  "destination rank: each rank sums rows of other ranks' tokens as its own"),
        ExpertBug("ep_combine_expert_order", "the combine weights the received experts' outputs (group order) with "
                  "routing columns in the order of a round-robin expert placement", weigh="tokens"),
    )
}


def expert_bug(name: str | None) -> ExpertBug | None:
    """The bug named `name` (None for none); an ExportError for an unknown name."""
    return None if name is None else named_bug(EXPERT_BUGS, name, "expert-parallel")


class GroupedMoE(nn.Module):
    """Mixtral's MoE block with dense dispatch and grouped (stacked) experts (module doc)."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int = TOP_K) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        self.w1 = nn.Parameter(torch.empty(experts, hidden, intermediate))  # gate projections, stacked
        self.w3 = nn.Parameter(torch.empty(experts, hidden, intermediate))  # up projections
        self.w2 = nn.Parameter(torch.empty(experts, intermediate, hidden))  # down projections

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """The dense [tokens, experts] routing matrix of tokens `x` [tokens, hidden]."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(1, top_i, top_w).to(x.dtype)

    def experts(self, xe: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Every expert of the stacks on its row of `xe` [experts, tokens, hidden]."""
        return torch.matmul(F.silu(torch.matmul(xe, w1)) * torch.matmul(xe, w3), w2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        weights = self.route(x)  # [T, E]
        xe = x.unsqueeze(0).expand(self.w1.shape[0], -1, -1)  # [E, T, H]: every token to every expert
        y = self.experts(xe, self.w1, self.w3, self.w2)
        y = y * weights.t().unsqueeze(-1)  # expert e's outputs times routing column e
        return y.sum(dim=0).view(b, s, h)

    @classmethod
    def from_dense(cls, block: DenseDispatchMoE) -> GroupedMoE:
        """The same block as `block` (its experts' Linear weights stacked, transposed to [in, out])."""
        e = len(block.experts)
        h, f = block.experts[0].w1.in_features, block.experts[0].w1.out_features
        ours = cls(h, f, e, block.top_k).to(block.gate.weight.device)
        with torch.no_grad():
            ours.gate.weight.copy_(block.gate.weight)
            for name in ("w1", "w3", "w2"):
                getattr(ours, name).copy_(torch.stack([getattr(x, name).weight.t() for x in block.experts]))
        return ours


def use_grouped_moe(model: nn.Module) -> nn.Module:
    """Replace every decoder layer's DenseDispatchMoE (`mlp`) by its GroupedMoE twin."""
    for layer in model.model.layers:
        layer.mlp = GroupedMoE.from_dense(layer.mlp)
    return model


def dispatch(x: torch.Tensor, n: int, group: object = None) -> torch.Tensor:
    """[E, T/N, ...] (this rank's tokens for every expert) -> [E/N, T, ...] (its experts, every
    rank's tokens in rank order): block k of E/N experts goes to rank k (all_to_all_single
    splits and concatenates dim 0), what arrives is regrouped expert-major. `group`: the EP
    process group (default: the whole world)."""
    c, tl = x.shape[0] // n, x.shape[1]
    group = dist.group.WORLD if group is None else group
    got = funcol.all_to_all_single(x.contiguous(), None, None, group)  # [N*E/N, T/N, ...]: block k from rank k
    return got.view(n, c, tl, *x.shape[2:]).transpose(0, 1).reshape(c, n * tl, *x.shape[2:])


def combine(y: torch.Tensor, n: int, bug: ExpertBug | None = None, group: object = None) -> torch.Tensor:
    """[E/N, T, ...] (this rank's experts, every token) -> [E, T/N, ...] (every expert, this
    rank's tokens): regrouped by destination rank, block k (rank k's tokens) sent to rank k.
    `group`: the EP process group (default: the whole world)."""
    c, tl = y.shape[0], y.shape[1] // n
    if bug is not None and bug.name == "ep_combine_wrong_indices":
        grouped = y.reshape(n * c, tl, *y.shape[2:])  # BUG: not regrouped by destination rank
    else:
        grouped = y.view(c, n, tl, *y.shape[2:]).transpose(0, 1).reshape(n * c, tl, *y.shape[2:])
    return funcol.all_to_all_single(grouped, None, None, dist.group.WORLD if group is None else group)


WEIGHINGS = ("experts", "tokens")


class ExpertParallelMoE(GroupedMoE):
    """Rank `rank` of `ep` of a GroupedMoE (`full`): the router and its own tokens, the chunk
    `rank` of the stacked expert weights (DTensor Shard(0)), dispatch and combine by all-to-all,
    the routing weights applied on the experts' or the tokens' side (`weigh`, module doc). `group`:
    the process group of its collectives (default: the whole world; an EP x TP mesh's EP group,
    exporters/strategies/expert_mesh.py); `mesh` the 1-D DeviceMesh its expert weights are sharded on."""

    def __init__(self, full: GroupedMoE, rank: int, ep: int, mesh: object, bug: ExpertBug | None,
                 weigh: str = "experts", group: object = None) -> None:
        from torch.distributed.tensor import DTensor, Shard

        nn.Module.__init__(self)
        self.top_k, self.gate, self.rank, self.ep, self.bug, self.weigh = full.top_k, full.gate, rank, ep, bug, weigh
        self.n_experts = full.w1.shape[0]
        self.group = dist.group.WORLD if group is None else group
        c = self.n_experts // ep
        for name in ("w1", "w3", "w2"):  # registered in the sequential order: the same FQNs
            local = getattr(full, name).detach()[rank * c:(rank + 1) * c].clone()
            setattr(self, name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)  # this rank's tokens
        weights = self.route(x)  # [T/N, E]: its tokens' routing weights
        xe = x.unsqueeze(0).expand(self.n_experts, -1, -1)  # [E, T/N, H]
        got = dispatch(xe, self.ep, self.group)  # [E/N, T, H]
        w1, w3, w2 = (w.to_local() for w in (self.w1, self.w3, self.w2))
        y = self.experts(got, w1, w3, w2)
        c = w1.shape[0]
        if self.weigh == "experts":
            every = funcol.all_gather_tensor(weights, 0, self.group)  # [T, E]: every token's routing weights
            first = 0 if self.bug is not None and self.bug.name == "ep_global_expert_ids" else self.rank * c
            mine = every[:, first:first + c]  # the columns of its experts' global ids (BUG: their local ids)
            y = y * mine.t().unsqueeze(-1)
        back = combine(y, self.ep, self.bug, self.group)  # [E, T/N, H], experts in group order
        if self.weigh == "tokens":
            if self.bug is not None and self.bug.name == "ep_combine_expert_order":
                # BUG: slot r*C + i taken as global expert i*N + r (a round-robin placement)
                weights = weights.view(-1, c, self.ep).transpose(1, 2).reshape(-1, self.n_experts)
            back = back * weights.t().unsqueeze(-1)  # its tokens' routing columns, in group order
        return back.sum(dim=0).view(b, s, h)


def validate_expert(model: str, config: str, ep: int, *, layers: int | None = None, batch: int | None = None,
                    meta: bool = False) -> ZooConfig:
    """The config (with `batch` rows if given), if `ep` ranks split its experts and its batch
    evenly, and its weights fit in memory or `meta` exports none; an ExportError otherwise."""
    from dataclasses import replace

    from refine.exporters.zoo.configs import MAX_PARAMETERS_WITH_DATA
    from refine.exporters.zoo.moe import EXPERTS

    cfg = zoo_config(model, config, layers)
    if batch is not None:
        if batch < 1:
            raise ExportError(f"the batch must have at least 1 row, got {batch}")
        cfg = replace(cfg, batch=batch)
    check_plan("expert parallelism", EP_MODELS, model, ep, "EP", cfg.batch, "batch", config)
    if EXPERTS % ep:
        raise ExportError(f"EP {ep} does not divide the {EXPERTS} experts of {model}")
    weights = cfg.parameters() + cfg.layers * (EXPERTS - 1) * 3 * cfg.hidden * cfg.intermediate  # every expert's MLP
    if not meta and weights > MAX_PARAMETERS_WITH_DATA:
        raise ExportError(f"{model} config {config!r} has about {weights / 1e9:.1f}e9 weights, too many to hold in "
                          "memory: export it with --meta (weights declared, no data)")
    return cfg


def build(model: str, config: str, seed: int = 0, *, layers: int | None = None, meta: bool = False) -> nn.Module:
    """The zoo model with grouped MoE blocks (the sequential model of an EP export); `meta`: on
    the meta device (shapes only, no weight data)."""
    from refine.exporters.zoo import models as zoo

    return use_grouped_moe(zoo.build(model, config, seed, layers=layers, meta=meta))


def rank_module(model: str, config: str, seed: int, rank: int, ep: int, *, layers: int | None = None,
                bug: ExpertBug | None = None, weigh: str = "experts", meta: bool = False) -> nn.Module:
    """Rank `rank` of the grouped zoo model built from `seed` (the same weights as the sequential one)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ep,))
    full = build(model, config, seed, layers=layers, meta=meta)
    for layer in full.model.layers:
        layer.mlp = ExpertParallelMoE(layer.mlp, rank, ep, mesh, bug, weigh)
    return full.eval()


def export_expert_parallel(
    model: str,
    config: str,
    ep: int,
    out: Path | str,
    seed: int = 0,
    *,
    bug: str | None = None,
    layers: int | None = None,
    flat: bool = False,
    workers: int | None = None,
    weigh: str | None = None,
    batch: int | None = None,
    meta: bool = False,
) -> ExportResult:
    """Export a zoo model under expert parallelism over `ep` ranks (module doc) to the model
    directory `out`, with the bug `bug` (EXPERT_BUGS) injected into the ranks if given. Each
    distinct layer becomes one ONNX local function per program (`flat`: inline instead).
    `weigh`: where the ranks apply the routing weights, "experts" (the default) or "tokens"
    (module doc); a bug brings its own (ep_combine_expert_order: tokens). `batch`: rows of the
    example input instead of the config's (EP N needs N to divide them); `meta` exports without
    weight data (the weights become typed graph inputs)."""
    from refine.exporters.zoo import plans, models as zoo
    from refine.exporters.capture.export import bug_words, export

    cfg = validate_expert(model, config, ep, layers=layers, batch=batch, meta=meta)
    injected = expert_bug(bug)
    if weigh is not None and weigh not in WEIGHINGS:
        raise ExportError(f"unknown weighting {weigh!r} (known: {', '.join(WEIGHINGS)})")
    if injected is not None and weigh is not None and weigh != injected.weigh:
        raise ExportError(f"bug {injected.name} is a twin of the export weighing on the {injected.weigh}' side, not {weigh!r}")
    weigh = injected.weigh if injected is not None else weigh or "experts"
    depth = (f", {cfg.layers} layers" if layers is not None else "") + (f", batch {batch}" if batch is not None else "")
    return export(
        build(model, config, seed, layers=layers, meta=meta),
        functools.partial(rank_module, model, config, seed, ep=ep, layers=layers, bug=injected, weigh=weigh, meta=meta),
        zoo.example_inputs(model, config, seed, meta=meta, batch=batch),
        ep,
        out,
        output_names=["logits"],
        output_layouts={"logits": {"layout": "shard", "axis": BATCH_AXIS}},
        input_layouts={"input_ids": {"layout": "shard", "axis": BATCH_AXIS}},
        input_ranges={"input_ids": cfg.vocab},
        description=f"{model} config {config!r}{depth}, EP over {ep} ranks (experts sharded, tokens dispatched and "
        f"combined by all-to-all, dense dispatch, routing weights applied on the {weigh}' side; attention data "
        f"parallel), forward, exported by exporters/strategies/expert.py" + (" (meta: no weight data)" if meta else "")
        + (bug_words(injected) if injected is not None else ""),
        # no "tp": refine/diagnose/reduced.py re-exports TP recipes only
        zoo={"model": model, "config": config, "ep": ep, "weigh": weigh, "batch": batch, "seed": seed, "layers": layers,
             "meta": meta, "flat": flat, "bug": bug, "train": False},
        layers=None if flat else plans.layer_stack(model),
        workers=workers,
    )
