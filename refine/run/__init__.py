"""Run: the lemma library over a lowered program, to its fixpoint.

- `engine`: the only module that imports clingo for solving: facts + rules/*.lp -> the derived
  relations (`Derived`), and where the built-in and user rule files are.
- `memo`: the memoized run of a function-form program (docs/layers.md): each distinct layer
  template solved once per key, its summary carried to every call site.
- `template_solves`: `refine verify --jobs N`: template solves ahead in worker processes.

May import: refine's base modules (errors, config, dist, layouts) and refine.lowering.
"""
