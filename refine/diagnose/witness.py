"""Numeric witnesses: check derived relations against simulated values.

A relation rel(S, T, L) is a claim about values: for all inputs satisfying the declared
input relations, rank tensor T equals L applied to sequential tensor S. This module takes
one simulation (refine/diagnose/simulate.py) and checks every derived claim on it. A rep/slice/scaled
claim is checked per tensor; a partial claim only means something for a set of pieces, so
partials are checked on every tiling of [0, D) by pieces of one style (the reconstruction
the verifier would use), sampled when there are too many.

Lemma witness tests, the examples' tests and counterexamples all go through `check`.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from refine import layouts
from refine.dist import group_of_id
from refine.run.engine import Derived
from refine.diagnose.simulate import SimResult

MAX_TILINGS = 64


@dataclass
class Violation:
    """A derived relation that the numbers contradict."""

    seq_tensor: str
    rank_tensors: list[str]
    layout: str
    lemmas: list[str]
    max_abs_error: float


@dataclass
class CheckResult:
    """What was checked, what held, what did not."""

    checked: int = 0
    violations: list[Violation] = field(default_factory=list)
    unchecked: list[tuple[str, str, object]] = field(default_factory=list)  # partial pieces in no tiling
    lemmas_checked: set[str] = field(default_factory=set)

    @property
    def ok(self) -> bool:
        return not self.violations


def _value(sim: SimResult, tensor_id: object) -> np.ndarray | None:
    chunk = layouts.chunk_of(tensor_id)
    if chunk is not None:  # a batch chunk of a sequential tensor (rules/windows.lp)
        base, axis, k, n = chunk
        whole = _value(sim, base)
        if whole is None:
            return None
        size = whole.shape[axis] // n
        return np.take(whole, np.arange(k * size, (k + 1) * size), axis=axis)
    if layouts.term_of(tensor_id) is not None:  # a chunk's term of a sum: not simulated (its pieces are checked)
        return None
    graph, name = str(tensor_id).split(":", 1)
    values = sim.seq if graph == "seq" else sim.ranks[int(graph[1:])]
    v = values.get(name)
    return None if v is None else np.asarray(v, dtype=np.float64)


def view(layout: object, s: np.ndarray) -> np.ndarray | None:
    """The part of S a rank tensor with a per-tensor layout must equal (None for partials)."""
    k = layouts.kind(layout)
    if k == "rep":
        return s
    if k == "sl":
        _, axis, start, end = layout  # type: ignore[misc]
        return np.take(s, np.arange(start, end), axis=axis)
    if k == "blk":
        _, axis, inner, start, end = layout  # type: ignore[misc]
        shape = list(s.shape)
        blocks = s.reshape(shape[:axis] + [shape[axis] // inner, inner] + shape[axis + 1:])
        kept = np.take(blocks, np.arange(start, end), axis=axis + 1)
        return kept.reshape(shape[:axis] + [-1] + shape[axis + 1:])
    if k == "bc":  # constant along the axis: the first E indices stand for any E
        _, axis, size = layout  # type: ignore[misc]
        return np.take(s, np.arange(size), axis=axis)
    if k in ("ind", "off", "wnd"):  # values of an integer S (rules/values.lp)
        return value_view(layout, s)
    if k == "scaled":
        _, p, q, inner = layout  # type: ignore[misc]
        v = view(inner, s)
        return None if v is None else v * (p / q)
    return None


def value_view(layout: object, s: np.ndarray) -> np.ndarray:
    """T under a value layout: an elementwise function of S's values (rules/values.lp)."""
    k, *args = layout  # type: ignore[misc]
    if k == "off":
        return s - args[0]
    x, y, last = args
    inside = (s >= x) & (s < y)
    if k == "ind":
        return (inside == bool(last)).astype(np.float64)
    return np.where(inside, s - x, last)


