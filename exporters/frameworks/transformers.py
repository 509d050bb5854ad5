"""HF transformers models under HF's own tensor-parallel plan, exported as they ship.

`refine export --framework transformers --model-type T` (and `export_model_type` here) builds a
tiny config of model type T (exporters/frameworks/transformers_configs.py), the causal LM of
that config with seeded random weights as the sequential model, and for each rank the same
model distributed by HF's own code, as `from_pretrained(..., distributed_config=
DistributedConfig(tp_size=N))` does it: `prepare_distribute_model` builds HF's device mesh
under refine's fake process group, `maybe_distribute_model` resolves the plan
(`_resolve_parallel_plans`: the config's `base_model_tp_plan`, the class plans, the
`embedding_rowwise` rule HF adds for `embed_tokens`, layer wildcards expanded) and applies it
(`apply_tensor_parallelism`: HF's parallel styles shard the parameters as DTensors and hook the
modules' forwards). No rule is removed and no plan of refine's is substituted. `export_hf_model`
does the same for a model the user built (`tp_plan="auto"` or a dict of overrides, merged by HF
as `DistributedConfig(tp_plan=...)` merges them).

What refine does around HF's code, and why:
- the weights are each rank's chunk of the sequential model's (HF shards with
  `src_data_rank=None`: each rank keeps its own chunk of the tensor it was given), so the
  sequential model and every rank are built from the same seed (or copied from the user's);
- attention is HF's `eager` implementation (SDPA would be one opaque op), `use_cache=False`;
- the forward is exported as HF runs inference, under `torch.no_grad()`: HF's styles then take
  their local fast paths (a rowwise layer all-reduces its partial output with
  `dist.all_reduce` and adds its bias after); the training step (`train=True`) runs with
  gradients, through HF's DTensor paths, HF's own loss (`ForCausalLMLoss`, the model's
  `forward(labels=...)`), and the gradient hooks HF's styles register
  (`replicated_with_grad_allreduce`'s post-accumulate hooks: refine.exporters.capture.train);
- with `ep` (`--ep N`, N the TP degree) the model's expert-parallel plan too, as
  `DistributedConfig(tp_size=N, ep_size=N, ep_implementation="all_reduce")` applies it: the
  stacked experts `Shard(0)` over the ranks (`grouped_gemm`), each rank running its own experts on
  the whole batch, the routes to the others masked, the outputs all-reduced (HF's `AllReduceEP`,
  what HF picks at inference when the expert group is the TP group); `bug` puts a twin of
  `AllReduceEP` into the ranks (exporters/frameworks/transformers_bugs.py);
- DTensor's vocab-parallel lookup (`embedding_rowwise`) is captured in one op
  (refine.exporters.capture.vocab_lookup), and `_StridedShard` placements (`packed_colwise`,
  `packed_rowwise`) are declared with refine.json's `stride` layout
  (refine.exporters.capture.layouts): both read off what DTensor does, never off the plan.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from refine.exporters.errors import ExportError, LayerFormError
from refine.exporters.frameworks.transformers_configs import BATCH, SEQ_LEN, HFConfig, expert_parallel, token_vocab, validate
from refine.version import installed

if TYPE_CHECKING:
    from refine.exporters.capture.export import ExportResult

FRAMEWORK = "transformers"
# HF styles whose forward registers gradient hooks on its parameters (post-accumulate: an
# all-reduce of the gradient). A training step with layer functions runs one layer of each kind
# for real and stubs the others (refine.exporters.capture.train_layers), whose forwards would then
# register no hook: such steps are exported flat, every layer run.
HOOKED_STYLES = frozenset({"replicated_with_grad_allreduce"})
MAX_WEIGHTS = 200_000_000  # a config (a config.json, a sub-config left at its shipped sizes) above this is refused


class _LogitsStep:
    """Mixed into an HF causal LM's own class (its parameter FQNs stay HF's): forward(input_ids)
    returns the logits tensor; with `labels`, HF's own training loss (the model's
    `forward(labels=...)`: ForCausalLMLoss, labels shifted inside, mean over the counted tokens)."""

    computes_loss = True  # a training step's loss is the model's own (refine.exporters.capture.train)
    output_name = "logits"

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(input_ids=input_ids, labels=labels, use_cache=False)  # type: ignore[misc]
        return out.logits if labels is None else out.loss


class _HiddenStates:
    """Mixed into the own class of an HF model without a causal-LM head (transformers' AutoModel
    of a model type with no causal-LM class): forward(input_ids) returns one field of its output,
    `output_name` (`output_field`): a base model's (an encoder, a multimodal model's text tower)
    last hidden state; a model with a head of its own over its base model (AutoModel builds
    HiggsAudioV2ForConditionalGeneration, whose audio head gives `logits`) its logits. It has no
    loss of its own, so only its forward is exported."""

    output_name = "last_hidden_state"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(input_ids=input_ids)  # type: ignore[misc]
        value = getattr(out, self.output_name, None)
        if not isinstance(value, torch.Tensor):
            fields = [k for k, v in (out.items() if hasattr(out, "items") else []) if isinstance(v, torch.Tensor)]
            raise ExportError(f"{type(self).__name__}'s output ({type(out).__name__}) has no {self.output_name} "
                              f"tensor to export (its tensors: {', '.join(fields) or 'none'})")
        return value


def output_field(model: torch.nn.Module) -> str:
    """The field of an HF model's output that refine exports: `logits` for a causal LM and for a
    model with a head of its own over its base model (`base_model` is a submodule, not the model
    itself: a head model AutoModel builds), `last_hidden_state` for a base model."""
    if is_causal_lm(model):
        return "logits"
    base = getattr(model, "base_model", model)
    return "logits" if isinstance(base, torch.nn.Module) and base is not model else "last_hidden_state"


def is_causal_lm(model: torch.nn.Module) -> bool:
    """Whether `model` has an LM head (logits, and HF's own loss) rather than hidden states only."""
    return hasattr(model, "lm_head") or (hasattr(model, "get_output_embeddings")
                                         and model.get_output_embeddings() is not None)


def as_logits_model(model: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of an HF model whose forward takes the token ids alone: a causal LM's
    returns the logits (`_LogitsStep`), any other model's the field `output_field` names
    (`_HiddenStates`: a base model's last hidden state, a head model's logits). The same
    parameters and submodules; the user's object is untouched."""
    if isinstance(model, (_LogitsStep, _HiddenStates)):
        return model
    if not hasattr(model, "config") or not hasattr(model.config, "get_text_config"):
        raise ExportError(f"{type(model).__name__} is no HF transformers model (no PreTrainedConfig): export it "
                          "with refine.exporters.export and a plan of your own")
    mixin = _LogitsStep if is_causal_lm(model) else _HiddenStates
    step = type(type(model).__name__, (mixin, type(model)),
                {"__module__": type(model).__module__, "output_name": output_field(model)})
    shallow = copy.copy(model)
    shallow.__class__ = step
    return shallow


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """HF's initialization plus seeded noise on every parameter (no norm weight exactly 1, no bias
    exactly 0, so a weight used wrongly shows in --check), in eval mode."""
    from refine.exporters.zoo.models import _perturb

    _perturb(model, seed)
    return model.eval()


def build(hf: HFConfig, seed: int, experts: str | None = None) -> torch.nn.Module:
    """The causal LM of `hf`'s config (its base model if the type has no causal-LM class), float32,
    eager attention, weights from `seed`; `experts`: HF's experts implementation (None: the
    model's default)."""
    from transformers import AutoModel, AutoModelForCausalLM

    auto = AutoModelForCausalLM if hf.causal else AutoModel
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):  # (its size first: a config too big to hold is refused, not swapped to death)
                weights = sum(p.numel() for p in auto.from_config(copy.deepcopy(hf.config)).parameters())
            if weights > MAX_WEIGHTS:
                raise ExportError(f"model type {hf.model_type!r}: its {hf.source} config has {weights / 1e6:.0f}M weights, "
                                  f"more than the {MAX_WEIGHTS / 1e6:.0f}M an export with data holds")
            chosen = {} if experts is None else {"experts_implementation": experts}
            model = auto.from_config(copy.deepcopy(hf.config), attn_implementation="eager", dtype=torch.float32, **chosen)
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model code's own reason
        raise ExportError(f"model type {hf.model_type!r}: transformers cannot build its causal LM from the "
                          f"{hf.source} config: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
    return as_logits_model(_perturbed(model, seed))


def distributed_config(tp: int, tp_plan: str | Mapping[str, str] = "auto", ep: bool = False,
                       ep_implementation: str = "all_reduce") -> Any:
    """HF's DistributedConfig for TP `tp` with `tp_plan` as DistributedConfig takes it; `ep`: the
    model's expert-parallel plan over the same ranks (`ep_size == tp_size`), tokens reaching the
    experts by HF's `ep_implementation`: `all_reduce` (AllReduceEP: every rank runs its own experts
    on the whole batch, routes to other ranks' experts masked, the partial outputs all-reduced) or
    `all_to_all` (AllToAllEP: routes exchanged, exporters/frameworks/transformers_all_to_all.py)."""
    from transformers.distributed import DistributedConfig

    plan = tp_plan if tp_plan == "auto" else dict(tp_plan)
    if not ep:
        return DistributedConfig(tp_size=tp, tp_plan=plan)
    return DistributedConfig(tp_size=tp, tp_plan=plan, ep_size=tp, ep_implementation=ep_implementation)


def distribute(model: torch.nn.Module, tp: int, tp_plan: str | Mapping[str, str] = "auto", ep: bool = False,
               ep_implementation: str = "all_reduce") -> torch.nn.Module:
    """`model` distributed over `tp` ranks by HF's own code, as from_pretrained does it after
    building the model (module doc), on the calling rank of the current (fake) process group
    (`distributed_config`)."""
    config = distributed_config(tp, tp_plan, ep, ep_implementation)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tied = _untie(model)
            config, _device_map, meshes = type(model).prepare_distribute_model(config)
            model = type(model).maybe_distribute_model(model, config, meshes)
            model.tie_weights(missing_keys=set(tied), recompute_mapping=False)
            return model
    except Exception as exc:  # noqa: BLE001 - HF's own refusal (a plan naming nothing, a style a module lacks)
        raise ExportError(f"transformers cannot distribute {type(model).__name__} over {tp} ranks with its plan: "
                          f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None


def _untie(model: torch.nn.Module) -> list[str]:
    """Tied weights (a tied LM head) made separate parameters holding the same values, the state
    from_pretrained distributes a model in: it builds the model without tying
    (`init.no_tie_weights()`), distributes it, loads the checkpoint (which holds the tied tensor
    once) and ties after (`tie_weights(missing_keys=...)`); `distribute` ties the same way. The
    targets untied (the names the checkpoint would lack)."""
    targets = []
    for target, source in dict(getattr(model, "all_tied_weights_keys", None) or {}).items():
        owner, _, name = target.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        current, origin = getattr(module, name, None), model.get_parameter(source)
        if current is not None and current is origin:
            setattr(module, name, torch.nn.Parameter(origin.detach().clone(), requires_grad=origin.requires_grad))
            targets.append(target)
    return targets


def resolved_plan(model: torch.nn.Module, tp: int, tp_plan: str | Mapping[str, str] = "auto",
                  ep: bool = False) -> dict[str, str]:
    """The TP plan HF applies to `model` at TP `tp` (`_resolve_parallel_plans`, wildcards
    expanded), and with `ep` the expert-parallel plan over the same ranks (its rules take
    precedence, as HF applies them after the TP plan)."""
    config = distributed_config(tp, tp_plan, ep)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp_resolved, ep_resolved, _fsdp = copy.deepcopy(model)._resolve_parallel_plans(config)
    except Exception as exc:  # noqa: BLE001 - HF's own refusal (no expert-parallel plan, experts not divisible)
        raise ExportError(f"transformers cannot resolve {type(model).__name__}'s plan over {tp} ranks"
                          f"{' with expert parallelism' if ep else ''}: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:300]}") from None
    return {**tp_resolved, **ep_resolved}


def layer_stack(model: torch.nn.Module) -> str | None:
    """The FQN of the ModuleList holding the decoder layers (`model.layers` for most), None if none."""
    count = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    stacks = [name for name, m in model.named_modules()
              if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "layer", "blocks")
              and (count is None or len(m) == count)]
    return min(stacks, key=len) if stacks else None


def _example_inputs(vocab: int, seed: int, train: bool, batch: int = BATCH, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, vocab, (batch, seq_len), generator=gen) for _ in range(2 if train else 1))


@contextlib.contextmanager
def _inference(train: bool) -> Iterator[None]:
    """The forward as HF runs inference (no gradients: its styles' local fast paths); a training
    step with gradients. Rank workers are forked inside the block and keep its grad mode."""
    with contextlib.nullcontext() if train else torch.no_grad():
        yield


def _export(seq_builder: Callable[[], torch.nn.Module], rank_builder: Callable[[], torch.nn.Module], tp: int,
            tp_plan: str | Mapping[str, str], vocab: int, out: Path | str, seed: int, *, train: bool, flat: bool,
            workers: int | None, description: str, zoo: Mapping[str, Any] | None,
            inputs: tuple[torch.Tensor, ...] | None = None, ep: bool = False, bug: str | None = None,
            ep_implementation: str = "all_reduce") -> ExportResult:
    """The export both entry points share: the sequential model, and every rank's built by
    `rank_builder` and distributed by HF (`distribute`; `ep`: with the experts over the ranks,
    dispatched by `ep_implementation`; `bug`: a twin of one of HF's styles in the ranks, `hf_twin`)."""
    from refine.exporters.capture.export import export
    from refine.exporters.capture.layouts import REP
    from refine.exporters.capture.tracing import quiet
    from refine.exporters.frameworks.transformers_all_to_all import all_to_all_at_static_capacity

    seq = seq_builder()
    plan = resolved_plan(seq, tp, tp_plan, ep)
    if expert_parallel(plan) and not ep:
        raise ExportError(f"{type(seq).__name__}'s plan distributes its experts over the ranks: expert-parallel "
                          "dispatch is exported with --ep (HF's AllReduceEP; docs/moe.md)")
    if ep and not expert_parallel(plan):
        raise ExportError(f"{type(seq).__name__}'s expert-parallel plan applies to none of its modules (no "
                          "`base_model_ep_plan`, or no layer of this config has routed experts): drop --ep")

    def rank_module(rank: int) -> torch.nn.Module:
        return distribute(rank_builder(), tp, tp_plan, ep, ep_implementation)

    exchanged = ep and ep_implementation == "all_to_all"

    if train and HOOKED_STYLES & set(plan.values()):
        flat = True  # (hooks a stub layer would not register: module doc)
    args = inputs if inputs is not None else _example_inputs(vocab, seed, train)
    if train and not is_causal_lm(seq):
        raise ExportError(f"{type(seq).__name__} has no LM head, so no loss of its own: export its forward (drop train)")
    name = seq.output_name
    outputs: dict[str, Any] = {} if train else {"output_names": [name], "output_layouts": {name: dict(REP)}}

    def run(layers: str | None) -> ExportResult:
        with quiet(), _inference(train), _train_hooks(train), hf_twin(bug), \
                all_to_all_at_static_capacity(bug) if exchanged else contextlib.nullcontext():
            return export(seq, rank_module, args, tp, out, **outputs,
                          input_ranges={"input_ids": vocab, "labels": vocab}, description=description,
                          zoo=dict(zoo) if zoo is not None else None, layers=layers, workers=workers, train=train)

    try:
        try:
            result = run(None if flat else layer_stack(seq))
        except LayerFormError as exc:  # (a layer that cannot be a function: every layer inline instead)
            result = run(None)
            result.notes.append(f"layers inline ({exc})")
        if exchanged:
            result.notes.append("HF's AllToAllEP at static capacity (exporters/capture/ragged.py): its exchanges are "
                                "dist.AllToAllV, whose counts the simulator checks; no lemma reads their rows yet, so "
                                "the verdict is UNPROVEN at best (docs/moe.md)")
    except ExportError as exc:
        raise ExportError(f"{exc}{_style_at(str(exc), plan)}") from None
    return result


def _style_at(message: str, plan: Mapping[str, str]) -> str:
    """Which of HF's parallel styles a capture failure stopped in, and the plan's rules of that
    style, when the failure's line (`(at FILE:LINE)`) is in transformers' distributed code."""
    import inspect
    import re

    found = re.search(r"\(at (\S*transformers/distributed/\S+\.py):(\d+)\)", message)
    if found is None:
        return ""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    file, line = found[1], int(found[2])
    for name in ALL_PARALLEL_STYLES:
        cls = type(ALL_PARALLEL_STYLES[name])
        try:
            lines, first = inspect.getsourcelines(cls)
        except (OSError, TypeError):
            continue
        if inspect.getsourcefile(cls) == file and first <= line < first + len(lines):
            names = sorted({n for n in ALL_PARALLEL_STYLES if type(ALL_PARALLEL_STYLES[n]) is cls})
            rules = sorted(k for k, v in plan.items() if v in names)
            shown = ", ".join(rules[:3]) + (f" and {len(rules) - 3} more" if len(rules) > 3 else "")
            return f"; in HF's parallel style {cls.__name__} ({'/'.join(names)}: {shown or 'no rule of this plan'})"
    return ""


@contextlib.contextmanager
def _train_hooks(train: bool) -> Iterator[None]:
    """While a training step is traced: in-place collectives as their functional forms (HF's
    `_AllReduceForward`/`_AllReduceBackward` and its gradient hooks call `dist.all_reduce`),
    HF's experts on a float32 model taking HF's own grouped-GEMM op (`float32_grouped_mm`), and
    HF's code taking its export paths (`hf_export_paths`)."""
    if not train:
        yield
        return
    from refine.exporters.capture.functional import functional_all_reduce

    with functional_all_reduce(), float32_grouped_mm(), hf_export_paths():
        yield


@contextlib.contextmanager
def hf_export_paths() -> Iterator[None]:
    """HF's code asks `is_torchdynamo_exporting()` to pick what an export target supports (the
    gated delta rule's forward substitution where eager code calls `torch.linalg.solve_triangular`,
    which has no ONNX translation; masks without vmap). torch.export's forward trace answers yes; a
    training step is traced by make_fx, so HF's modules are told the same while it is: every
    transformers module that imported the function sees one that answers True."""
    import sys

    from transformers.utils import import_utils

    def exporting() -> bool:
        return True

    original = import_utils.is_torchdynamo_exporting
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("transformers") and getattr(m, "is_torchdynamo_exporting", None) is original]
    for module in modules:
        module.is_torchdynamo_exporting = exporting
    try:
        yield
    finally:
        for module in modules:
            module.is_torchdynamo_exporting = original


