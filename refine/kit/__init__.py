"""The rule authors' kit: lemmas listed, checked, witnessed; refine itself tested by mutation.

- `rulebook`: the lemma library read as data (`refine rules list/explain/coverage`).
- `cases`: witness cases: a tiny sequential program and its rank programs, run through
  lowering, the lemmas, the simulator and the numeric check of every derived relation.
- `rulecheck`: `refine rules check`: a rule file's lemmas checked on random cases.
- `mutation`: one-change mutants of correct model directories, judged by running them.

May import: refine's base modules, refine.lowering, refine.run, refine.diagnose,
refine.report, refine.pipeline (mutation), refine.batch.entries (rulebook's coverage).
"""
