"""Layout terms as Python sees them (tuples from the engine) and how people read them.

The engine returns clingo terms as tuples: `"rep"`, `("sl", axis, start, end)`,
`("blk", axis, inner, start, end)`, `("bc", axis, size)`,
`("psum", a, b, d, style)`, `("pmax", a, b, d, style)`, `("scaled", p, q, inner)`, and the value
layouts `("ind", x, y, inside)`, `("off", c)`, `("wnd", x, y, fill)`, and the ownership layouts
`("own", x, y, d, ids)`, `("msk", x, y, ids)` (rules/embedding.lp). rules/core.lp and
rules/values.lp define their meaning; this module only names and prints them.
"""

from __future__ import annotations


Layout = object  # "rep" | tuple


def kind(layout: Layout) -> str:
    return layout if isinstance(layout, str) else str(layout[0])  # type: ignore[index]


# partial-sum styles naming the sequential node whose split made the pieces (rules/matmul.lp, ...)
DECOMPOSITIONS = ("contract", "axis", "rows", "vocab", "blocks")


def style_text(style: object) -> str:
    if isinstance(style, (str, int)):  # (a name, or a number inside one: blocks(128))
        return str(style)
    name, *args = style  # type: ignore[misc]
    if name in DECOMPOSITIONS:  # contract(seq:MatMul_3) reads contract(MatMul_3)
        return f"{name}(" + ",".join(str(a).split(":", 1)[-1] for a in args) + ")"
    if name in ("once", "even"):
        node, inner = args
        inner_text = style_text(inner)
        return f"{name}@{str(node).split(':', 1)[-1]}" + ("" if inner_text == "pure" else f"+{inner_text}")
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
        return f"rows whose id ({str(ids).split(':', 1)[-1]}) is in [{x}:{y}), {rest} elsewhere"
    if k == "scaled":
        p, q, inner = args
        return f"{p}/{q} x {text(inner)}"
    return str(layout)

