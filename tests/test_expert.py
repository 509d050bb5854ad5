"""Expert parallelism (exporters/strategies/expert.py, rules/experts.lp).

The zoo Mixtral with grouped experts (GroupedMoE) computes what exporters/zoo/moe.py's
DenseDispatchMoE and HF's block compute; its EP 2 export (experts sharded, tokens dispatched and
combined by all-to-all) matches torch and verifies; its bug twins (BUGS.md class 12) are refuted
at the node where the ranks' routing columns or combined rows go wrong, at a line of
exporters/strategies/expert.py. The lemmas of rules/experts.lp (topk_sliced, argmax_sliced, all_to_all_dispatch,
all_to_all_combine) have numeric witnesses here (random shapes, asymmetric random values, the
multi-rank simulator checking every derived relation), and the programs that differ from them
in one step (no swap, the blocks split the other way round, a scrambled group, TopK along the
sliced axis) are refused.

Each export is made once per session through the CLI and shared by the tests reading it; the
tokens'-side twins (weighing the combined outputs, ep_combine_expert_order) and the combine twin
(the default run refutes global_ids) only under benchmarks/sweep.py (REFINE_TEST_SWEEP=1).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from harness import (SWEEP, Case, Graph, Outcome, assert_export_refused, exports_on_first_use, invoke, run_case, shard,
                     simulate)
from refine.report.render import render_text

EXPERT_PY = str(Path(__file__).resolve().parent.parent / "exporters" / "strategies" / "expert.py")
WORLDS = (2, 3, 4)
IN_TURN = [(2, 0), (3, 1), (4, 0), (4, 1)]  # every world size; odd seeds add a trailing axis


# ============================================================================================
# Lemma witnesses (rules/experts.lp)
# ============================================================================================


def rng_for(name: str, *key: int) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(name.encode()), *key])


def size(rng: np.random.Generator, lo: int = 2, hi: int = 5) -> int:
    return int(rng.integers(lo, hi + 1))


def make(name: str, world: int, inputs: dict[str, tuple[list[int], dict]], body) -> tuple[Case, object, list]:
    """The body builds one side (r None: the sequential program); inputs: name -> (shape, layout)."""
    seq = Graph()
    seq_ret = body(seq, {n: seq.input(n, shape) for n, (shape, _) in inputs.items()}, None)
    ranks, rets = [], []
    for r in range(world):
        g = Graph()
        local = {}
        for n, (shape, layout) in inputs.items():
            shape = list(shape)
            if layout["layout"] == "shard":
                shape[layout["axis"]] //= world
            local[n] = g.input(n, shape)
        rets.append(body(g, local, r))
        ranks.append(g)
    return Case(name, seq, ranks, {n: lay for n, (_, lay) in inputs.items()}), seq_ret, rets


def witness(case: Case, seed: int, *lemmas: str) -> Outcome:
    """Verified; the lemmas fired and every relation derived held on the simulated numbers."""
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert set(lemmas) <= out.checked.lemmas_checked, (sorted(out.lemmas_fired()), sorted(out.checked.lemmas_checked))
    assert out.derived.get("sanity") == []
    assert out.report.verdict == "verified", render_text(out.report)
    return out


def refused(case: Case, seed: int, seq_out: str, rank_outs: list[str], *lemmas: str) -> Outcome:
    """A buggy program: a real numeric difference, not verified, none of `lemmas` fired, and
    whatever was derived holds on the numbers."""
    sim = simulate(case, seed)
    assert not all(sim.ranks[r][t].shape == sim.seq[seq_out].shape and np.allclose(sim.ranks[r][t], sim.seq[seq_out], atol=1e-4)
                   for r, t in enumerate(rank_outs)), "the negative case is not buggy"
    out = run_case(case, seed)
    assert out.checked.ok, out.checked.violations
    assert out.derived.get("sanity") == []
    assert not set(lemmas) & out.lemmas_fired(), sorted(out.lemmas_fired())
    assert out.report.verdict != "verified", render_text(out.report)
    return out


def regroup(g: Graph, t: str, k: int, c: int, l: int, rest: list[int], swap: bool = True, order: str = "kc") -> str:
    """[K*C, L, ..] -> [C, K*L, ..] (view [K, C, L, ..], swap, view): what an EP rank does with
    what the dispatch's all-to-all gives it. An Identity between the steps (a clone, a wait)."""
    first = [k, c] if order == "kc" else [c, k]
    v = g.op("Identity", g.op("Reshape", t, g.ints([*first, l, *rest])))
    if swap:
        v = g.op("Identity", g.op("Transpose", v, perm=[1, 0, *range(2, 3 + len(rest))]))
    return g.op("Reshape", v, g.ints([c, k * l, *rest]))


