"""Inventories that must stay in step: every lemma has a numeric witness test, the declared
input relations match the facts schema, and the schema page for rule authors is current."""

from __future__ import annotations

import re
from pathlib import Path

from harness import lemma_names_in_rules
from refine.engine import builtin_rules_dir
from refine.facts import SCHEMA, schema_markdown

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def test_every_lemma_has_a_witness_test():
    """A lemma name must be asserted (as a quoted string) in a witness test module; those
    modules assert that the lemma fired and that everything it derived held numerically."""
    witness_text = "\n".join(p.read_text() for p in TESTS.glob("test_lemmas_*.py"))
    lemmas = lemma_names_in_rules()
    assert len(lemmas) > 30
    missing = sorted(name for name in lemmas if not re.search(rf"[\"']{name}[\"']", witness_text))
    assert not missing, f"lemmas without a witness test: {missing}"


def test_decls_match_schema():
    text = (builtin_rules_dir() / "decls.lp").read_text()
    declared = set(re.findall(r"^#defined (\w+)/(\d+)\.", text, flags=re.M))
    assert declared == {(r.name, str(r.arity)) for r in SCHEMA}


def test_schema_page_is_current():
    page = (REPO / "docs" / "facts.md").read_text()
    assert schema_markdown() in page, "docs/facts.md is stale: paste refine.facts.schema_markdown()"
