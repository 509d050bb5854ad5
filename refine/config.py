"""`refine.json`: the contract between a model directory and the verifier.

A model directory holds `seq.onnx`, `rank0.onnx` ... `rank{N-1}.onnx` and `refine.json`.
The JSON says how many ranks there are and how each graph input (or initializer) of the
sequential model relates to the same-named tensor on every rank. Users and tests write it by
hand; exporters generate it. Documented for users in docs/model-dir.md.
"""

from __future__ import annotations

import json
from math import prod
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from refine.errors import InputError

CONFIG_NAME = "refine.json"
SEQ_NAME = "seq.onnx"


def rank_file_name(rank: int) -> str:
    """File name of rank `rank`'s program inside a model directory."""
    return f"rank{rank}.onnx"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Declared(_Strict):
    """What every declaration may add to its layout."""

    range: tuple[int, int] | None = Field(
        default=None,
        description="inputs of an integer type only: every value lies in [lo, hi), half-open like Python's "
        "range (token ids: [0, vocab)); lemmas that need it read it (a vocab-parallel embedding is only "
        "a sum of the ranks' rows when no id is negative: ONNX Gather wraps negative ids)")

    also: list[int] | None = Field(
        default=None,
        description="with a range: values the input may hold besides it (labels' ignore index, -100: a token "
        "the loss does not count); the simulator draws them too, and lemmas see the range widened to them")

    @model_validator(mode="after")
    def _range_not_empty(self) -> "_Declared":
        if self.range is not None and self.range[0] >= self.range[1]:
            raise ValueError(f"range {list(self.range)} is empty (it is [lo, hi), lo < hi)")
        if self.also and self.range is None:
            raise ValueError("`also` adds values to a range: declare the range too")
        return self

    def value_bounds(self) -> tuple[int, int] | None:
        """[lo, hi) holding every value the input may take: the range widened to `also`."""
        if self.range is None:
            return None
        extra = self.also or []
        return min([self.range[0], *extra]), max([self.range[1], *(v + 1 for v in extra)])


class RepLayout(_Declared):
    """Every rank holds the whole tensor: T = S."""

    layout: Literal["rep"]


class ShardThen(_Strict):
    """The second split of a two-dim layout: the rank's chunk (or summand) of the first split is
    cut again into even chunks along `axis`, between the ranks along mesh dim `over`."""

    axis: int
    over: str


class _OverMesh(_Declared):
    """Layouts that split a tensor between ranks: over the whole world, or along one mesh dim
    (and, with `then`, the rank's part cut again along a second mesh dim)."""

    over: str | None = Field(
        default=None,
        description="a dimension of refine.json's `mesh`: the tensor is split between the ranks along that "
        "mesh dimension only (chunk k: the rank whose coordinate there is k), and copied along the others; "
        "without it, between all ranks (chunk k: rank k)")
    then: ShardThen | None = Field(default=None, description="a second split of the rank's part: even chunks "
                                   "along then.axis between the ranks along mesh dim then.over")

    @model_validator(mode="after")
    def _two_dims(self) -> "_OverMesh":
        if self.then is not None and (self.over is None or self.then.over == self.over):
            raise ValueError("a two-dim layout (`then`) splits over two different mesh dims: give `over` and "
                             "`then.over` (different)")
        return self


class ShardLayout(_OverMesh):
    """Rank k holds chunk k along `axis`: even chunks, or the given `sizes` (one per rank); with a
    `stride`, the axis is `stride` equal blocks and rank k holds even chunk k of every block, in
    block order (Megatron's partition_stride: a fused [gate; up] weight). With `over`, k is the
    rank's coordinate on that mesh dimension, and `sizes` has one entry per coordinate. With
    `then` (and `over`), the rank holds even chunk j, along `then.axis`, of that chunk, j its
    coordinate on mesh dim `then.over` (a tensor split over two mesh dims: the sequence over cp
    and the vocabulary over tp)."""

    layout: Literal["shard"]
    axis: int
    sizes: list[int] | None = None
    stride: int | None = Field(default=None, ge=1, description="the axis is this many equal blocks; rank k "
                               "holds chunk k of each, in block order (Megatron's partition_stride); even chunks only")

    @model_validator(mode="after")
    def _stride_even(self) -> "ShardLayout":
        if self.stride not in (None, 1) and self.sizes is not None:
            raise ValueError("a strided shard has even chunks: give stride or sizes, not both")
        if self.then is not None and (self.sizes is not None or self.stride not in (None, 1)):
            raise ValueError("a two-dim shard (`then`) splits evenly over two different mesh dims: no sizes or stride")
        return self