def ungroup(g: Graph, u: str, k: int, c: int, l: int, rest: list[int], swap: bool = True, order: str = "ck") -> str:
    """[C, K*L, ..] -> [K*C, L, ..] (view [C, K, L, ..], swap, view): the combine's regrouping by
    destination rank, before its all-to-all."""
    v = g.op("Reshape", u, g.ints([c, k, l, *rest]) if order == "ck" else g.ints([k, c, l, *rest]))
    if swap:
        v = g.op("Transpose", v, perm=[1, 0, *range(2, 3 + len(rest))])
    return g.op("Identity", g.op("Reshape", g.op("Identity", v), g.ints([k * c, l, *rest])))


def a2a(g: Graph, t: str, group: list[int]) -> str:
    return g.coll("AllToAll", t, group, split_axis=0, concat_axis=0)


def shapes(name: str, world: int, seed: int) -> tuple[int, int, list[int]]:
    """C experts per rank, L tokens per rank, the trailing axes (hidden, and on odd seeds one more)."""
    rng = rng_for(name, world, seed)
    return size(rng, 1, 3), size(rng, 1, 3), [size(rng)] + ([size(rng)] if seed % 2 else [])


@pytest.mark.parametrize("world,seed", IN_TURN)
def test_all_to_all_dispatch(world: int, seed: int) -> None:
    """Member k holds S[:, k*L:(k+1)*L] (its tokens for every expert); the all-to-all and the
    regroup give member j S[j*C:(j+1)*C, :] (its experts, every token), and gathering those
    along axis 0 rebuilds S."""
    c, l, rest = shapes("dispatch", world, seed)
    inputs = {"x": ([world * c, world * l, *rest], shard(1))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        if r is None:
            t = g.op("Neg", x["x"])
            return t, g.output(t)
        t = regroup(g, a2a(g, x["x"], list(range(world))), world, c, l, rest)
        return t, g.output(g.coll("AllGather", g.op("Neg", t), list(range(world)), axis=0))

    case, _, ranks = make("ep_dispatch", world, inputs, body)
    out = witness(case, seed, "all_to_all_dispatch")
    got = {t: lay for t, lay in out.relations_of("x")}
    assert [got.get(f"r{j}:{t}") for j, (t, _) in enumerate(ranks)] == [("sl", 0, j * c, (j + 1) * c) for j in range(world)]


@pytest.mark.parametrize("world,seed", IN_TURN)
def test_all_to_all_combine(world: int, seed: int) -> None:
    """Member i holds S[i*C:(i+1)*C, :] (its experts' outputs for every token); regrouped by
    destination and all-to-all'ed, member j gets S[:, j*L:(j+1)*L] (every expert, its tokens),
    which a sum over the experts keeps as its tokens' rows."""
    c, l, rest = shapes("combine", world, seed)
    inputs = {"y": ([world * c, world * l, *rest], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(g.op("ReduceSum", x["y"], g.ints([0]), keepdims=0))
        back = g.op("Identity", a2a(g, ungroup(g, x["y"], world, c, l, rest), list(range(world))))
        mine = g.op("ReduceSum", back, g.ints([0]), keepdims=0)
        return g.output(g.coll("AllGather", mine, list(range(world)), axis=0))

    case, _, _ = make("ep_combine", world, inputs, body)
    out = witness(case, seed, "all_to_all_combine", "reduce")
    combined = {lay for t, lay in out.relations_of("y") if lay[0] == "sl" and lay[1] == 1}
    assert combined == {("sl", 1, j * l, (j + 1) * l) for j in range(world)}


@pytest.mark.parametrize("world,seed", IN_TURN)
def test_dispatch_then_combine_round_trip(world: int, seed: int) -> None:
    """Dispatch, an expert-wise op, combine: each rank gets back its own tokens' rows."""
    c, l, rest = shapes("round_trip", world, seed)
    inputs = {"x": ([world * c, world * l, *rest], shard(1))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(g.op("Sigmoid", x["x"]))
        group = list(range(world))
        y = g.op("Sigmoid", regroup(g, a2a(g, x["x"], group), world, c, l, rest))
        return g.output(a2a(g, ungroup(g, y, world, c, l, rest), group))

    case, _, _ = make("ep_round_trip", world, inputs, body)
    witness(case, seed, "all_to_all_dispatch", "all_to_all_combine", "elementwise")


@pytest.mark.parametrize("world,seed", IN_TURN)
def test_topk_sliced(world: int, seed: int) -> None:
    """TopK along the experts of a slice of the tokens (both outputs), and the scatter of its
    weights into a dense routing matrix, per token."""
    rng = rng_for("topk", world, seed)
    t, e = world * size(rng, 1, 3), size(rng, 3, 6)
    k = int(rng.integers(1, e))
    inputs = {"p": ([t, e], shard(0))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        w, i = g.op_n("TopK", x["p"], g.ints([k]), outputs=2, axis=-1)
        return g.output(w), g.output(i)

    case, _, _ = make("ep_topk", world, inputs, body)
    out = witness(case, seed, "topk_sliced")
    assert {lay for _, lay in out.relations_of(case.seq.model().graph.output[1].name) if lay != "rep"} == \
        {("sl", 0, j * (t // world), (j + 1) * (t // world)) for j in range(world)}


@pytest.mark.parametrize("world", WORLDS)
def test_topk_along_the_sliced_axis_is_refused(world: int) -> None:
    """Each rank's top-k of its own slice of the picked axis is not the top-k of the whole."""
    rng = rng_for("neg_topk", world)
    t, e = size(rng, 2, 4), world * size(rng, 2, 3)
    inputs = {"p": ([t, e], shard(1))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        w, _ = g.op_n("TopK", x["p"], g.ints([2]), outputs=2, axis=1)
        return g.output(w)

    case, out, ranks = make("neg_topk", world, inputs, body)
    refused(case, 0, out, ranks, "topk_sliced")


@pytest.mark.parametrize("world,seed", IN_TURN)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_argmax_sliced(world: int, seed: int, keepdims: int) -> None:
    """ArgMax and ArgMin along the last axis of a slice of the heads (an attention sink's or a
    sparse indexer's pick per head), and along the first axis of a slice of the second, whose
    output moves down an axis without keepdims."""
    rng = rng_for(f"argmax_{keepdims}", world, seed)
    b, h, n = size(rng, 1, 3), world * size(rng, 1, 3), size(rng, 3, 6)
    inputs = {"p": ([b, h, n], shard(1))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> tuple[str, str]:
        last = g.op("ArgMax", x["p"], axis=-1, keepdims=keepdims)
        first = g.op("ArgMin", x["p"], axis=0, keepdims=keepdims)
        return g.output(last), g.output(first)

    case, _, _ = make(f"argmax_{keepdims}", world, inputs, body)
    out = witness(case, seed, "argmax_sliced")
    first = case.seq.model().graph.output[1].name
    assert {lay[1] for _, lay in out.relations_of(first) if lay != "rep"} == {keepdims}  # (axis 1 kept, or moved to 0)


@pytest.mark.parametrize("world", WORLDS)
def test_argmax_along_the_sliced_axis_is_refused(world: int) -> None:
    """Each rank's arg-max over its own heads is an index among its heads, not among all."""
    rng = rng_for("neg_argmax", world)
    t, h = size(rng, 2, 4), world * size(rng, 2, 3)
    inputs = {"p": ([t, h], shard(1))}

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        return g.output(g.op("ArgMax", x["p"], axis=1, keepdims=1))

    case, out, ranks = make("neg_argmax", world, inputs, body)
    refused(case, 0, out, ranks, "argmax_sliced")


@pytest.mark.parametrize("world,bug", list(zip(WORLDS, ("no_swap", "kc_order", "scrambled"))) + [(2, "kc_order")])
def test_wrong_dispatch_is_refused(world: int, bug: str) -> None:
    """The dispatch's regroup without the swap, with the blocks split [C, K] instead of [K, C],
    or the all-to-all over a scrambled group: the rows are not the rank's experts' tokens."""
    c, l, rest = shapes("neg_dispatch", world, 0)
    c = world + 1  # C > 1 and C != K: else the [K, C] and [C, K] views index alike
    inputs = {"x": ([world * c, world * l, *rest], shard(1))}
    group = list(range(world)) if bug != "scrambled" else [*range(1, world), 0]

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(g.op("Neg", x["x"]))
        t = regroup(g, a2a(g, x["x"], group), world, c, l, rest, swap=bug != "no_swap",
                    order="ck" if bug == "kc_order" else "kc")
        return g.output(g.coll("AllGather", g.op("Neg", t), list(range(world)), axis=0))

    case, out, ranks = make("neg_dispatch", world, inputs, body)
    refused(case, 0, out, ranks, "all_to_all_dispatch")


@pytest.mark.parametrize("world,bug", list(zip(WORLDS, ("no_swap", "kc_order", "scrambled"))) + [(2, "kc_order")])
def test_wrong_combine_is_refused(world: int, bug: str) -> None:
    """The combine without regrouping by destination (BUGS.md class 12's wrong indices), with the
    view split the wrong way round, or over a scrambled group: a rank's rows are not its tokens'."""
    c, l, rest = shapes("neg_combine", world, 0)
    c, l = world + 1, l + 1  # C != K, L > 1: else the wrong views index alike
    inputs = {"y": ([world * c, world * l, *rest], shard(0))}
    group = list(range(world)) if bug != "scrambled" else [*range(1, world), 0]

    def body(g: Graph, x: dict[str, str], r: int | None) -> str:
        if r is None:
            return g.output(g.op("Neg", x["y"]))
        u = ungroup(g, x["y"], world, c, l, rest, swap=bug != "no_swap", order="kc" if bug == "kc_order" else "ck")
        return g.output(g.coll("AllGather", g.op("Neg", a2a(g, u, group)), list(range(world)), axis=1))

    case, out, ranks = make("neg_combine", world, inputs, body)
    refused(case, 0, out, ranks, "all_to_all_combine")


# ============================================================================================
# The grouped MoE block
# ============================================================================================


def test_grouped_moe_equals_dense_dispatch_and_hf() -> None:
    """GroupedMoE (stacked experts, every token to every expert, routing-weighted sum) computes
    what DenseDispatchMoE and HF's MixtralSparseMoeBlock compute on the same weights."""
    torch = pytest.importorskip("torch")
    from refine.exporters.zoo import models as zoo
    from refine.exporters.strategies.expert import GroupedMoE
    from refine.exporters.zoo.moe import DenseDispatchMoE

    torch.manual_seed(3)
    hf = zoo._hf_class("mixtral")(zoo._hf_config("mixtral", zoo.zoo_config("mixtral", "tiny", 1))).eval()
    zoo._perturb(hf, 3)
    block = hf.model.layers[0].mlp
    dense = DenseDispatchMoE.from_hf(block).eval()
    grouped = GroupedMoE.from_dense(dense).eval()
    x = torch.randn(3, 5, dense.gate.in_features)
    with torch.no_grad():
        theirs = block(x)
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        assert torch.allclose(dense(x), theirs, atol=1e-5)
        assert torch.allclose(grouped(x), dense(x), atol=1e-5)


# ============================================================================================
# The EP export (exporters/strategies/expert.py) through the CLI
# ============================================================================================

EXPORTS = {"ep2": None, "global_ids": "ep_global_expert_ids", "combine": "ep_combine_wrong_indices",
           "tokens": None, "expert_order": "ep_combine_expert_order"}


@pytest.fixture(scope="module")
def ep_dir(tmp_path_factory):
    """name -> the Mixtral tiny (1 layer) EP 2 export of that name (EXPORTS: its bug, if any),
    made through the CLI (`refine export --ep 2 [--bug B]`, which must exit 0; the correct one
    with --check, which compares the programs with torch); `tokens`, the stock twin weighing on
    the tokens' side (the CLI has no option for it), through refine.exporters.strategies.expert."""
    pytest.importorskip("torch")

    def export(name: str, out: Path) -> None:
        if name == "tokens":
            from refine.exporters.strategies.expert import export_expert_parallel

            export_expert_parallel("mixtral", "tiny", 2, out, layers=1, weigh="tokens")
            return
        extra = ("--bug", EXPORTS[name]) if EXPORTS[name] else ("--check",)
        result = invoke("export", "--model", "mixtral", "--config", "tiny", "--layers", "1", "--ep", "2", *extra,
                        "--out", out)
        assert result.exit_code == 0, result.output
        if EXPORTS[name] is None:
            assert "check: PASSED" in result.output, result.output

    return exports_on_first_use(tmp_path_factory.mktemp("expert"), export)


def test_refine_json_declares_experts_and_tokens_split(ep_dir) -> None:
    """input_ids split by batch rows, the logits too; every stacked expert weight sharded along
    the experts; the router and everything else replicated; two all-to-alls and one all-gather
    per MoE block."""
    out = ep_dir("ep2")
    config = json.loads((out / "refine.json").read_text())
    assert config["world_size"] == 2
    assert config["inputs"]["input_ids"] == {"layout": "shard", "axis": 0, "range": [0, 128]}
    assert config["outputs"] == {"logits": {"layout": "shard", "axis": 0}}
    experts = {k: v for k, v in config["inputs"].items() if k.split(".")[-1] in ("w1", "w2", "w3")}
    assert sorted(experts) == [f"model.layers.0.mlp.{w}" for w in ("w1", "w2", "w3")]
    assert all(v == {"layout": "shard", "axis": 0} for v in experts.values())
    assert config["inputs"]["model.layers.0.mlp.gate.weight"] == {"layout": "rep"}
    assert all(v == {"layout": "rep"} for k, v in config["inputs"].items() if k not in experts and k != "input_ids")
    from refine.exporters.capture.export import op_counts
    import onnx

    counts = op_counts(onnx.load(str(out / "rank1.onnx")))
    assert (counts["dist.AllToAll"], counts["dist.AllGather"]) == (2, 1)


# the tokens'-side pair (its stock twin and ep_combine_expert_order) only under benchmarks/sweep.py:
# two more exports, about 25 s of CPU
SWEEP_ONLY = pytest.mark.skipif(not SWEEP, reason="sweep only (REFINE_TEST_SWEEP=1): the tokens'-side twins, the "
                                                  "combine twin (class 12 at another node: global_ids runs by default)")


@pytest.mark.parametrize("name", ["ep2", pytest.param("tokens", marks=SWEEP_ONLY)])
def test_expert_parallel_mixtral_verifies(ep_dir, name: str) -> None:
    """Both weightings: on the experts' side (routing columns of the all-gathered matrix picked by
    global expert id) and on the tokens' side (the combined outputs, in group order)."""
    result = invoke("verify", ep_dir(name))
    assert result.exit_code == 0, result.output
    assert "VERIFIED" in result.output.splitlines()[0]
    assert "logits = concat(r0..r1:logits, axis=0)" in result.output


@pytest.mark.parametrize("name,node,line", [
    ("global_ids", "mlp/Transpose", "y = y * weights.t().unsqueeze(-1)"),
    pytest.param("combine", "mlp/ReduceSum_2", "return y.sum(dim=0).view(b, s, h)", marks=SWEEP_ONLY),
    pytest.param("expert_order", "mlp/Transpose", "y = y * weights.t().unsqueeze(-1)", marks=SWEEP_ONLY),
])
def test_expert_parallel_bug_twin_refuted(ep_dir, tmp_path: Path, name: str, node: str, line: str) -> None:
    """Refuted (exit 1) by a counterexample; the first failure is, in layer 0's MoE block, the
    routing columns' transpose (the ranks took the wrong columns, or put them in the wrong order)
    or the sum over the experts (the ranks got other ranks' rows back), at the sequential line
    that computes it, its rank nodes at lines of exporters/strategies/expert.py."""
    report = tmp_path / "report.json"
    result = invoke("verify", ep_dir(name), "--json", report)
    assert result.exit_code == 1, result.output
    assert "REFUTED" in result.output.splitlines()[0]
    assert "counterexample" in result.output
    failure = json.loads(report.read_text())["failure"]
    assert failure["node"].endswith(node) and failure["node"].startswith("model.layers.0"), failure["node"]
    assert failure["location"]["file"] == EXPERT_PY
    source = Path(EXPERT_PY).read_text().splitlines()
    assert source[failure["location"]["line"] - 1].strip().startswith(line)
    sites = {(n["location"]["file"], n["location"]["line"]) for n in failure["rank_nodes"]}
    assert sites and all(file == EXPERT_PY for file, _ in sites), sites


@SWEEP_ONLY
def test_expert_parallel_over_four_ranks(tmp_path) -> None:
    """EP 4 on a batch of 4 rows (one expert per rank): matches torch and verifies."""
    import refine.exporters
    from refine.exporters.strategies.expert import build, export_expert_parallel

    out = tmp_path / "ep4"
    export_expert_parallel("mixtral", "tiny", 4, out, layers=1, batch=4)
    checked = refine.exporters.check(out, build("mixtral", "tiny", layers=1))
    assert checked.ok, checked.render()
    result = invoke("verify", out)
    assert result.exit_code == 0, result.output
    assert "logits = concat(r0..r3:logits, axis=0)" in result.output


@SWEEP_ONLY
def test_expert_parallel_at_llama3_8b_sizes_on_the_meta_device(tmp_path) -> None:
    """`refine export --ep 2 --meta` at Llama-3-8B sizes (4 experts of 14336), 2 layers: no weight
    data, the stacked expert weights declared sharded along the experts; verifies."""
    out = tmp_path / "meta"
    result = invoke("export", "--model", "mixtral", "--config", "llama3-8b", "--layers", "2", "--ep", "2", "--meta",
                    "--out", out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "refine.json").read_text())
    assert config["inputs"]["model.layers.1.mlp.w2"] == {"layout": "shard", "axis": 0}
    result = invoke("verify", out)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("args,words", [
    (("--ep", "1"), "at least 2 ranks"),
    (("--ep", "3"), "does not divide the batch"),
    (("--ep", "2", "--cp", "2"), "--cp and --ep together"),
    (("--ep", "2", "--tp", "2", "--train"), "no --sp or --train yet"),
    (("--ep", "2", "--tp", "3"), "not divisible by --tp 3"),
    (("--ep", "2", "--bug", "nope"), "unknown expert-parallel bug 'nope'"),
    (("--ep", "2", "--train"), "forward only"),
    (("--ep", "2", "--meta", "--check"), "drop one of them"),
    (("--ep", "2", "--config", "llama3-8b"), "export it with --meta"),
])
def test_bad_expert_parallel_options_exit_2_with_one_line(tmp_path, args: tuple[str, ...], words: str) -> None:
    assert_export_refused(tmp_path / "out", words, "--model", "mixtral", "--config", "tiny", *args)


def test_expert_parallelism_is_for_mixtral_only(tmp_path) -> None:
    assert_export_refused(tmp_path / "out", "mixtral only", "--model", "llama", "--config", "tiny", "--ep", "2")
