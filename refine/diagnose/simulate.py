"""Multi-rank reference executor: the numeric ground truth the verifier's lemmas are tested on.

The sequential model and every rank program run in one process with onnx's
ReferenceEvaluator, one thread per rank. `dist` collectives are NumPy OpRun classes that
rendezvous through an in-process communicator, so a rank program executes exactly as written:
calls are matched by group and by order within that group, never by node name. Anything the
real runtime would reject or hang on (mismatched calls, a missing partner, AllToAllV counts
that the members disagree on) is a SimulationError here, promptly, instead of a hang.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_conv_transpose import ConvTranspose as ReferenceConvTranspose
from onnx.reference.ops.op_max_pool import MaxPool as ReferenceMaxPool

from refine.config import (
    SEQ_NAME,
    Layout,
    ModelConfig,
    PartialLayout,
    RepLayout,
    ShardLayout,
    load_config,
    shard_indices,
)
from refine.dist import (
    DIST_DOMAIN,
    KNOWN_OPS,
    call_problem,
    channel_id,
    channel_of,
    members,
    node_attrs,
    normalize_axis,
    register_schemas,
)
from refine.errors import InputError
from refine.lowering.layers import inline_calls
from refine.lowering.row_copies import RankPrograms

# Backstop for a rank that blocks in a collective while some partner is still computing and
# never arrives. A true deadlock (every unfinished rank blocked) is detected at once.
DEADLOCK_TIMEOUT = 20.0

Shape = list[int | None]


class SimulationError(Exception):
    """The programs cannot be executed together: mismatched or unmatched collectives, or a rank failed."""


@dataclass
class SimResult:
    """Every tensor value (inputs, initializers, intermediates, outputs) of every graph."""

    seq: dict[str, np.ndarray]
    ranks: list[dict[str, np.ndarray]]


# ---------------------------------------------------------------------------------------------
# Communicator


@dataclass
class _Arrival:
    rank: int
    op_type: str
    attrs: dict[str, Any]
    x: np.ndarray
    where: str
    counts: tuple[np.ndarray, ...] = ()  # AllToAllV's send_counts and recv_counts


@dataclass
class _Call:
    """One collective call of a group: the k-th call on `group`, as seen by all its members."""

    group: tuple[int, ...]  # members; (sender, receiver) for a point-to-point call
    index: int
    channel: tuple[int, int, int] | None = None  # (sender, receiver, tag) of a point-to-point call
    arrivals: dict[int, _Arrival] = field(default_factory=dict)
    results: dict[int, np.ndarray] | None = None

    def describe(self) -> str:
        if self.channel is not None:
            return "Send/Recv call #{} from rank {} to rank {} (tag {})".format(self.index, *self.channel)
        op = next(iter(self.arrivals.values())).op_type if self.arrivals else "?"
        return f"{op} call #{self.index} on group {list(self.group)}"


class _Aborted(SimulationError):
    """Raised in a rank released because another rank failed; the root cause is reported instead."""


class _Communicator:
    """Rendezvous point of the rank threads; all state is guarded by one condition variable."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._counts: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
        self._calls: dict[tuple[tuple[int, ...], int], _Call] = {}
        self._waiting: dict[int, _Call] = {}
        self._finished: set[int] = set()
        self.failure: tuple[int, BaseException] | None = None

    def exchange(self, rank: int, node: onnx.NodeProto, x: np.ndarray, *counts: np.ndarray) -> np.ndarray:
        """Contribute `x` (and AllToAllV's `counts`) to this rank's next call on the node's group;
        block until it completes."""
        attrs = node_attrs(node)
        where = f"rank {rank} node {node.name!r}" if node.name else f"rank {rank} node -> {node.output[0]!r}"
        problem = call_problem(node.op_type, attrs, rank, self.world_size)
        if problem is not None:
            raise SimulationError(f"{where}: {node.op_type} {problem}")
        group, key = members(node.op_type, attrs, rank), channel_id(node.op_type, attrs, rank)
        arrival = _Arrival(rank, node.op_type, attrs, np.asarray(x), where, tuple(np.asarray(c) for c in counts))
        with self._cond:
            self._raise_if_failed()
            index = self._counts[rank, key]
            self._counts[rank, key] = index + 1
            call = self._calls.setdefault((key, index), _Call(group, index, channel_of(key)))
            if call.arrivals:
                _check_match(call, next(iter(call.arrivals.values())), arrival)
            call.arrivals[rank] = arrival
            if len(call.arrivals) == len(group):
                call.results = _execute(call)
                self._cond.notify_all()
            else:
                self._wait(rank, call)
            assert call.results is not None
            result = call.results.pop(rank)
            if not call.results:
                del self._calls[key, index]
            return result

    def _wait(self, rank: int, call: _Call) -> None:
        deadline = time.monotonic() + self.timeout
        self._waiting[rank] = call
        try:
            while call.results is None:
                self._raise_if_failed()
                stuck = self._deadlock()
                if stuck is None and time.monotonic() >= deadline:
                    stuck = f"timed out after {self.timeout:g} s: " + self._blocked_report()
                if stuck is not None:
                    self._fail(rank, SimulationError(f"deadlock: {stuck}"))
                    raise _Aborted(stuck)
                self._cond.wait(max(0.0, deadline - time.monotonic()))
        finally:
            del self._waiting[rank]

    def _deadlock(self) -> str | None:
        """A report if no rank can make progress any more (every unfinished rank is blocked)."""
        if not self._waiting:
            return None
        for r in range(self.world_size):
            if r in self._finished:
                continue
            call = self._waiting.get(r)
            if call is None or call.results is not None:
                return None
        return self._blocked_report()

    def _blocked_report(self) -> str:
        parts = []
        for r, call in sorted(self._waiting.items()):
            missing = [m for m in call.group if m not in call.arrivals]
            status = ", ".join(f"rank {m}" + (" (finished)" if m in self._finished else "") for m in missing)
            parts.append(f"rank {r} waits in {call.describe()} for {status}")
        return "; ".join(parts)

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise _Aborted(f"released because rank {self.failure[0]} failed")

    def _fail(self, rank: int, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = (rank, exc)
        self._cond.notify_all()

    def abort(self, rank: int, exc: BaseException) -> None:
        """Record a rank's failure (the first one wins) and release every blocked rank."""
        with self._cond:
            if not isinstance(exc, _Aborted):
                self._fail(rank, exc)
            self._cond.notify_all()

    def finish(self, rank: int) -> None:
        """A rank's program ended; ranks still waiting on it may now be deadlocked."""
        with self._cond:
            self._finished.add(rank)
            self._cond.notify_all()


def _check_match(call: _Call, first: _Arrival, new: _Arrival) -> None:
    """Members of one call must agree on op, attributes, dtype and shape."""
    problems = []
    if call.channel is not None:  # the sender's Send and the receiver's Recv (the channel fixes who does which)
        pass
    elif new.op_type != first.op_type:
        problems.append(f"op {first.op_type} vs {new.op_type}")
    elif new.attrs != first.attrs:
        problems.append(f"attributes {first.attrs} vs {new.attrs}")
    if new.x.dtype != first.x.dtype:
        problems.append(f"dtype {first.x.dtype} vs {new.x.dtype}")
    if new.op_type == first.op_type == "AllToAllV":  # (a ragged exchange: the members' row counts may differ)
        if new.x.shape[1:] != first.x.shape[1:]:
            problems.append(f"row shape {list(first.x.shape[1:])} vs {list(new.x.shape[1:])}")
    elif new.x.shape != first.x.shape:
        problems.append(f"shape {list(first.x.shape)} vs {list(new.x.shape)}")
    if problems:
        raise SimulationError(
            f"mismatched collective: {call.describe()}: {first.where} and {new.where} disagree on {'; '.join(problems)}"
        )


def _execute(call: _Call) -> dict[int, np.ndarray]:
    """The result of a complete call for every member (group order is the member order)."""
    first = next(iter(call.arrivals.values()))
    op, attrs, n = first.op_type, first.attrs, len(call.group)
    xs = [call.arrivals[r].x for r in call.group]
    ndim = xs[0].ndim
    try:
        if call.channel is not None:  # the receiver gets the sender's X; the sender's Y is its X
            sent = call.arrivals[call.group[0]].x
            return {call.group[0]: sent.copy(), call.group[1]: sent.copy()}
        if op == "Broadcast":
            root = call.arrivals[int(attrs["root"])].x
            return {r: root.copy() for r in call.group}
        if op == "AllReduce":
            total = _reduce(xs, attrs["reduce_op"])
            return {r: total.copy() for r in call.group}
        if op == "AllGather":
            gathered = np.concatenate(xs, axis=normalize_axis(attrs["axis"], ndim))
            return {r: gathered.copy() for r in call.group}
        if op == "ReduceScatter":
            axis = normalize_axis(attrs["axis"], ndim)
            chunks = _split(_reduce(xs, attrs["reduce_op"]), n, axis)
            return {r: chunks[j].copy() for j, r in enumerate(call.group)}
        if op == "AllToAllV":
            return _all_to_all_v(call)
        if op == "AllToAll":
            split = normalize_axis(attrs["split_axis"], ndim)
            concat = normalize_axis(attrs["concat_axis"], ndim)
            sent = [_split(x, n, split) for x in xs]
            return {r: np.concatenate([chunks[j] for chunks in sent], axis=concat) for j, r in enumerate(call.group)}
    except (KeyError, ValueError) as exc:
        raise SimulationError(f"{call.describe()} ({first.where}): {exc}") from None
    raise SimulationError(f"{first.where}: unknown collective dist.{op} (known: {', '.join(KNOWN_OPS)})")


COUNT_MISMATCH = "mismatched collective counts"  # (a "mismatched collective": a program error, refuted)


def _all_to_all_v(call: _Call) -> dict[int, np.ndarray]:
    """AllToAllV (refine/dist.py): member i's rows [off_i(j), off_i(j) + send_i[j]) land at row
    sum_{k<i} recv_j[k] of member j's output of out_rows rows, zero elsewhere. The counts are
    checked first, every pair of members: send_i[j] == recv_j[i], and each member's counts are
    non-negative and fit its buffers. A real job would hang, fail or read garbage otherwise, so
    the call is refused (never run on counts the members disagree on)."""
    group, n = call.group, len(call.group)
    arrivals = [call.arrivals[r] for r in group]
    out_rows = int(arrivals[0].attrs["out_rows"])
    head = f"{COUNT_MISMATCH}: {call.describe()}"
    sends, recvs = [], []
    for a in arrivals:
        if a.x.ndim < 1:
            raise SimulationError(f"{head}: {a.where} sends a scalar (AllToAllV moves rows: axis 0)")
        if len(a.counts) != 2:
            raise SimulationError(f"{head}: {a.where} gives {len(a.counts)} count tensors, not 2 (send_counts, recv_counts)")
        for what, c in zip(("send_counts", "recv_counts"), a.counts):
            if c.shape != (n,) or not np.issubdtype(c.dtype, np.integer):
                raise SimulationError(f"{head}: {a.where} {what} is {c.dtype} of shape {list(c.shape)}, not int64 of "
                                      f"shape [{n}] (one count per member of the group)")
            if (c < 0).any():
                raise SimulationError(f"{head}: {a.where} {what} {c.tolist()} has a negative count")
        send, recv = (c.astype(np.int64) for c in a.counts)
        if send.sum() > a.x.shape[0]:
            raise SimulationError(f"{head}: {a.where} send_counts {send.tolist()} add up to {int(send.sum())} rows, "
                                  f"more than its data's {a.x.shape[0]}")
        if recv.sum() > out_rows:
            raise SimulationError(f"{head}: {a.where} recv_counts {recv.tolist()} add up to {int(recv.sum())} rows, "
                                  f"more than out_rows {out_rows}")
        sends.append(send)
        recvs.append(recv)
    bad = [(i, j) for i in range(n) for j in range(n) if sends[i][j] != recvs[j][i]]
    if bad:
        words = [f"rank {group[i]} ({arrivals[i].where}) sends {int(sends[i][j])} rows to rank {group[j]} "
                 f"(send_counts[{j}] = {int(sends[i][j])}) but rank {group[j]} ({arrivals[j].where}) expects "
                 f"{int(recvs[j][i])} from rank {group[i]} (recv_counts[{i}] = {int(recvs[j][i])})" for i, j in bad[:3]]
        more = f"; ... {len(bad) - 3} more pairs" if len(bad) > 3 else ""
        raise SimulationError(f"{head}: " + "; ".join(words) + more)
    results = {}
    for j, r in enumerate(group):
        x = arrivals[j].x
        out = np.zeros((out_rows, *x.shape[1:]), dtype=x.dtype)
        for i in range(n):
            start, count = int(sends[i][:j].sum()), int(sends[i][j])
            at = int(recvs[j][:i].sum())
            out[at:at + count] = arrivals[i].x[start:start + count]
        results[r] = out
    return results


def _split(x: np.ndarray, n: int, axis: int) -> list[np.ndarray]:
    if x.shape[axis] % n:
        raise ValueError(f"dimension {axis} of size {x.shape[axis]} is not divisible by group size {n}")
    return np.split(x, n, axis=axis)


def _reduce(xs: list[np.ndarray], op: str) -> np.ndarray:
    """Elementwise reduction; floats are accumulated in float64 so the result is correctly rounded."""
    dtype = xs[0].dtype
    stack = np.stack(xs).astype(np.float64 if np.issubdtype(dtype, np.floating) else dtype)
    if op == "sum":
        out = stack.sum(axis=0, dtype=stack.dtype)
    elif op == "max":
        out = stack.max(axis=0)
    elif op == "min":
        out = stack.min(axis=0)
    elif op == "avg":
        out = stack.mean(axis=0)  # integer tensors: rounded toward zero by the cast below
    else:
        raise ValueError(f"unknown reduce_op {op!r}")
    return np.asarray(out).astype(dtype)


# ---------------------------------------------------------------------------------------------
# The dist ops as reference-evaluator kernels

_context = threading.local()  # .comm, .rank: set only inside a rank thread


class _Collective(OpRun):
    """Kernel of every `dist` op: hand the input to the communicator of the running rank."""

    op_domain = DIST_DOMAIN

    def _run(self, x: np.ndarray, *counts: np.ndarray, **_attrs: Any) -> tuple[np.ndarray]:
        comm: _Communicator | None = getattr(_context, "comm", None)
        if comm is None:
            raise SimulationError(
                f"collective {self.onnx_node.name or self.onnx_node.output[0]!r} outside a rank program "
                "(the sequential model must not communicate)"
            )
        return (comm.exchange(_context.rank, self.onnx_node, x, *counts),)


# ReferenceEvaluator looks kernels up by (op_domain, class name).
DIST_OPS: list[type[OpRun]] = [type(op, (_Collective,), {"__doc__": f"dist.{op} kernel."}) for op in KNOWN_OPS]


class GatherElements(OpRun):
    """ONNX GatherElements with every axis form ONNX allows: onnx's reference kernel takes a
    negative axis (torch's `x.gather(-1, idx)` exports `axis=-1`) for a wrong dimension and
    fails, which left a real bug without its counterexample (tests/test_simulate_axes.py)."""

    def _run(self, data: np.ndarray, indices: np.ndarray, axis: int = 0) -> tuple[np.ndarray]:
        return (np.take_along_axis(data, indices.astype(np.int64), axis=normalize_axis(axis, data.ndim)),)


class MaxPool(ReferenceMaxPool):
    """ONNX MaxPool whose indices are the spec's (flat over N x C x spatial) whatever the strides:
    onnx's reference kernel computes unit-stride pools on another path whose indices restart at 0
    on every channel, and torch.onnx's max_pool2d_with_indices reads a 1x1 pool's indices as the
    offset of each channel, so a training step through a max-pool indexed out of range."""

    def _run(self, x: np.ndarray, auto_pad: Any = None, ceil_mode: Any = None, dilations: Any = None,
             kernel_shape: Any = None, pads: Any = None, storage_order: Any = None, strides: Any = None) -> Any:
        if auto_pad not in (None, "NOTSET", b"NOTSET"):
            return super()._run(x, auto_pad=auto_pad, ceil_mode=ceil_mode, dilations=dilations,
                                kernel_shape=kernel_shape, pads=pads, storage_order=storage_order, strides=strides)
        return self._max_pool(x, auto_pad=auto_pad, ceil_mode=ceil_mode, dilations=dilations, kernel_shape=kernel_shape,
                              pads=pads, storage_order=storage_order, strides=strides)


class ConvTranspose(ReferenceConvTranspose):
    """ONNX ConvTranspose whose groups are the spec's: onnx's reference kernel cuts a grouped
    weight [C, M / group, ...] by output channels and writes each group's output into one channel,
    so the input's gradient of a grouped convolution (exporters/capture/conv_backward.py) failed
    to run. Group g maps input channels [g C / group, (g + 1) C / group) by its rows of the
    weight to output channels [g M / group, (g + 1) M / group)."""

    def _run(self, X: np.ndarray, W: np.ndarray, B: np.ndarray | None = None, group: Any = None,
             **attributes: Any) -> Any:
        group = group or 1
        if group == 1:
            return super()._run(X, W, B, group=1, **attributes)
        per_in = X.shape[1] // group
        outputs = [super(ConvTranspose, self)._run(X[:, g * per_in:(g + 1) * per_in], W[g * per_in:(g + 1) * per_in],
                                                   None, group=1, **attributes)[0] for g in range(group)]
        joined = np.concatenate(outputs, axis=1)
        if B is not None:
            joined = joined + B.reshape(1, -1, *([1] * (joined.ndim - 2)))
        return (joined.astype(X.dtype),)


KERNELS: list[type[OpRun]] = [*DIST_OPS, GatherElements, MaxPool, ConvTranspose]  # (the reference's own kernels otherwise)


# ---------------------------------------------------------------------------------------------
# Running


def _promote_initializers(model: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """A copy of `model` in which the initializers named in `names` are graph inputs (so feeds win)."""
    if not any(init.name in names for init in model.graph.initializer):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    inputs = {i.name for i in graph.input}
    keep = []
    for init in graph.initializer:
        if init.name not in names:
            keep.append(init)
        elif init.name not in inputs:
            graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return copy


def _evaluator(model: onnx.ModelProto, feeds: dict[str, np.ndarray], what: str) -> ReferenceEvaluator:
    try:
        return ReferenceEvaluator(_promote_initializers(model, set(feeds)), new_ops=KERNELS)
    except Exception as exc:  # noqa: BLE001 - any construction failure means "cannot run"
        raise SimulationError(f"{what}: cannot build a reference evaluator: {type(exc).__name__}: {exc}") from exc


def evaluate(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """One program (no collective) run on `feeds` by the simulator's kernels: its outputs in order."""
    return list(_evaluator(model, feeds, "the model").run(None, feeds))


def _values(results: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: v for k, v in results.items() if k}


def run_programs(
    seq: onnx.ModelProto,
    ranks: list[onnx.ModelProto],
    seq_feeds: dict[str, np.ndarray],
    rank_feeds: list[dict[str, np.ndarray]],
    *,
    timeout: float | None = None,
) -> SimResult:
    """Execute the sequential model, then all rank programs concurrently; every value of every graph.

    Feeds override same-named initializers. Any failure is a SimulationError (a failing rank's
    own exception is chained as its cause); the other ranks are released, never left hanging.
    """
    if len(rank_feeds) != len(ranks):
        raise ValueError(f"{len(ranks)} rank programs but {len(rank_feeds)} rank feeds")
    register_schemas()
    seq_eval = _evaluator(seq, seq_feeds, "sequential model")
    rank_evals = [_evaluator(m, f, f"rank {r}") for r, (m, f) in enumerate(zip(ranks, rank_feeds))]
    try:
        seq_values = _values(seq_eval.run(None, seq_feeds, intermediate=True))
    except SimulationError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise SimulationError(f"sequential model failed: {type(exc).__name__}: {exc}") from exc

    comm = _Communicator(len(ranks), DEADLOCK_TIMEOUT if timeout is None else timeout)
    outputs: list[dict[str, np.ndarray]] = [{} for _ in ranks]

    def rank_main(rank: int) -> None:
        _context.comm, _context.rank = comm, rank
        try:
            outputs[rank] = _values(rank_evals[rank].run(None, rank_feeds[rank], intermediate=True))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            comm.abort(rank, exc)
        finally:
            comm.finish(rank)

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"refine-rank{r}", daemon=True) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if comm.failure is not None:
        rank, exc = comm.failure
        if isinstance(exc, SimulationError):
            raise exc
        raise SimulationError(f"rank {rank} failed: {type(exc).__name__}: {exc}") from exc
    return SimResult(seq=seq_values, ranks=outputs)


# ---------------------------------------------------------------------------------------------
# Feeds


def declared_values(bounds: tuple[int, int], also: list[int] | None, shape: tuple[int, ...] | list[int],
                    rng: np.random.Generator) -> np.ndarray:
    """Integer values drawn from a declared range [lo, hi), and about one in four from its `also`
    values (an ignore index: often enough that the ranks of a batch count different numbers of
    them). The exporters' numeric check draws the same way."""
    values = rng.integers(*bounds, size=shape)
    if also:
        special = rng.random(shape) < 0.25
        values = np.where(special, rng.choice(np.asarray(also), size=shape), values)
    return values


def _feedable(model: onnx.ModelProto, declared: set[str]) -> dict[str, tuple[Shape, np.dtype]]:
    """Shape and dtype of every tensor a run of `model` must be fed: graph inputs without an
    initializer, plus the initializers named in `declared` (whose values the feeds override)."""
    inits = {i.name: i for i in model.graph.initializer}
    out: dict[str, tuple[Shape, np.dtype]] = {}
    for vi in model.graph.input:
        if vi.name in inits and vi.name not in declared:
            continue
        tt = vi.type.tensor_type
        dims: Shape = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        out[vi.name] = (dims, np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)))
    for init in model.graph.initializer:  # (in file order, never a set's: the draws follow this order)
        if init.name in declared and init.name not in out:
            out[init.name] = (list(init.dims), np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)))
    return out