class PartialLayout(_OverMesh):
    """S = op over the ranks' tensors (rank k holds summand k); with `over`, over the ranks of each
    group along that mesh dimension, every group holding the same summands (one decomposition).
    With `then`, rank (k, j) holds chunk j along `then.axis` of summand k (a TP-sharded
    parameter's gradient under CP): export.json states such open gradients for --check; refine.json
    does not take it yet."""

    layout: Literal["partial"]
    op: Literal["sum", "max"] = "sum"


Layout = Annotated[Union[RepLayout, ShardLayout, PartialLayout], Field(discriminator="layout")]


class Expectation(_Strict):
    """What a bundled or zoo entry is expected to give (tests and `refine batch` read it)."""

    verdict: Literal["verified", "refuted", "unproven"]
    node: str | None = Field(default=None, description="sequential node name the failure must name")


class Mesh(_Strict):
    """The ranks as a device mesh: rank r sits at the row-major coordinates of r in `shape`
    (torch's DeviceMesh of `torch.arange(world_size).reshape(shape)`), one named dim per axis."""

    shape: list[int] = Field(min_length=1)
    dims: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _named(self) -> "Mesh":
        if len(self.dims) != len(self.shape):
            raise ValueError(f"mesh: {len(self.dims)} dims {self.dims} for a shape of {len(self.shape)} axes {self.shape}")
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"mesh: dims {self.dims} name one dimension twice")
        if any(n < 1 for n in self.shape):
            raise ValueError(f"mesh: shape {self.shape} has an empty dimension")
        return self

    def coordinates(self, rank: int) -> dict[str, int]:
        """{dim: coordinate} of a rank (row-major: the last dim varies fastest)."""
        out: dict[str, int] = {}
        for dim, n in zip(reversed(self.dims), reversed(self.shape)):
            rank, out[dim] = divmod(rank, n)
        return {d: out[d] for d in self.dims}

    def rank_at(self, coordinates: dict[str, int]) -> int:
        """The rank at {dim: coordinate} (the inverse of `coordinates`)."""
        rank = 0
        for dim, n in zip(self.dims, self.shape):
            rank = rank * n + coordinates[dim]
        return rank


class RowCopies(_Strict):
    """Ranks whose files are not written: each runs its row-0 counterpart's program as a copy.

    A mesh whose rows along `dim` (the batch's dim) run the same programs on their own batch
    chunks need not store D copies of one row: refine.json declares that every rank with a
    coordinate other than 0 along `dim` runs its counterpart's program (the rank at coordinate 0,
    the other coordinates kept) with each group member, peer and root moved to its own row, a
    group that holds every row (a column call) kept as it is. Only row 0's files are stored;
    refine/lowering/row_copies.py makes a copy wherever one is read."""

    dim: str = Field(description="the mesh dim along which every row is a copy of row 0")

    def stored(self, mesh: "Mesh", rank: int) -> bool:
        """Whether rank `rank` has a file (row 0) or is a copy."""
        return mesh.coordinates(rank)[self.dim] == 0


