"""Layout terms as Python sees them (tuples from the engine) and how people read them.

The engine returns clingo terms as tuples: `"rep"`, `("sl", axis, start, end)`,
`("blk", axis, inner, start, end)`, `("bc", axis, size)`,
`("psum", a, b, d, style)`, `("pmax", a, b, d, style)`, `("scaled", p, q, inner)`, and the value
layouts `("ind", x, y, inside)`, `("off", c)`, `("wnd", x, y, fill)`, and the ownership layouts
`("own", x, y, d, ids)`, `("msk", x, y, ids)` (rules/embedding.lp), and for the diagnosis a
relation of a batch chunk (rules/windows.lp) read as one of its real tensor:
`("chunk", axis, k, n, inner)`, and of a chunk's term of a sum over the batch: `("term", k, n, inner)`. rules/core.lp and
rules/values.lp define their meaning; this module only names and prints them.
"""

from __future__ import annotations


Layout = object  # "rep" | tuple


# The chunk index a layer template solved once for every batch chunk names its chunk by
# (refine/run/memo.py `ChunkClass`): a constant, so no rule computes with it.
EVERY_CHUNK = "every_chunk"

ChunkIndex = int | str  # (a number, or EVERY_CHUNK)


def chunk_of(item: object) -> tuple[object, int, ChunkIndex, int] | None:
    """(S, A, K, N) for a virtual sequential tensor win(S, A, K, N) or node wn(S, A, K, N) of
    rules/windows.lp: chunk K of N along axis A of sequential tensor (or node output) S. S is
    itself a chunk (a tuple) for a window of a window."""
    if isinstance(item, tuple) and len(item) == 5 and item[0] in ("win", "wn"):
        k = item[3] if item[3] == EVERY_CHUNK else int(item[3])
        return _base(item[1]), int(item[2]), k, int(item[4])
    return None


def _base(item: object) -> object:
    """A virtual tensor's base: a real id as text, or a virtual one (a tuple) as it is."""
    return item if isinstance(item, tuple) else str(item)


def chunk_number(k: ChunkIndex) -> str:
    """Chunk k as people count: from 1 (`k` for the chunk a template stands for every one)."""
    return str(k + 1) if isinstance(k, int) else "k"


def term_of(item: object) -> tuple[object, ChunkIndex, int] | None:
    """(So, K, N) for a virtual term part(So, A, K, N) or node pn(Nd, A, K, N) of rules/windows.lp:
    chunk K of N's term of a sum over the chunked axis A (So virtual, a tuple, within a chunk); for
    a term reshaped, rpart(Sr, P) or its node pr(Nr, P), (Sr, K, N) of P's."""
    if isinstance(item, tuple) and len(item) == 5 and item[0] in ("part", "pn"):
        return _base(item[1]), item[3] if item[3] == EVERY_CHUNK else int(item[3]), int(item[4])
    if isinstance(item, tuple) and len(item) == 3 and item[0] in ("rpart", "pr"):  # (a term reshaped: rpart(Sr, P))
        inner = term_of(item[2])
        return None if inner is None else (_base(item[1]), inner[1], inner[2])
    return None


def real_id(item: object) -> str:
    """The sequential tensor or node id behind a virtual chunk or term (itself for a real one)."""
    chunk, term = chunk_of(item), term_of(item)
    base = chunk[0] if chunk is not None else term[0] if term is not None else None
    return str(item) if base is None else real_id(base)


def id_text(item: object) -> str:
    """A tensor or node id as people read it: `MatMul_3`, or `MatMul_3 [batch chunk 1/2, axis 0]`."""
    chunk, term = chunk_of(item), term_of(item)
    if term is not None:
        base, k, n = term
        return f"{id_text(base)} [the term of batch chunk {chunk_number(k)}/{n}]"
    if chunk is None:
        return str(item).split(":", 1)[-1]
    base, axis, k, n = chunk
    return f"{id_text(base)} [chunk {chunk_number(k)}/{n} of axis {axis}]"


def window_text(window: object, n: object) -> str:
    """A sender's window of routes (rules/exchanged_rows.lp): a slice [B:B+N), or a blocked window
    bk(P, Lo, Wb), [Lo:Lo+Wb) of every P (each sequence's window)."""
    if isinstance(window, tuple) and window and window[0] == "bk":
        _, period, lo, width = window
        return f"[{lo}:{int(lo) + int(width)}) of every {period}"
    return f"[{window}:{int(window) + int(n)})"  # type: ignore[call-overload]


