"""Two-dim shards (refine.json `then`): a tensor split over two mesh dims, the chunk of one dim
split again over the other (the sequence over cp and the vocabulary over tp; a batch over dp and
a weight's columns over tp). Lowering states the rank's piece as a slice of a window of the
sequential program (rules/windows.lp: input_chunk_rel / output_chunk_rel), so the TP lemmas meet
it on the window as they meet a DP x TP rank's.

Witnesses on a (dp, tp) mesh in both dim orders, random sizes: every derived relation holds in
the simulator, the verdict is VERIFIED; the negatives (an all-reduce over the wrong mesh dim, the
inner pieces swapped) are not verified, and the simulator and --check cut and rebuild two-dim
shards as lowering states them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import Case, Graph, rep, run_case, simulate
from refine.config import ModelConfig
from refine.diagnose.simulate import cut_two_dim, rebuild_two_dim
from test_lemmas_backward import dim, rng_for
from test_lemmas_windows import MESHES, Mesh, witness

Piece = tuple[list[int], dict]


def two_dim(axis: int, then_axis: int, first: str = "dp", second: str = "tp") -> dict:
    return {"layout": "shard", "axis": axis, "over": first, "then": {"axis": then_axis, "over": second}}


def local(shape: list[int], layout: dict, mesh: Mesh) -> list[int]:
    """A rank's shape under a rep, a one-dim shard over a mesh dim, or a two-dim shard."""
    out = list(shape)
    if layout["layout"] != "shard":
        return out
    size = {"dp": mesh.dp, "tp": mesh.tp}
    out[layout["axis"]] //= size[layout["over"]]
    if "then" in layout:
        out[layout["then"]["axis"]] //= size[layout["then"]["over"]]
    return out


def case_of(name: str, mesh: Mesh, inputs: dict[str, Piece], body, outputs: dict[str, dict]) -> Case:
    seq = Graph()
    y = body(seq, {n: seq.input(n, s) for n, (s, _) in inputs.items()}, None)
    ranks = []
    for r in range(mesh.world):
        g = Graph()
        body(g, {n: g.input(n, local(s, lay, mesh)) for n, (s, lay) in inputs.items()}, r)
        ranks.append(g)
    return Case(name, seq, ranks, {n: lay for n, (_, lay) in inputs.items()}, outputs={y: outputs["y"]}, mesh=mesh.json())