def owned_view(layout: object, s: np.ndarray, t: np.ndarray, ids: np.ndarray | None) -> np.ndarray | None:
    """T under an ownership layout (rules/embedding.lp): S on the rows whose id (in `ids`, flat
    order, size(S) / size(ids) elements per id) lies in [X, Y); elsewhere T itself (own: no
    claim there) or 0 (msk)."""
    if ids is None or ids.size == 0 or s.size % ids.size or t.shape != s.shape:
        return None
    k, x, y, *_ = layout  # type: ignore[misc]
    owned = np.repeat(((ids >= x) & (ids < y)).reshape(-1), s.size // ids.size).reshape(s.shape)
    return np.where(owned, s, t if k == "own" else 0.0)


def _is_sort_key(ids: object) -> bool:
    return isinstance(ids, tuple) and len(ids) == 4 and ids[0] == "srt"


def _permutation(p: np.ndarray | None) -> np.ndarray | None:
    if p is None or p.ndim != 1:
        return None
    p = p.astype(np.int64)
    return p if np.array_equal(np.sort(p), np.arange(p.size)) else None


def sorted_view(layout: object, s: np.ndarray, t: np.ndarray, ids: np.ndarray | None, seq_perm: np.ndarray | None,
                rank_perm: np.ndarray | None) -> np.ndarray | None:
    """T under a layout keyed by a sort (rules/sorted_rows.lp): each side's rows (the leading
    axes, one row per route) are in the order of its own permutation; unsorted (row Pr[i] of the
    rank's is its row i, likewise for the sequential side) they relate by the layout keyed by the
    ids in route order, and the expected T is that sorted back by Pr.  swnd: S must be the ids
    sorted by Ps (else no T is expected) and T the rank's local ids of them sorted by Pr."""
    ps, pr = _permutation(seq_perm), _permutation(rank_perm)
    if ids is None or ps is None or pr is None or ps.size != pr.size or ids.size != ps.size or s.size % ps.size:
        return None
    k, *args = layout  # type: ignore[misc]
    flat_ids = ids.reshape(-1)
    if k == "swnd":
        if s.size != ps.size or not np.array_equal(s.reshape(-1), flat_ids[ps]):
            return None
        return value_view(("wnd", *args[:3]), flat_ids)[pr].reshape(t.shape)
    if t.shape != s.shape:
        return None
    s_rows, t_rows = s.reshape(ps.size, -1), t.reshape(pr.size, -1)
    s_unsorted, t_unsorted = np.empty_like(s_rows), np.empty_like(t_rows)
    s_unsorted[ps], t_unsorted[pr] = s_rows, t_rows
    expected = owned_view(layout, s_unsorted, t_unsorted, flat_ids)
    return None if expected is None else expected[pr].reshape(t.shape)


ROUTE_KEYS = ("xs", "xr", "rs", "pl")  # rules/exchanged_rows.lp, rules/placed_rows.lp


def _is_route_key(ids: object) -> bool:
    """A key naming the route each rank row holds: an exchange key, a route slice, a placement by
    the sequential sort, or a rank's sort of such rows (srt whose rows are a route key's)."""
    if not isinstance(ids, tuple) or not ids:
        return False
    return ids[0] in ROUTE_KEYS or (ids[0] == "srt" and len(ids) == 4 and _is_route_key(ids[1]))


def route_key_ids(key: tuple) -> object:
    """The sequential ids tensor a route key is a function of."""
    if key[0] in ("pl", "srt"):
        return route_key_ids(key[1])
    return key[2] if key[0] == "xr" else key[1]


def window_routes(window: object, n: int, size: int) -> np.ndarray | None:
    """The N routes of a rank's window (rules/exchanged_rows.lp): a slice starting at B, or a
    blocked window bk(P, Lo, Wb) (of each P routes, [Lo, Lo + Wb))."""
    if isinstance(window, tuple) and window and window[0] == "bk":
        period, lo, width = (int(v) for v in window[1:])
        j = np.arange(n)
        routes = (j // width) * period + lo + j % width
    else:
        routes = np.arange(int(window), int(window) + n)  # type: ignore[call-overload]
    return None if routes.size and (routes.max() >= size or routes.min() < 0) else routes


def member_window(family: object, member: int) -> tuple[object, int]:
    """Member J's window of a family (xr's): slices of N, J N; blocked windows bf(P, Wb, N), bk(P, J Wb, Wb)."""
    if isinstance(family, tuple) and family and family[0] == "bf":
        _, period, width, n = family
        return ("bk", int(period), member * int(width), int(width)), int(n)
    return member * int(family), int(family)  # type: ignore[call-overload]


def exchange_routes(key: tuple, ids: np.ndarray, rank: int, x: int, y: int) -> np.ndarray | None:
    """The route each row of a rank tensor holds under an exchange key (rules/exchanged_rows.lp),
    -1 for a row no route is claimed by: xs(R, B, N), the window B's routes (window_routes) in the
    stable ascending order of their ids; xr(Grp, R, F, C) on the member at position q of Grp
    (experts [x, y)), each member's sorted window's routes with ids in [x, y), in group order,
    padded to C; rs(R, B, N), the window's routes in order."""
    if key[0] in ("rs", "xs"):
        _, _, b, n = key
        routes = window_routes(b, int(n), ids.size)
        if routes is None or key[0] == "rs":
            return routes
        return routes[np.argsort(ids[routes], kind="stable")]
    _, group, _, family, c = key
    members = group_of_id(str(group))
    if rank not in members:
        return None
    blocks = []
    for s in range(len(members)):
        window, n = member_window(family, s)
        routes = exchange_routes(("xs", None, window, n), ids, rank, x, y)
        if routes is None:
            return None
        blocks.append(routes[(ids[routes] >= x) & (ids[routes] < y)])
    held = np.concatenate(blocks)
    if held.size > int(c):
        return None
    return np.concatenate([held, -np.ones(int(c) - held.size, dtype=held.dtype)])


def key_rows(key: tuple, ids: np.ndarray, rank: int, x: int, y: int,
             value: Callable[[object], np.ndarray | None]) -> tuple[np.ndarray, np.ndarray] | None:
    """(the route each rank row holds, -1 for none; the sequential row of each route) under a route
    key: an exchange key's routes in route order; pl(K, Ps) K's routes at the rows Ps^-1 puts them
    (the sequential tensor in Ps's sorted order); srt(K, Ps, Pr) K's routes taken at the rank's
    permutation Pr, placed by Ps (`value` reads a permutation's numbers)."""
    if key[0] in ("pl", "srt"):
        inner = key_rows(key[1], ids, rank, x, y, value)
        ps = _permutation(value(key[2]))
        if inner is None or ps is None or ps.size != ids.size:
            return None
        routes = inner[0]
        if key[0] == "srt":
            pr = _permutation(value(key[3]))
            if pr is None or pr.size != routes.size:
                return None
            routes = routes[pr]
        seq_row = np.empty_like(ps)
        seq_row[ps] = np.arange(ps.size)
        return routes, seq_row
    routes = exchange_routes(key, ids, rank, x, y)
    return None if routes is None else (routes, np.arange(ids.size))


def exchanged_view(layout: object, s: np.ndarray, t: np.ndarray, ids: np.ndarray | None, rank: int,
                   value: Callable[[object], np.ndarray | None] = lambda name: None) -> np.ndarray | None:
    """T under a layout keyed by the routes its rows hold (rules/exchanged_rows.lp, rules/
    placed_rows.lp): each claimed row of T (axis 0) is the sequential row of its route (own;
    msk: every other row 0, the rows past the received ones too), or, for swnd, wnd(X, Y, F) of
    its route's id, S being the ids in the key's sequential order."""
    k, x, y, *rest = layout  # type: ignore[misc]
    key = rest[-1]
    if ids is None or t.ndim == 0:
        return None
    flat_ids = ids.reshape(-1).astype(np.int64)
    found = key_rows(key, flat_ids, rank, int(x), int(y), value)
    # (in flat order, as every ownership layout: a row is a run of size / rows elements, so a view
    # that adds a leading axis of 1 keeps it; swnd holds one value a row)
    if found is None or not found[0].size or (t.size != found[0].size if k == "swnd" else t.size % found[0].size):
        return None
    routes, seq_row = found
    held = routes >= 0
    at = np.maximum(routes, 0)
    route_ids = np.where(held, flat_ids[at], -1)
    if k == "swnd":
        if s.size != flat_ids.size or not np.array_equal(s.reshape(-1)[seq_row], flat_ids):
            return None
        return np.where(held, value_view(("wnd", x, y, rest[0]), route_ids), t.reshape(-1)).reshape(t.shape)
    if s.size % flat_ids.size:
        return None
    s_rows, t_rows = s.reshape(flat_ids.size, -1), t.reshape(routes.size, -1)
    if s_rows.shape[1] != t_rows.shape[1]:
        return None
    owned = held & (route_ids >= x) & (route_ids < y)
    expected = np.where(owned[:, None], s_rows[seq_row[at]], t_rows if k == "own" else 0.0)
    return expected.reshape(t.shape)


def _close(a: np.ndarray, b: np.ndarray) -> tuple[bool, float]:
    if a.shape != b.shape:
        return False, float("inf")
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    return err <= 1e-4 * max(1.0, scale), err


def check(derived: Derived, sim: SimResult, seed: int = 0) -> CheckResult:
    """Check every derived relation numerically on one simulation."""
    result = CheckResult()
    lemmas_of: dict[tuple, list[str]] = defaultdict(list)
    for s, t, lay, lemma in derived.get("rel_by"):
        lemmas_of[(s, t, lay)].append(str(lemma))
    pieces: dict[tuple, dict[int, list[tuple[int, str]]]] = defaultdict(lambda: defaultdict(list))
    for s, t, lay in derived.get("rel"):
        t = str(t)
        k = layouts.kind(lay)
        scale = (1, 1)
        if k == "scaled" and layouts.kind(lay[3]) in ("psum", "psl"):  # c x a piece: the pieces sum to c S
            scale, lay = (int(lay[1]), int(lay[2])), lay[3]  # type: ignore[index]
            k = layouts.kind(lay)
        if k in ("psum", "pmax"):
            _, a, b, d, *style = lay  # type: ignore[misc]
            pieces[(s, k, d, str(style), None, scale)][a].append((b, t))
            continue
        if k == "psl":  # a slice of a partial-sum piece: checked with its fellow pieces
            _, c, x, y, a, b, d, style = lay  # type: ignore[misc]
            pieces[(s, "psum", d, str(style), (c, x, y), scale)][a].append((b, t))
            continue
        sv, tv = _value(sim, s), _value(sim, t)
        if sv is None or tv is None:
            result.unchecked.append((s, t, lay))
            continue
        # (an ownership layout's ids: a tensor, or a chunk of one, or a sort key of both sides' orders)
        if k in ("own", "msk", "swnd") and _is_route_key(lay[-1]):
            expected = exchanged_view(lay, sv, tv, _value(sim, route_key_ids(lay[-1])), int(t.split(":", 1)[0][1:]),
                                      lambda name: _value(sim, name))
        elif k in ("own", "msk", "swnd") and _is_sort_key(lay[-1]):
            expected = sorted_view(lay, sv, tv, *(_value(sim, t) for t in lay[-1][1:]))
        elif k in ("own", "msk"):
            expected = owned_view(lay, sv, tv, _value(sim, lay[-1]))
        else:
            expected = view(lay, sv)
        ok, err = _close(tv, expected) if expected is not None else (False, float("inf"))
        result.checked += 1
        lemmas = lemmas_of[(s, t, lay)]
        if ok:
            result.lemmas_checked.update(lemmas)
        else:
            result.violations.append(Violation(s, [t], layouts.text(lay), lemmas, err))
    rng = random.Random(seed)
    for (s, k, d, style, cut, (p, q)), edges in pieces.items():
        sv = _value(sim, s)
        if sv is not None and cut is not None:
            c, x, y = cut
            sv = np.take(sv, np.arange(x, y), axis=c)
        if sv is not None and (p, q) != (1, 1):
            sv = sv * (p / q)
        tilings = _tilings(edges, d, rng)
        used: set[str] = set()
        for tiling in tilings:
            vals = [_value(sim, t) for t in tiling]
            if sv is None or any(v is None for v in vals):
                continue
            combined = np.sum(vals, axis=0) if k == "psum" else np.max(vals, axis=0)
            ok, err = _close(combined, sv)
            result.checked += 1
            lemma_names = sorted({lm for t in tiling for key, lms in lemmas_of.items()
                                  if key[0] == s and key[1] == t and layouts.kind(key[2]) in (k, "psl", "scaled") for lm in lms})
            if ok:
                used.update(tiling)
                result.lemmas_checked.update(lemma_names)
            else:
                result.violations.append(Violation(s, list(tiling), f"{k} of {d} pieces ({style})", lemma_names, err))
        for start, ends in edges.items():
            for _end, t in ends:
                if t not in used:
                    result.unchecked.append((s, t, k))
    return result


def _tilings(edges: dict[int, list[tuple[int, str]]], total: int, rng: random.Random) -> list[tuple[str, ...]]:
    """Paths of pieces [0,e1),[e1,e2),...,[.,total); all of them, or a sample of MAX_TILINGS."""
    paths: list[tuple[str, ...]] = []

    def walk(pos: int, acc: tuple[str, ...]) -> None:
        if len(paths) >= MAX_TILINGS * 8:
            return
        if pos == total:
            paths.append(acc)
            return
        for end, t in edges.get(pos, []):
            if end > pos:
                walk(end, acc + (t,))

    walk(0, ())
    if len(paths) > MAX_TILINGS:
        paths = rng.sample(paths, MAX_TILINGS)
    return paths