class ModelConfig(_Strict):
    """The parsed `refine.json`."""

    world_size: int = Field(ge=1)
    mesh: Mesh | None = Field(default=None, description="the ranks as a device mesh, for layouts `over` one of its dims")
    inputs: dict[str, Layout] = Field(default_factory=dict)
    outputs: dict[str, Layout] = Field(
        default_factory=dict,
        description="how each rank's same-named output must relate to the sequential output; "
        "an output named here is verified only with exactly that layout (e.g. rep: a missing final "
        "all-reduce, rebuildable as a sum, still fails)")
    expect: Expectation | None = None
    description: str | None = None
    row_copies: RowCopies | None = Field(
        default=None, description="the rows along a mesh dim whose programs are copies of row 0's, not stored "
        "(their files are absent): see RowCopies")

    @model_validator(mode="after")
    def _sizes_match_world(self) -> "ModelConfig":
        if self.mesh is not None and prod(self.mesh.shape) != self.world_size:
            raise ValueError(f"mesh shape {self.mesh.shape} has {prod(self.mesh.shape)} ranks, world_size is {self.world_size}")
        if self.row_copies is not None and (self.mesh is None or self.row_copies.dim not in self.mesh.dims):
            known = f"the mesh dims {self.mesh.dims}" if self.mesh is not None else "no mesh (refine.json has none)"
            raise ValueError(f"row_copies: dim {self.row_copies.dim!r} names none of {known}")
        for name, layout in self.outputs.items():
            if isinstance(layout, PartialLayout) and layout.over is not None:
                raise ValueError(f"output {name!r}: `over` is for inputs and sharded outputs only (a partial output's "
                                 "ranks sum it whole)")
        for name, layout in {**self.inputs, **self.outputs}.items():
            if isinstance(layout, PartialLayout) and layout.then is not None:
                raise ValueError(f"{name!r}: a partial layout with `then` is not taken in refine.json yet")
            over = getattr(layout, "over", None)
            then = getattr(layout, "then", None)
            for dim in (over, then.over if then is not None else None):
                if dim is not None and (self.mesh is None or dim not in self.mesh.dims):
                    known = f"the mesh dims {self.mesh.dims}" if self.mesh is not None else "no mesh (refine.json has none)"
                    raise ValueError(f"input {name!r}: over {dim!r} names none of {known}")
            if isinstance(layout, ShardLayout) and layout.sizes is not None:
                parts = self.split_of(layout, 0)[1]
                if len(layout.sizes) != parts:
                    raise ValueError(
                        f"input {name!r}: {len(layout.sizes)} shard sizes for {parts} "
                        + (f"ranks along mesh dim {over!r}" if over else f"ranks (world_size {self.world_size})")
                    )
                if any(s < 0 for s in layout.sizes):
                    raise ValueError(f"input {name!r}: negative shard size")
        for name, layout in self.outputs.items():
            if layout.range is not None or layout.also:
                raise ValueError(f"output {name!r}: a value range is declared of inputs only")
        return self

    def stored(self, rank: int) -> bool:
        """Whether rank `rank`'s program has a file (not a declared row copy)."""
        return self.row_copies is None or self.mesh is None or self.row_copies.stored(self.mesh, rank)

    def split_of(self, layout: ShardLayout | PartialLayout, rank: int) -> tuple[int, int]:
        """(k, n): under `layout`, rank `rank` holds chunk (or summand) k of n."""
        if layout.over is None or self.mesh is None:
            return rank, self.world_size
        return self.mesh.coordinates(rank)[layout.over], self.mesh.shape[self.mesh.dims.index(layout.over)]

    def then_split_of(self, layout: ShardLayout | PartialLayout, rank: int) -> tuple[int, int]:
        """(j, m): under a two-dim shard, rank `rank` holds chunk j of m of its first chunk."""
        assert layout.then is not None and self.mesh is not None
        dim = layout.then.over
        return self.mesh.coordinates(rank)[dim], self.mesh.shape[self.mesh.dims.index(dim)]


def load_config(model_dir: Path) -> ModelConfig:
    """Read and validate `refine.json` in `model_dir`; bad content is an InputError."""
    path = model_dir / CONFIG_NAME
    if not path.is_file():
        raise InputError(path, "missing (a model directory needs refine.json)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(path, f"not valid JSON ({exc})") from None
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise InputError(path, f"invalid at {where}: {first['msg']}") from None


def shard_bounds(layout: ShardLayout, size: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's chunk of a dimension of `size` under `layout` (one range per
    rank: a strided shard has several, see `shard_indices`)."""
    if (layout.stride or 1) > 1:
        raise ValueError(f"a shard with stride {layout.stride} gives each rank {layout.stride} ranges, not one")
    if layout.sizes is not None:
        sizes = list(layout.sizes)
    else:
        if size % world_size:
            raise ValueError(f"size {size} is not divisible by world size {world_size}")
        sizes = [size // world_size] * world_size
    if sum(sizes) != size:
        raise ValueError(f"shard sizes {sizes} do not add up to {size}")
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    return bounds


def shard_indices(layout: ShardLayout, size: int, world_size: int) -> list[list[int]]:
    """The indices along the shard axis that each rank holds, in the order it holds them."""
    stride = layout.stride or 1
    if stride == 1:
        return [list(range(lo, hi)) for lo, hi in shard_bounds(layout, size, world_size)]
    if size % (stride * world_size):
        raise ValueError(f"size {size} is not {stride} blocks of {world_size} equal chunks")
    block, part = size // stride, size // (stride * world_size)
    return [[j * block + k * part + i for j in range(stride) for i in range(part)] for k in range(world_size)]