def row_parallel(mesh: Mesh, seed: int, reduce_over: str = "tp") -> Case:
    """y = x @ w: x [b, h] split by rows over dp, each row chunk's columns over tp; w [h, f] split
    by rows over tp (row-parallel): each rank's product a partial sum of its row chunk's, all-reduced
    over `reduce_over`; y split by rows over dp."""
    rng = rng_for("two_dim_row_parallel", seed)
    b, h, f = mesh.dp * dim(rng, 1, 2), mesh.tp * dim(rng, 1, 2), dim(rng, 2, 4)
    inputs = {"x": ([b, h], two_dim(0, 1)), "w": ([h, f], {"layout": "shard", "axis": 0, "over": "tp"})}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = g.op("MatMul", x["x"], x["w"])
        return g.output(y if r is None else g.coll("AllReduce", y, mesh.group(r, reduce_over)))

    return case_of(f"two_dim_row_parallel-{seed}-{reduce_over}", mesh, inputs, body,
                   {"y": {"layout": "shard", "axis": 0, "over": "dp"}})


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES)
def test_two_dim_input_through_a_row_parallel_matmul(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """Each rank's x is a column slice of its DP row's window: the TP lemmas meet it there."""
    witness(row_parallel(Mesh(dims, dp, tp), seed), seed, "declared", "matmul_row_parallel", "allreduce_sum",
            "unwindow")


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES[:2])
def test_two_dim_input_reduced_over_the_wrong_dim_is_refused(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """The partial products all-reduced over the DP group (class 11): not verified."""
    out = run_case(row_parallel(Mesh(dims, dp, tp), seed, reduce_over="dp"), seed)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"


def elementwise(mesh: Mesh, seed: int, output: dict | None = None) -> Case:
    """y = tanh(x), x a two-dim shard (rows over dp, then columns over tp), y declared as
    `output` (default: the same two-dim shard)."""
    rng = rng_for("two_dim_elementwise", seed)
    b, h = mesh.dp * dim(rng, 1, 2), mesh.tp * dim(rng, 1, 2)
    inputs = {"x": ([b, h], two_dim(0, 1))}

    def body(g: Graph, x: dict, r: int | None) -> str:
        return g.output(g.op("Tanh", x["x"]))

    return case_of(f"two_dim_elementwise-{seed}", mesh, inputs, body, {"y": output or two_dim(0, 1)})


@pytest.mark.parametrize("dims,dp,tp,seed", MESHES)
def test_two_dim_output(dims: tuple[str, str], dp: int, tp: int, seed: int) -> None:
    """An elementwise op keeps the two-dim shard: the output declared so is rebuilt."""
    witness(elementwise(Mesh(dims, dp, tp), seed), seed, "declared", "elementwise")


def test_two_dim_output_split_in_the_other_order_is_refused() -> None:
    """The output declared with its rows over tp and then its columns over dp, where each rank
    holds its rows over dp and columns over tp (same shapes on a 2 x 2 mesh): the off-diagonal
    ranks hold other pieces, so it is not verified."""
    case = elementwise(Mesh(("dp", "tp"), 2, 2), 3, output=two_dim(0, 1, first="tp", second="dp"))
    out = run_case(case, 3)
    assert out.checked.ok, out.checked.violations
    assert out.report.verdict != "verified"
    sim = simulate(case, 3)
    assert not np.allclose(sim.ranks[1][case.ranks[1].outputs[0]], sim.ranks[2][case.ranks[2].outputs[0]])


def test_simulator_cuts_and_rebuilds_two_dim_shards() -> None:
    """cut_two_dim gives rank (dp=k, tp=j) chunk j along axis 1 of chunk k along axis 0, and
    rebuild_two_dim puts every plane's pieces back (here one plane: the whole mesh)."""
    mesh = Mesh(("dp", "tp"), 2, 3)
    config = ModelConfig.model_validate({"world_size": 6, "mesh": mesh.json(), "inputs": {"x": two_dim(0, 1)},
                                         "outputs": {}})
    value = np.arange(4 * 6).reshape(4, 6)
    parts = cut_two_dim(config.inputs["x"], value, config)
    assert parts[0].tolist() == [[0, 1], [6, 7]] and parts[5].tolist() == [[16, 17], [22, 23]]
    ((ranks, whole),) = rebuild_two_dim(config.inputs["x"], dict(enumerate(parts)), config)
    assert ranks == list(range(6)) and np.array_equal(whole, value)


@pytest.mark.parametrize("bad, words", [
    ({"layout": "shard", "axis": 0, "then": {"axis": 1, "over": "tp"}}, "splits over two different mesh dims"),
    ({"layout": "shard", "axis": 0, "over": "dp", "sizes": [1, 3], "then": {"axis": 1, "over": "tp"}}, "no sizes or stride"),
    ({"layout": "partial", "over": "dp", "then": {"axis": 1, "over": "tp"}}, "not taken in refine.json yet"),
    ({"layout": "shard", "axis": 0, "over": "tp", "then": {"axis": 1, "over": "tp"}}, "two different mesh dims"),
    ({"layout": "shard", "axis": 0, "over": "dp", "then": {"axis": 1, "over": "pp"}}, "names none of"),
])
def test_bad_two_dim_layouts_are_one_line(tmp_path, bad: dict, words: str) -> None:
    from harness import invoke

    case = elementwise(Mesh(("dp", "tp"), 2, 2), 0)
    path = case.save(tmp_path / "m")
    config = json.loads((path / "refine.json").read_text())
    config["inputs"]["x"] = bad
    (path / "refine.json").write_text(json.dumps(config))
    result = invoke("verify", str(path))
    assert result.exit_code == 2 and words in result.output, result.output


# --- a slice of a summand, reduced off the sliced axis (rules/reduce.lp reduce_linear) ------------

def sliced_summand(world: int, seed: int, reduce_axis: int = 0) -> tuple[Case, str]:
    """Rank r: its term of x @ w (the contraction split over the ranks: a summand), the first half
    of its columns, summed over `reduce_axis` (keepdims), all-reduced: the first half of the columns
    of the sequential sum over that axis (a CP rank's K/V gradient term, a TP rank's heads of it,
    summed over the query heads of a key/value head)."""
    from test_lemmas_structure import In, make_case, size

    rng = rng_for("sliced_summand", world, seed)
    n, k, f = size(rng, 2, 4), world * size(rng, 1, 2), 2 * size(rng, 1, 3)
    inputs = {"x": In([n, k], {"layout": "shard", "axis": 1}), "w": In([k, f], {"layout": "shard", "axis": 0})}

    def body(g: Graph, x: dict, r: int | None) -> str:
        y = g.op("MatMul", x["x"], x["w"])
        if r is None:
            return g.output(g.op("Slice", g.op("ReduceSum", y, g.ints([reduce_axis]), keepdims=1), g.ints([0]),
                                 g.ints([f // 2]), g.ints([1])))
        half = g.op("Slice", y, g.ints([0]), g.ints([f // 2]), g.ints([1]))
        return g.output(g.coll("AllReduce", g.op("ReduceSum", half, g.ints([reduce_axis]), keepdims=1), list(range(world))))

    case, y, _ = make_case(f"sliced_summand-{world}-{seed}-{reduce_axis}", world, inputs, body)
    case.outputs = {y: rep()}
    return case, y


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
def test_slice_of_a_summand_reduced_off_the_sliced_axis(world: int, seed: int) -> None:
    """The rank's column slice of its summand, summed over the rows, is the same columns of its
    summand of the row sum (reduce_linear's psl clause); the all-reduce adds the summands up."""
    from test_lemmas_structure import witness as structure_witness

    case, _y = sliced_summand(world, seed)
    structure_witness(case, seed, "reduce_linear:psl", "allreduce_slices")


def test_slice_of_a_summand_reduced_along_the_sliced_axis_is_refused() -> None:
    """Summing over the sliced columns themselves: half the columns' sum is no slice of the whole
    sum, so the clause must not fire (and the sequential program differs: not verified)."""
    from test_lemmas_structure import refused

    case, y = sliced_summand(2, 4, reduce_axis=1)
    refused(case, 4, y, y, [g.outputs[0] for g in case.ranks])


def test_undeclared_outputs_are_rebuilt_along_two_mesh_dims() -> None:
    """The counterexample search tries, for an output refine.json leaves open on a mesh of
    several dims, a sum over one mesh dim of the concatenations over another (a TP shard's
    gradient left partial over CP), and a sum over one dim copied over the other: a correct
    program's pieces are found, not taken for a counterexample."""
    from refine.diagnose.counterexample import _errors, _every_rank_candidates

    config = ModelConfig.model_validate({"world_size": 4, "mesh": {"shape": [2, 2], "dims": ["cp", "tp"]},
                                         "inputs": {}, "outputs": {}})
    rng = np.random.default_rng(0)
    whole = rng.standard_normal((6, 4))
    summands = [rng.standard_normal((6, 4)), None]
    summands[1] = whole - summands[0]
    # rank (cp k, tp j): rows j of summand k (partial over cp, then a shard over tp along axis 0)
    own = [(f"r{r}:g", summands[r // 2][3 * (r % 2):3 * (r % 2) + 3]) for r in range(4)]
    best = min(_errors(whole, c.value)[0] for c in _every_rank_candidates(whole, own, config) if c.value.shape == whole.shape)
    assert best < 1e-9
    # summand k on both TP ranks of cp k (partial over cp, copied over tp)
    copies = [(f"r{r}:g", summands[r // 2]) for r in range(4)]
    best = min(_errors(whole, c.value)[0] for c in _every_rank_candidates(whole, copies, config) if c.value.shape == whole.shape)
    assert best < 1e-9
