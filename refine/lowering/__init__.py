"""Lowering: a model directory (seq.onnx, rank*.onnx, refine.json) -> facts (refine/lowering/facts.py).

One home for the whole step, in the order the data flows:

- `load`: read and cross-check every file (one InputError naming the file per problem); the
  graph ids `seq` and `r<k>`; layer functions inlined, or kept for memoization.
- `canonical`, `cse`: rewrites before lowering (Gemm -> MatMul/Add, ...; each repeated
  computation once), so lemmas see one spelling.
- `shapes`: every shape inferred (strict ONNX inference, the `dist` shape rules, folded static
  values), the model's own annotations only checked against it, never adopted.
- `fold`: the values of static tensors (masks, position ids, reshape targets).
- `graphs`: one graph -> facts (nodes, edges, shapes, constants, locations), and the declared
  relations of refine.json.
- `layers`: layer functions (calls, inlining, canonical hashes of bodies).
- `program`: a whole model directory -> a `Program` (the main facts, and one fact set per
  distinct layer template), and the facts directories it is written to and read from.

The memoized run that consumes templates and call sites is refine/run/memo.py.
"""
