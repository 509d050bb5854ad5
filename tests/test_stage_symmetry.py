"""Stage symmetry (refine/run/stage_symmetry.py): a later pipeline stage's layer template is the
first stage's on other ranks, recognised by renaming its facts exactly, and its keys are solved
as the first stage's.

The witness is exactness: on a PP 3 x TP 2 training step (GPT-2, a layer per stage), every
summary the run reads off another template's solve is the summary the alias's own solve gives,
and the run solves fewer templates. Each refused case changes one fact of an alias template (a
constant, a wire, a size, a group, an op) and must break the alias.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from harness import invoke  # noqa: E402

from refine.config import Mesh  # noqa: E402
from refine.lowering.facts import FactSet  # noqa: E402
from refine.lowering.program import Program, lower_program  # noqa: E402
from refine.run.memo import run_program  # noqa: E402
from refine.run.stage_symmetry import Ids, Renaming, StageAliases, mesh_translation, renamed_signature  # noqa: E402


@pytest.fixture(scope="module")
def pp3(tmp_path_factory) -> Program:
    out = tmp_path_factory.mktemp("stage_symmetry") / "pp3"
    result = invoke("export", "--model", "gpt2", "--config", "tiny", "--pp", "3", "--tp", "2", "--layers", "3",
                    "--micro-batches", "2", "--train", "--out", out)
    assert result.exit_code == 0, result.output
    return lower_program(out)


def test_later_stages_are_solved_as_the_first(pp3: Program) -> None:
    """Stages 1 and 2 run stage 0's layer bodies on ranks moved by 2 and 4: their keys are solved
    once, as the earlier template's, and each summary read off that solve equals the alias's
    own solve's, entry for entry."""
    aliases = StageAliases(pp3)
    assert any(aliases.of(t) is not None for t in pp3.templates), "no template is another stage's"
    shared = run_program(pp3)
    alone = run_program(pp3, stage_symmetry=False)
    assert shared.aliased > 0 and alone.aliased == 0
    assert shared.template_solves < alone.template_solves, (shared.template_solves, alone.template_solves)
    assert shared.summaries.keys() == alone.summaries.keys()
    for pair, summary in alone.summaries.items():
        assert sorted(shared.summaries[pair]) == sorted(summary), pair
    assert not shared.derived.get("sanity") and not shared.derived.get("missing_call")


def _alias(program: Program) -> tuple[str, str]:
    aliases = StageAliases(program)
    found = next((t, aliases.of(t)) for t in program.templates if aliases.of(t) is not None)
    return found[0], found[1][0]


def _changed(facts: FactSet, relation: str, change) -> FactSet:
    copy = FactSet({name: list(rows) for name, rows in facts.rows.items()})
    rows = copy.rows[relation]
    i = next(i for i, row in enumerate(rows) if change(row) is not None)
    rows[i] = change(rows[i])
    return copy


def _rank_row(row: tuple) -> bool:
    return str(row[0]).startswith("r")


CHANGES = {
    # a constant's value on one rank
    "const": ("const", lambda row: (*row[:2], "0" * 16) if _rank_row(row) else None),
    # one wire: a node's input read from its other input's tensor
    "wire": ("node_in", lambda row: (*row[:3], f"{row[3]}#other") if _rank_row(row) and row[2] == 1 else None),
    # a tensor's size
    "dim": ("dim", lambda row: (*row[:3], row[3] + 1) if _rank_row(row) else None),
    # a collective's group in the other member order (the same sum, but not the same facts)
    "group": ("coll", lambda row: (*row[:3], ",".join(reversed(str(row[3]).split(","))), row[4])
              if "," in str(row[3]) and not str(row[3]).startswith("p2p") else None),
    # an op
    "op": ("node", lambda row: (*row[:2], "Sub") if _rank_row(row) and row[2] == "Add" else None),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_template_that_differs_in_one_fact_is_no_alias(pp3: Program, change: str) -> None:
    alias, target = _alias(pp3)
    relation, edit = CHANGES[change]
    templates = dict(pp3.templates)
    templates[alias] = _changed(pp3.templates[alias], relation, edit)
    assert StageAliases(Program(pp3.main, templates)).of(alias) is None


def test_mesh_translation_moves_every_rank_along_the_mesh() -> None:
    """pp x tp (3 x 2): stage 2's ranks {4, 5} onto stage 0's {0, 1}, every rank moved two stages
    back (cyclically); ranks that are no translate of the target's are refused; without a mesh,
    the world is one dim."""
    mesh = Mesh(shape=[3, 2], dims=["pp", "tp"])
    assert mesh_translation(mesh, [4, 5], [0, 1]) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert mesh_translation(mesh, [4, 5], [0, 2]) is None
    assert mesh_translation(mesh, [1, 3], [0, 2]) == {0: 1, 1: 0, 2: 3, 3: 2, 4: 5, 5: 4}
    assert mesh_translation(Mesh(shape=[4], dims=["world"]), [2, 3], [0, 1]) == {0: 2, 1: 3, 2: 0, 3: 1}


def test_renaming_moves_groups_channels_and_ids() -> None:
    ids = Ids(FactSet(), {r: r for r in range(4)})
    moved = Renaming({0: 2, 1: 3, 2: 0, 3: 1}, ids, ids)
    assert moved.group("0,1") == "2,3"
    assert moved.group("p2p:1>3#0") == "p2p:3>1#0"
    assert moved.group("0..3") == "2,3,0,1"
    assert moved.graph("r1") == "r3" and moved.graph("seq") == "seq"
    assert moved.text('sl(0,0,4)') == 'sl(0,0,4)'
    assert moved.text('psum(0,1,2,contract("r1:h/MatMul"))') is None  # (a rank id no renaming states)
    assert (renamed_signature("dist.AllReduce@1/1/1|group=0..3;reduce_op=sum", moved.ranks)
            == "dist.AllReduce@1/1/1|group=2,3,0,1;reduce_op=sum")
    assert renamed_signature("dist.Send@1/1/1|peer=1;tag=0", moved.ranks) == "dist.Send@1/1/1|peer=3;tag=0"
    assert renamed_signature("MatMul@13/2/1|", moved.ranks) == "MatMul@13/2/1|"