def _static(name: str, shape: Shape, where: str) -> list[int]:
    if any(d is None for d in shape):
        raise SimulationError(f"{where}: input {name!r} has a non-static shape {shape}; cannot make feeds")
    return [int(d) for d in shape]  # type: ignore[arg-type]


def _random(shape: list[int], dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """Asymmetric random values: a non-zero offset keeps sums, signs and orders informative."""
    if dtype == np.bool_:
        return rng.random(shape) < 0.4
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 4, size=shape).astype(dtype)
    values = rng.standard_normal(shape) + rng.uniform(0.25, 1.0)
    if len(shape) >= 2:
        # like a weight initialisation: keeps deep programs' activations (attention scores
        # above all) near unit scale, where float32 rounding stays far below the tolerance
        values /= np.sqrt(max(shape[-2:]))
    return values.astype(dtype)


def _gap(shape: tuple[int, ...], floating: bool, rng: np.random.Generator) -> np.ndarray:
    """Strictly positive random amounts, so a partial-max part is strictly below the value."""
    if floating:
        return np.abs(rng.standard_normal(shape)) + 0.1
    return rng.integers(1, 4, size=shape)


def cut_shards(layout: ShardLayout, value: np.ndarray, world: int) -> list[np.ndarray]:
    """Each rank's part of `value` under a shard layout (ValueError if the layout cannot cut it)."""
    axis = normalize_axis(layout.axis, value.ndim)
    return [np.take(value, idx, axis=axis) for idx in shard_indices(layout, value.shape[axis], world)]