def ids_text(ids: object) -> str:
    """The ids of an ownership layout: a tensor, a sort key srt(R, Ps, Pr) (rules/sorted_rows.lp:
    each side's rows in the order of its own sort), or an exchange key xs / xr (rules/
    exchanged_rows.lp: the routes a rank's rows hold, sent or received), a route slice rs or a
    placement pl by the sequential sort (rules/placed_rows.lp)."""
    if isinstance(ids, tuple) and ids and ids[0] == "srt":
        _, r, ps, pr = ids
        return f"{ids_text(r)}, each side sorted: {id_text(ps)} and {id_text(pr)}"
    if isinstance(ids, tuple) and ids and ids[0] == "pl":  # (rules/placed_rows.lp: the sequential rows in sorted order)
        _, inner, ps = ids
        return f"{ids_text(inner)}, the sequential rows sorted by {id_text(ps)}"
    if isinstance(ids, tuple) and ids and ids[0] == "rs":  # (... and a rank's routes in route order)
        _, r, b, n = ids
        return f"{id_text(r)}, the rank's routes {window_text(b, n)}"
    if isinstance(ids, tuple) and ids and ids[0] == "xs":  # (rules/exchanged_rows.lp: a sender's sorted slice)
        _, r, b, n = ids
        return f"{id_text(r)}, the rank's routes {window_text(b, n)} sorted by id"
    if isinstance(ids, tuple) and ids and ids[0] == "xr":  # (... and the rows a member receives)
        _, group, r, _n, c = ids
        return f"{id_text(r)}, the routes received over group [{group}], up to {c} rows"
    return id_text(ids)


def kind(layout: Layout) -> str:
    return layout if isinstance(layout, str) else str(layout[0])  # type: ignore[index]


# partial-sum styles naming the sequential node whose split made the pieces (rules/matmul.lp, ...)
DECOMPOSITIONS = ("contract", "axis", "rows", "vocab", "blocks")


def style_text(style: object) -> str:
    if isinstance(style, (str, int)):  # (a name, or a number inside one: blocks(128))
        return str(style)
    name, *args = style  # type: ignore[misc]
    if name in DECOMPOSITIONS:  # contract(seq:MatMul_3) reads contract(MatMul_3)
        return f"{name}(" + ",".join(id_text(a) for a in args) + ")"
    if name in ("once", "even"):
        node, inner = args
        inner_text = style_text(inner)
        return f"{name}@{id_text(node)}" + ("" if inner_text == "pure" else f"+{inner_text}")
    return f"{name}(" + ",".join(style_text(a) for a in args) + ")"


def text(layout: Layout) -> str:
    """A short human reading of a layout, e.g. `slice axis 1 [0:8)`."""
    k = kind(layout)
    if k == "rep":
        return "replica"
    args = layout[1:]  # type: ignore[index]
    if k == "sl":
        axis, start, end = args
        return f"slice axis {axis} [{start}:{end})"
    if k == "blk":
        axis, inner, start, end = args
        return f"blocks of {inner} on axis {axis}, keeping [{start}:{end}) of each"
    if k == "bc":
        axis, size = args
        return f"{size} of the equal indices of broadcast axis {axis}"
    if k == "psum":
        a, b, d, style = args
        return f"partial sum, piece [{a}:{b}) of {d} ({style_text(style)})"
    if k == "psl":
        c, x, y, a, b, d, style = args
        return f"slice axis {c} [{x}:{y}) of partial sum piece [{a}:{b}) of {d} ({style_text(style)})"
    if k == "pmax":
        a, b, d, style = args
        return f"partial max, piece [{a}:{b}) of {d}" + ("" if style == "pure" else f" ({style_text(style)})")
    if k == "ind":
        x, y, inside = args
        return f"values {'in' if inside else 'not in'} [{x}:{y})"
    if k == "off":
        return f"values - {args[0]}"
    if k == "wnd":
        x, y, fill = args
        return f"values - {x} where in [{x}:{y}), else {fill}"
    if k in ("own", "msk"):
        x, y, *_, ids = args
        rest = "anything" if k == "own" else "0"
        return f"rows whose id ({ids_text(ids)}) is in [{x}:{y}), {rest} elsewhere"
    if k == "swnd":
        x, y, fill, ids = args
        return f"sorted ids, values - {x} where in [{x}:{y}), else {fill} ({ids_text(ids)})"
    if k == "scaled":
        p, q, inner = args
        return f"{p}/{q} x {text(inner)}"
    if k == "chunk":
        axis, chunk, parts, inner = args
        return f"{text(inner)} of batch chunk {chunk_number(chunk)}/{parts} (axis {axis})"
    if k == "term":
        chunk, parts, inner = args
        return f"{text(inner)} of the term of batch chunk {chunk_number(chunk)}/{parts} (a sum over the batch)"
    return str(layout)


def keyed_by_real(s: object, layout: Layout) -> tuple[str, Layout]:
    """A relation of a batch chunk (rules/windows.lp) as one of its real tensor: (S, a `chunk`
    layout around the chunk's own), for readers that index relations by sequential tensor."""
    chunk, term = chunk_of(s), term_of(s)
    if term is not None:
        base, k, n = term
        return keyed_by_real(base, ("term", k, n, layout))
    if chunk is None:
        return str(s), layout
    base, axis, k, n = chunk
    return keyed_by_real(base, ("chunk", axis, k, n, layout))

