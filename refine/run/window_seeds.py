"""Which chunks to seed before solving again (rules/windows.lp `window_need`; refine/run/engine.py).

A reduce-scatter hands out chunks of a sequential tensor that no flow made (the keys' and
values' gradients of context parallelism, scattered back into sequence windows). The library
asks for them (`window_need(S, A, N)`: the chunks of S along axis A in N pieces) and the engine
solves again with them as `window_seed` facts, given before grounding so that the library stays
stratified.

A stack of layers asks layer by layer: layer k's scatter is reached only once layer k+1's chunks
exist, so a flat step of L layers would solve L + 1 times. The need of one layer predicts its
analogues: the same tensor of every other layer of the same ModuleList (its module path with
another index, `model.layers.1.self_attn (backward)/MatMul` -> `model.layers.0.self_attn
(backward)/MatMul`), where that tensor exists. They are seeded at once.

Seeding is definitional, whichever tensors are seeded: a seed only names the chunks of S as
virtual tensors (rules/windows.lp), and every relation of a chunk is still derived by the
lemmas. A seed no layer needs costs its chunks' bookkeeping and nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

# a ModuleList index in a module path: `.3.` or `.3 ` (before ` (backward)`) or `.3/` (an op)
_INDEX = re.compile(r"\.(\d+)(?=[. /])")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')

Need = tuple[str, ...]  # (tensor, axis, pieces) as clingo text


def analogues(need: Need, tensors: Collection[str]) -> list[Need]:
    """`need` for the same tensor of the other layers of its stack (module doc): every tensor
    name in it (clingo string literals in `need[0]`, a tensor or a window of one) with its first
    layer index replaced by another, where every renamed tensor is in `tensors` (clingo string
    literals of the sequential program's tensors)."""
    literals = list(_QUOTED.finditer(need[0]))
    spots = [_INDEX.search(m.group(0)) for m in literals]
    if not literals or any(s is None for s in spots) or len({s.group(1) for s in spots}) != 1:  # type: ignore[union-attr]
        return []
    first, spot = literals[0].group(0), spots[0]
    shape = re.compile(re.escape(first[:spot.start(1)]) + r"(\d+)" + re.escape(first[spot.end(1):]))  # type: ignore[union-attr]
    out = []
    for other in sorted({m.group(1) for t in tensors if (m := shape.fullmatch(t))} - {spot.group(1)}):  # type: ignore[union-attr]
        renamed = [m.group(0)[:s.start(1)] + other + m.group(0)[s.end(1):] for m, s in zip(literals, spots)]  # type: ignore[union-attr]
        if not all(r in tensors for r in renamed):
            continue
        text, shift = need[0], 0
        for m, r in zip(literals, renamed):
            text = text[:m.start() + shift] + r + text[m.end() + shift:]
            shift += len(r) - (m.end() - m.start())
        out.append((text, *need[1:]))
    return out


def window_seeds(needs: Iterable[Need], seeded: set[Need], tensors: Collection[str]) -> list[str]:
    """`window_seed` facts for the needed chunks not seeded yet and their analogues in the other
    layers (`analogues`), from the needs' clingo text; `seeded` is updated."""
    out = []
    for need in needs:
        for key in (need, *analogues(need, tensors)):
            if key not in seeded:
                seeded.add(key)
                out.append(f"window_seed({','.join(key)}).")
    return out