@contextlib.contextmanager
def float32_grouped_mm() -> Iterator[None]:
    """CPU shim: HF's experts (`transformers.integrations.moe._grouped_mm`) multiply a float32
    model's groups with HF's own `transformers::grouped_mm_fallback`, as HF does under
    torch.compile, not with `torch.nn.functional.grouped_mm`, whose shape function accepts
    bfloat16 only (an eager CPU run takes float32; a traced one fails). The same products, by HF's
    own loop over the groups."""
    import transformers.integrations.moe as moe

    saved = moe._can_use_grouped_mm

    def can_use(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:  # noqa: A002 - HF's names
        return weight.dtype == torch.bfloat16 and saved(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = saved


@contextlib.contextmanager
def _replaced(owner: Any, attribute: str, value: Any) -> Iterator[None]:
    """`owner.attribute` is `value` inside the block (a twin's one changed function), HF's own after."""
    saved = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        setattr(owner, attribute, saved)


@contextlib.contextmanager
def hf_twin(name: str | None) -> Iterator[None]:
    """While the ranks are captured: one of HF's styles with the one line twin `name` changes
    (exporters/frameworks/transformers_bugs.py; None: HF's own, untouched)."""
    if name is None:
        yield
    elif name == "mla_rope_grad_unreduced":
        with _mla_rope_grad_unreduced():
            yield
    elif name in ("ep_counts_unexchanged", "ep_combine_forward_order"):  # (AllToAllEP's: all_to_all_at_static_capacity)
        yield
    else:
        with ep_bug(name):
            yield


@contextlib.contextmanager
def _mla_rope_grad_unreduced() -> Iterator[None]:
    """The twin `mla_rope_grad_unreduced`: HF's `MlaKvAProjParallel.transform_output_post_forward`
    without the all-reduce of the rope part's gradient."""
    import transformers.distributed.tensor_parallel as hf_tp

    def transform_output_post_forward(self: Any, module: Any, output: torch.Tensor, mesh: Any) -> torch.Tensor:
        rope_dim = module.config.qk_rope_head_dim
        pass_output, rope_output = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([pass_output, rope_output], dim=-1)  # the twin: no _AllReduceBackward on rope_output

    with _replaced(hf_tp.MlaKvAProjParallel, "transform_output_post_forward", transform_output_post_forward):
        yield


@contextlib.contextmanager
def ep_bug(name: str | None) -> Iterator[None]:
    """While the ranks are captured: HF's `AllReduceEP.__call__` with the one line twin `name`
    changes (exporters/frameworks/transformers_bugs.py; `hf_twin` leaves HF's own when there is none)."""
    import transformers.distributed.expert_parallel as hf_ep

    backward, forward = hf_ep._AllReduceBackward, hf_ep._AllReduceForward
    groups: list[Any] = []  # (the expert group, for a twin that all-reduces outside AllReduceEP)

    def call(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        ep_group = self.ep_mesh.get_group()
        if name != "ep_input_grad_unreduced":
            hidden_states = backward.apply(hidden_states, ep_group)
        if name != "ep_router_grad_unreduced":
            top_k_weights = backward.apply(top_k_weights, ep_group)
        off_rank = (top_k_index // self.num_local_experts) != self.ep_mesh.get_local_rank()
        local_index = torch.where(off_rank, self.num_local_experts, top_k_index % self.num_local_experts)
        if name == "ep_global_ids":
            local_index = top_k_index  # the twin: global ids where local ones belong
        expert_output = self.experts_forward(hidden_states, local_index, top_k_weights.masked_fill(off_rank, 0.0))
        if name == "ep_output_mean":
            expert_output = expert_output / self.ep_mesh.size()  # the twin: averaged, then summed
        if name == "ep_shared_before_reduce":
            groups[:] = [ep_group]
            return expert_output  # the twin: the block all-reduces, after adding the shared expert
        return forward.apply(expert_output, ep_group)

    with _replaced(hf_ep.AllReduceEP, "__call__", call), \
            _shared_before_reduce(forward, groups) if name == "ep_shared_before_reduce" else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _shared_before_reduce(all_reduce: Any, groups: list[Any]) -> Iterator[None]:
    """The twin `ep_shared_before_reduce`: HF's `Qwen2MoeSparseMoeBlock.forward` with the experts'
    all-reduce moved after the shared expert's add (over the expert group the experts' call put
    into `groups`)."""
    import torch.nn.functional as F  # noqa: N812 - HF's name for it
    from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2_moe

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states_reshaped = hidden_states.view(-1, hidden_dim)
        shared_expert_output = self.shared_expert(hidden_states_reshaped)
        _, routing_weights, selected_experts = self.gate(hidden_states_reshaped)
        expert_output = self.experts(hidden_states_reshaped, selected_experts, routing_weights)
        shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states_reshaped)) * shared_expert_output
        expert_output = expert_output + shared_expert_output
        if getattr(self.experts, "_is_expert_parallel", False):  # (the sequential model's block is HF's)
            expert_output = all_reduce.apply(expert_output, groups[0])  # the twin: after the shared add
        return expert_output.reshape(batch_size, sequence_length, hidden_dim)

    with _replaced(qwen2_moe.Qwen2MoeSparseMoeBlock, "forward", forward):
        yield


def export_model_type(model_type: str | None, tp: int = 2, out: Path | str = Path("out"), *, config: str = "tiny",
                      seed: int = 0, train: bool = False, sp: bool = False, flat: bool = False,
                      workers: int | None = None, ep: int | None = None, experts: str | None = None,
                      bug: str | None = None, ep_implementation: str | None = None) -> ExportResult:
    """Export model type `model_type` (a tiny config, or `config` a config.json) at TP 1 (seq.onnx)
    and under HF's own plan at TP `tp` (the ranks) to `out`; `train`: one training step; `ep`
    (= `tp`): with HF's expert-parallel plan over the same ranks (`distributed_config`);
    `experts`: HF's experts implementation (grouped_mm, batched_mm; None: the model's default);
    `ep_implementation`: HF's expert-parallel dispatch (all_reduce, the default; all_to_all);
    `bug`: a twin of one of HF's styles in the ranks (exporters/frameworks/transformers_bugs.py)."""
    from refine.exporters.capture.export import bug_words
    from refine.exporters.frameworks.transformers_bugs import transformers_bug

    hf = validate(model_type, config, tp, sp, train, ep, experts, ep_implementation)
    dispatch = ep_implementation or "all_reduce"
    injected = (transformers_bug(bug, ep=ep, train=train, model_type=hf.model_type, ep_implementation=dispatch)
                if bug is not None else None)
    step = "one training step" if train else "forward (inference)"
    style = "AllToAllEP" if dispatch == "all_to_all" else "AllReduceEP"
    plans = f"HF's own TP plan and expert-parallel plan ({style}) over {tp} ranks" if ep else f"HF's own TP plan over {tp} ranks"
    chosen = f", {experts} experts" if experts else ""
    description = (f"HF transformers {installed('transformers')} {hf.model_type} ({hf.source} config{chosen}), {plans}, "
                   f"{step}, exported by `refine export --framework transformers`"
                   + (bug_words(injected) if injected else ""))
    record = {"framework": FRAMEWORK, "model": hf.model_type, "config": hf.source, "tp": tp, "seed": seed,
              "train": train, "flat": flat, "ep": bool(ep), "experts": experts, "bug": bug,
              **({"ep_implementation": dispatch} if dispatch != "all_reduce" else {})}
    return _export(lambda: build(hf, seed, experts), lambda: build(hf, seed, experts), tp, "auto", hf.vocab, out, seed,
                   train=train, flat=flat, workers=workers, description=description, zoo=record, ep=bool(ep), bug=bug,
                   ep_implementation=dispatch)


def export_hf_model(model: torch.nn.Module, tp: int, out: Path | str, *, tp_plan: str | Mapping[str, str] = "auto",
                    train: bool = False, inputs: tuple[torch.Tensor, ...] | None = None, seed: int = 0,
                    flat: bool = False, workers: int | None = None, ep: bool = False) -> ExportResult:
    """Export an HF causal LM the caller built (on the CPU, float32, eager attention: e.g.
    `AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")`) as the sequential
    model, and a copy of it on each of `tp` ranks distributed by HF with `tp_plan` ("auto": the
    model's shipped plan; a dict: overrides HF merges into it); `ep`: with the model's
    expert-parallel plan over the same ranks (`distributed_config`). `inputs`: (input_ids,) or with
    `train` (input_ids, labels); default: a random batch of 2 x 8 tokens. Check it with
    `refine.exporters.check(out, as_logits_model(model))`."""
    if tp < 2:
        raise ExportError(f"tp must be at least 2, got {tp}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ExportError(f"{type(model).__name__}: export a model on the CPU (its weights are exported with it)")
    seq = as_logits_model(model).eval()
    vocab = token_vocab(model.config, str(getattr(model.config, "model_type", None) or type(model).__name__))
    description = (f"HF transformers {installed('transformers')} {type(model).__name__}, HF's TP plan "
                   f"({'as shipped' if tp_plan == 'auto' else 'with overrides'}) over {tp} ranks, "
                   f"{'one training step' if train else 'forward (inference)'}, exported by refine.exporters.frameworks.transformers")
    return _export(lambda: seq, lambda: as_logits_model(copy.deepcopy(model)).eval(), tp, tp_plan, vocab, out, seed,
                   train=train, flat=flat, workers=workers, description=description, zoo=None, inputs=inputs, ep=ep)


@contextlib.contextmanager
def reference_model(entry: Mapping[str, Any]) -> Iterator[torch.nn.Module]:
    """The sequential torch model a manifest's zoo record names (refine.exporters.check)."""
    from refine.exporters.frameworks.transformers_configs import resolve_config

    hf = resolve_config(entry["model"], entry["config"], entry["tp"])
    yield build(hf, entry["seed"], entry.get("experts"))
