"""Diagnose: what a fixpoint says, and what the numbers say.

- `diagnosis`: the verdict, the reconstructions and the first failure, read off the fixpoint
  into the report's schema; `index` the facts it reads, indexed; `plain` the failure in plain
  words (a bug class of docs/bugs.md); `closest` the lemma that came closest; `schedule` whether
  the ranks' calls can run together and are matched as the proof matched them.
- `simulate`: the multi-rank reference executor; `counterexample` a numeric counterexample
  for a failed proof; `reduced` that search on a smaller export of a too-big model; `witness`
  every derived relation checked on simulated values.

May import: refine's base modules, refine.lowering, refine.run, refine.report.
"""