def place_shards(layout: ShardLayout, parts: list[np.ndarray]) -> np.ndarray:
    """The tensor whose shards under `layout` are `parts` (the inverse of cut_shards)."""
    axis = normalize_axis(layout.axis, parts[0].ndim)
    joined = np.concatenate(parts, axis=axis)
    order = [i for idx in shard_indices(layout, joined.shape[axis], len(parts)) for i in idx]
    placed = np.empty_like(joined)
    index: list[Any] = [slice(None)] * joined.ndim
    index[axis] = order
    placed[tuple(index)] = joined
    return placed


def cut_two_dim(layout: ShardLayout, value: np.ndarray, config: ModelConfig) -> list[np.ndarray]:
    """Each rank's part of `value` under a two-dim shard (refine/config.py `then`): chunk k (its
    coordinate on `over`) along `axis`, then chunk j (its coordinate on `then.over`) of that along
    `then.axis`."""
    assert layout.then is not None
    first = layout.model_copy(update={"over": None, "then": None})
    second = ShardLayout(layout="shard", axis=layout.then.axis)
    chunks = cut_shards(first, value, config.split_of(layout, 0)[1])
    out = []
    for r in range(config.world_size):
        j, m = config.then_split_of(layout, r)
        out.append(cut_shards(second, chunks[config.split_of(layout, r)[0]], m)[j])
    return out


