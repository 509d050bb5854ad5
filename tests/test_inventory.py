"""Inventories that must stay in step: every lemma has a numeric witness test, the declared
input relations match the facts schema, and the schema page for rule authors is current."""

from __future__ import annotations

import re
from pathlib import Path

from harness import lemma_names_in_rules
from refine.run.engine import builtin_rules_dir
from refine.lowering.facts import NOT_FOR_RULES, SCHEMA, schema_markdown

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def test_every_lemma_has_a_witness_test():
    """A lemma name must be asserted (as a quoted string) in a witness test module; those
    modules assert that the lemma fired and that everything it derived held numerically."""
    # (expert parallelism's witnesses live with its exporter's tests: they share the regrouping views)
    witness_text = "\n".join(p.read_text() for p in [*TESTS.glob("test_lemmas_*.py"), TESTS / "test_expert.py"])
    lemmas = lemma_names_in_rules()
    assert len(lemmas) > 30
    missing = sorted(name for name in lemmas if not re.search(rf"[\"']{name}[\"']", witness_text))
    assert not missing, f"lemmas without a witness test: {missing}"


def test_decls_match_schema():
    text = (builtin_rules_dir() / "decls.lp").read_text()
    declared = set(re.findall(r"^#defined (\w+)/(\d+)\.", text, flags=re.M))
    assert declared == {(r.name, str(r.arity)) for r in SCHEMA if r.name not in NOT_FOR_RULES}


def test_schema_page_is_current():
    page = (REPO / "docs" / "facts.md").read_text()
    assert schema_markdown() in page, "docs/facts.md is stale: paste refine.lowering.facts.schema_markdown()"


def test_facts_render_to_clingo_and_back_unchanged(tmp_path):
    """Ids may hold any character an ONNX name can (quotes, backslashes, newlines, tabs):
    each relation's rendering must give clingo exactly the values of the row, and a facts
    directory must read back as written."""
    import clingo

    from refine.lowering.facts import FactSet, read_facts_dir, to_clingo_lines, write_facts_dir

    odd = ['plain', 'with "quotes"', 'back\\slash', 'new\nline', 'tab\there', 'ünï/cødé:0', '\\"', '']
    facts = FactSet()
    for k, name in enumerate(odd):
        facts.add("node_in", "r1", f"r1:{name}", k, f"r1:t{name}")
        facts.add("input_rel", f"seq:{name}", f"r1:{name}", f"sl({k},0,{k + 1})")
    ctl = clingo.Control(["--warn=none"])
    ctl.add("base", [], "\n".join(to_clingo_lines(facts)))
    ctl.ground([("base", [])])

    def rows(name: str, arity: int) -> set[tuple]:
        return {tuple(a.number if a.type == clingo.SymbolType.Number else a.string if a.type == clingo.SymbolType.String
                      else str(a) for a in atom.symbol.arguments)
                for atom in ctl.symbolic_atoms.by_signature(name, arity)}

    assert rows("node_in", 4) == set(facts.rows["node_in"])
    assert rows("input_rel", 3) == set(facts.rows["input_rel"])
    write_facts_dir(facts, tmp_path)
    assert read_facts_dir(tmp_path).rows == facts.rows