def rebuild_two_dim(layout: ShardLayout | PartialLayout, held: dict[int, np.ndarray],
                    config: ModelConfig) -> list[tuple[list[int], np.ndarray]]:
    """The tensor as each plane of ranks rebuilds it under a two-dim layout (`held`: rank -> its
    piece; a plane: the ranks whose coordinates off `over` and `then.over` agree), with the
    plane's ranks; a plane missing a piece rebuilds nothing. Each first part is its pieces along
    `then.axis` put together, and the first parts are a shard's chunks or a partial's summands."""
    assert layout.then is not None and config.mesh is not None
    second = ShardLayout(layout="shard", axis=layout.then.axis)
    n, m = config.split_of(layout, 0)[1], config.then_split_of(layout, 0)[1]
    planes: dict[tuple[int, ...], dict[tuple[int, int], int]] = defaultdict(dict)
    for r in held:
        coords = config.mesh.coordinates(r)
        key = tuple(c for dim, c in coords.items() if dim not in (layout.over, layout.then.over))
        planes[key][(config.split_of(layout, r)[0], config.then_split_of(layout, r)[0])] = r
    out = []
    for plane in planes.values():
        if len(plane) != n * m:
            continue
        chunks = [place_shards(second, [held[plane[(k, j)]] for j in range(m)]) for k in range(n)]
        if isinstance(layout, ShardLayout):
            whole = place_shards(layout.model_copy(update={"over": None, "then": None}), chunks)
        else:
            stack = np.stack([c.astype(np.float64) for c in chunks])
            whole = (stack.sum(axis=0) if layout.op == "sum" else stack.max(axis=0)).astype(chunks[0].dtype)
        out.append((sorted(plane.values()), whole))
    return out


def _distribute_over_mesh(layout: ShardLayout | PartialLayout, value: np.ndarray, config: ModelConfig,
                          rng: np.random.Generator) -> list[np.ndarray]:
    """Each rank's tensor under a layout split along one mesh dimension: the rank whose coordinate
    there is k holds part k. One split for every group along that dimension: a partial sum's
    pieces are one decomposition of the value (rules/core.lp: pieces of one style, from any
    ranks, that tile [0, D) sum to it), so groups may not hold different summands. A two-dim
    shard: `cut_two_dim`."""
    if isinstance(layout, ShardLayout) and layout.then is not None:
        return cut_two_dim(layout, value, config)
    parts = config.split_of(layout, 0)[1]
    pieces = _distribute(layout.model_copy(update={"over": None}), value, parts, rng)
    return [pieces[config.split_of(layout, r)[0]] for r in range(config.world_size)]


def _distribute(layout: Layout, value: np.ndarray, world: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each rank's tensor for a sequential `value` under `layout` (see refine/config.py)."""
    if isinstance(layout, RepLayout):
        return [value.copy() for _ in range(world)]
    if isinstance(layout, ShardLayout):
        return cut_shards(layout, value, world)
    assert isinstance(layout, PartialLayout)
    floating = np.issubdtype(value.dtype, np.floating)
    wide = np.dtype(np.float64 if floating else np.int64)
    target = value.astype(wide)
    if layout.op == "sum":
        parts = [_random(list(value.shape), wide, rng) for _ in range(world - 1)]
        rest = target - sum(parts, np.zeros_like(target))
        parts.insert(int(rng.integers(world)), rest)
    else:  # max: every part <= value; per element a random rank holds the value itself
        parts = [target - _gap(value.shape, floating, rng) for _ in range(world)]
        owner = rng.integers(world, size=value.shape)
        for k, part in enumerate(parts):
            part[owner == k] = target[owner == k]
    return [p.astype(value.dtype) for p in parts]


def make_feeds(
    seq: onnx.ModelProto,
    ranks: list[onnx.ModelProto],
    config: ModelConfig,
    rng: np.random.Generator,
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """Random sequential feeds, and rank feeds that relate to them as `config.inputs` declares.

    Undeclared rank inputs get the sequential value when the sequential graph has an input of
    that name, shape and dtype (replicated), and fresh random values otherwise.
    """
    if len(ranks) != config.world_size:
        raise ValueError(f"{len(ranks)} rank programs for world_size {config.world_size}")
    declared = set(config.inputs)
    seq_specs = _feedable(seq, declared)
    unknown = sorted(declared - seq_specs.keys())
    if unknown:
        raise SimulationError(f"refine.json declares {unknown}, not inputs or initializers of the sequential model")
    seq_feeds = {name: _random(_static(name, shape, "sequential model"), dtype, rng) for name, (shape, dtype) in seq_specs.items()}
    for name, layout in config.inputs.items():  # a declared value range: values drawn from it
        if layout.range is not None:
            seq_feeds[name] = declared_values(layout.range, layout.also, seq_feeds[name].shape, rng).astype(seq_feeds[name].dtype)
    per_rank = {}
    for name, layout in config.inputs.items():
        try:
            per_rank[name] = _distribute_over_mesh(layout, seq_feeds[name], config, rng) \
                if getattr(layout, "over", None) is not None else _distribute(layout, seq_feeds[name], config.world_size, rng)
        except ValueError as exc:
            raise SimulationError(f"input {name!r}: {exc}") from None
    rank_feeds = []
    for r, model in enumerate(ranks):
        feeds = {}
        for name, (shape, dtype) in _feedable(model, declared).items():
            if name in per_rank:
                value = per_rank[name][r].astype(dtype)
                if all(d is not None for d in shape) and list(value.shape) != shape:
                    raise SimulationError(
                        f"rank {r}: input {name!r} has shape {shape}, but its {config.inputs[name].layout} "
                        f"layout gives {list(value.shape)}"
                    )
            elif name in seq_feeds and list(seq_feeds[name].shape) == shape and seq_feeds[name].dtype == dtype:
                value = seq_feeds[name].copy()
            else:
                value = _random(_static(name, shape, f"rank {r}"), dtype, rng)
            feeds[name] = value
        rank_feeds.append(feeds)
    return seq_feeds, rank_feeds


def _load(path: Path) -> onnx.ModelProto:
    """Load one program with its weights; layer calls inlined (values named `CALL/NAME`)."""
    if not path.is_file():
        raise InputError(path, "missing")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001 - protobuf and I/O errors alike
        raise InputError(path, f"not a readable ONNX model ({type(exc).__name__})") from None
    return inline_calls(model, path)


def simulate_dir(model_dir: Path, seed: int = 0) -> SimResult:
    """Run a model directory (seq.onnx, rank*.onnx, refine.json) on random feeds from `seed`."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    seq = _load(model_dir / SEQ_NAME)
    ranks = RankPrograms(model_dir, config, load=_load).all()  # (declared row copies made from row 0's)
    seq_feeds, rank_feeds = make_feeds(seq, ranks, config, np.random.default_rng(seed))
    return run_programs(seq, ranks, seq_feeds, rank_feeds)
