"""`refine batch`: verify every model directory under a root, in parallel, with a cache.

An entry is a directory holding `refine.json` (found recursively; hidden directories are
skipped) or, with a plan (`--plan tp:N`), a plain `.onnx` model that no entry holds: the
sharder (refine/batch/autoshard.py) proposes rank programs for it in a scratch directory, and the
verifier decides as for any entry.

Each entry runs in its own worker process (a forkserver child: started from a clean process
that has the verifier imported, so a start costs milliseconds and no thread of this process is
inherited). The parent waits on the workers' pipes and exit sentinels: an entry past its time
limit is killed, one whose worker dies (a crash, the kernel's OOM killer) is reported with how
it died, and neither stops the batch. The memory cap is an address-space limit the worker sets
on itself (`resource.setrlimit`), so an allocation past it fails inside the worker as a
MemoryError, which it reports.

Verdicts are cached under a key hashing the entry's files, the options that change a verdict,
every rule file (`refine.run.engine.rule_files`, user `--rules` directories included), refine's
version and the source of the refine package: a re-run only verifies what changed, and a
change to any rule file invalidates every cached verdict. Timeouts and crashes are never
cached. Cache files are written atomically.

The outcome is a `BatchReport` (pydantic): one `EntryResult` per entry with the core's
`Report`, or the batch-level status (error, timeout, out_of_memory, crashed) that kept it
from having one. An entry passes when it got the verdict its refine.json `expect` declares
(and names the declared node, if any), `verified` when it declares none.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import resource
import signal
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

import refine
from refine.batch.autoshard import ShardPlan
from refine.config import CONFIG_NAME, load_config
from refine.run.engine import rule_files
from refine.errors import InputError
from refine.report.schema import Report, Verdict

if TYPE_CHECKING:
    from rich.table import Table

Status = Literal["verified", "refuted", "unproven", "nothing_sharded", "error", "timeout", "out_of_memory", "crashed"]
CACHE_DIR_NAME = ".refine-cache"
_CACHEABLE = ("verified", "refuted", "unproven", "nothing_sharded", "error")  # deterministic in the hashed inputs
_PLAN = re.compile(r"^tp:(\d+)$")


def cores() -> int:
    """The cores this process may run on (the default --jobs)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class BatchOptions(BaseModel):
    """What `refine batch` was asked to do (everything but the root)."""

    model_config = ConfigDict(frozen=True)

    jobs: int = Field(default_factory=lambda: cores(), ge=1)
    timeout: float | None = Field(default=600.0, gt=0, description="seconds per entry; None: no limit")
    memory_mb: int | None = Field(default=None, gt=0, description="address-space cap per worker, MiB")
    rules: tuple[Path, ...] = ()
    simulate: bool = True
    memo: bool = True
    plan_tp: int | None = Field(default=None, ge=1, description="--plan tp:N: shard plain ONNX models over N ranks")
    use_cache: bool = True
    cache_dir: Path | None = Field(default=None, description="None: ROOT/.refine-cache")
    ray: str | None = Field(default=None, description="--ray: run entries as tasks on the Ray cluster at this address "
                            "(`auto`: the one this machine runs); None: local worker processes")

    @property
    def plan(self) -> str | None:
        return None if self.plan_tp is None else f"tp:{self.plan_tp}"


def parse_plan(text: str | None) -> int | None:
    """`tp:N` -> N (the only plan the sharder knows); bad text is an InputError."""
    if text is None:
        return None
    found = _PLAN.match(text.strip())
    if not found or int(found.group(1)) < 1:
        raise InputError(None, f"--plan {text!r}: expected tp:N with N >= 1 (Megatron-style tensor parallelism over N ranks)")
    return int(found.group(1))


class Entry(BaseModel):
    """One thing to verify: a model directory, or a plain ONNX model to shard first."""

    name: str = Field(description="path relative to the batch root")
    path: Path
    kind: Literal["dir", "onnx"]


class EntryResult(BaseModel):
    """What one entry gave: the core's report, or why there is none."""

    entry: str
    kind: Literal["dir", "onnx"] = "dir"
    status: Status
    expected: Verdict = "verified"
    expected_node: str | None = None
    seconds: float = 0.0
    cached: bool = False
    failing_node: str | None = None
    error: str | None = Field(default=None, description="one line: the core's error, or how the worker ended")
    report: Report | None = None
    plan: ShardPlan | None = Field(default=None, description="--plan: what the sharder sharded and left replicated")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        """Did the entry give what it declares (verified, if it declares nothing)?"""
        if self.status != self.expected:
            return False
        return self.expected_node is None or self.failing_node == self.expected_node


class BatchReport(BaseModel):
    """A whole batch: options, timing and every entry's result, in entry order."""

    root: str
    refine_version: str
    rules_digest: str
    jobs: int
    timeout: float | None
    memory_mb: int | None
    plan: str | None
    seconds: float
    entries: list[EntryResult]

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.entries)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def counts(self) -> Counter[str]:
        return Counter(e.status for e in self.entries)


# --- finding entries ---------------------------------------------------------------------------


def find_entries(root: Path, plan_tp: int | None = None) -> list[Entry]:
    """Every directory under `root` (itself included) holding refine.json, and with a plan every
    .onnx file outside them (a file anywhere inside a model directory belongs to that entry, as
    `_entry_files` says); hidden directories are skipped. Sorted by name."""
    if not root.is_dir():
        raise InputError(root, "not a directory (refine batch takes a directory of model directories)")
    found: list[Entry] = []
    model_dirs: set[Path] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath)
        name = here.relative_to(root).as_posix()
        if CONFIG_NAME in filenames:
            model_dirs.add(here)
            found.append(Entry(name=root.name if name == "." else name, path=here, kind="dir"))
        elif plan_tp is not None and model_dirs.isdisjoint(here.parents):
            for f in sorted(filenames):
                if f.endswith(".onnx") and not f.startswith("."):
                    found.append(Entry(name=(here / f).relative_to(root).as_posix(), path=here / f, kind="onnx"))
    if not found:
        what = "no refine.json" + (" and no .onnx model" if plan_tp is not None else " (add --plan tp:N for plain ONNX models)")
        raise InputError(root, f"holds no entry to verify: {what} below it")
    return sorted(found, key=lambda e: e.name)


# --- the cache ---------------------------------------------------------------------------------


def _hash_file(h: "hashlib._Hash", path: Path, label: str) -> None:
    h.update(f"\0{label}\0{path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def rules_digest(rule_dirs: tuple[Path, ...] | list[Path] = ()) -> str:
    """A digest of what decides a verdict besides the entry: every rule file (built-in and
    --rules), refine's version and the refine package's source."""
    h = hashlib.sha256(f"refine {refine.__version__}".encode())
    for i, path in enumerate(rule_files(list(rule_dirs))):
        try:
            _hash_file(h, path, f"rule {i} {path.name}")
        except OSError as exc:
            raise InputError(path, f"cannot read the rule file ({exc.strerror or type(exc).__name__})") from None
    package = Path(refine.__file__).parent
    for path in sorted(package.rglob("*.py")):
        _hash_file(h, path, f"src {path.relative_to(package).as_posix()}")
    return h.hexdigest()


def _entry_files(entry: Entry) -> Iterator[tuple[str, Path]]:
    """The files an entry's verdict depends on: the model, or every file of the directory
    (subdirectories that are entries themselves, and hidden ones, excluded)."""
    if entry.kind == "onnx":
        yield entry.path.name, entry.path
        return
    for dirpath, dirnames, filenames in os.walk(entry.path):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not (here / d / CONFIG_NAME).exists())
        for f in sorted(filenames):
            if not f.startswith("."):
                yield (here / f).relative_to(entry.path).as_posix(), here / f


def cache_key(entry: Entry, options: BatchOptions, digest: str) -> str:
    """The key of an entry's cached result (OSError if a file cannot be read)."""
    h = hashlib.sha256(f"{digest}\0{entry.kind}\0simulate={options.simulate}\0memo={options.memo}\0plan={options.plan}".encode())
    for label, path in _entry_files(entry):
        _hash_file(h, path, label)
    return h.hexdigest()


class Cache:
    """One JSON file per key in a directory; unreadable or stale files count as misses."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def get(self, key: str) -> EntryResult | None:
        try:
            return EntryResult.model_validate_json((self.directory / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, result: EntryResult) -> None:
        """Write atomically (a temporary file renamed into place); a failure only loses the entry."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
            with os.fdopen(fd, "w") as f:
                f.write(result.model_dump_json())
            os.replace(tmp, self.directory / f"{key}.json")
        except OSError:
            pass


def _check_cache_dir(path: Path) -> None:
    """An explicit --cache-dir must be (or become) a writable directory: bad input otherwise."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(path, f"cannot create the cache directory ({exc.strerror or type(exc).__name__})") from None
    if not os.access(path, os.W_OK):
        raise InputError(path, "the cache directory is not writable")


# --- one entry, in a worker ------------------------------------------------------------------------


def _from_report(result: EntryResult, report: Report) -> EntryResult:
    result.report = report
    result.status = report.verdict
    result.failing_node = report.failure.node if report.failure is not None and report.verdict != "verified" else None
    return result


def _verify_dir(entry: Entry, options: BatchOptions, result: EntryResult) -> EntryResult:
    from refine import pipeline

    expect = load_config(entry.path).expect
    if expect is not None:
        result.expected, result.expected_node = expect.verdict, expect.node
    report = pipeline.verify_dir(entry.path, list(options.rules) or None, simulate=options.simulate, memo=options.memo)
    return _from_report(result, report)


def _verify_onnx(entry: Entry, options: BatchOptions, result: EntryResult) -> EntryResult:
    """Shard the plain model into a scratch entry (never next to the user's file) and verify it."""
    from refine.batch import autoshard

    from refine import pipeline
    assert options.plan_tp is not None
    with tempfile.TemporaryDirectory(prefix="refine-autoshard-") as tmp:
        scratch = Path(tmp) / (entry.path.stem or "model")
        plan = autoshard.shard_file(entry.path, options.plan_tp, scratch)
        result.plan = plan
        try:
            report = pipeline.verify_dir(scratch, list(options.rules) or None, simulate=options.simulate, memo=options.memo)
        except InputError as exc:
            # the core names a file of the scratch entry; the user knows the model by its own path
            if exc.path is None or exc.path.startswith(tmp):
                exc.path = f"{entry.path}" + (f" (sharded as {Path(exc.path).name})" if exc.path else "")
            raise
    report.model = entry.name
    _from_report(result, report)
    if not plan.pairs and result.status == "verified":  # every rank runs the whole model: a proof of nothing
        result.status = "nothing_sharded"
    return result


def run_entry(entry: Entry, options: BatchOptions) -> EntryResult:
    """Verify one entry; bad input is an `error` result (one line), never an exception."""
    result = EntryResult(entry=entry.name, kind=entry.kind, status="error")
    start = time.perf_counter()
    try:
        (_verify_dir if entry.kind == "dir" else _verify_onnx)(entry, options, result)
    except InputError as exc:
        result.status, result.error = "error", exc.one_line(entry.path)
    except MemoryError:
        result.status, result.error = "out_of_memory", memory_message(entry, options)
    except RuntimeError as exc:  # clingo reports a failed allocation as std::bad_alloc
        if "bad_alloc" in str(exc):
            result.status, result.error = "out_of_memory", memory_message(entry, options)
        else:
            result.status, result.error = "crashed", _one_line(f"{entry.path}: RuntimeError: {exc}")
    except Exception as exc:  # noqa: BLE001 - a bug in refine on one entry must not stop the batch
        result.status, result.error = "crashed", _one_line(f"{entry.path}: {type(exc).__name__}: {exc}")
    result.seconds = round(time.perf_counter() - start, 3)
    return result


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def memory_message(entry: Entry, options: BatchOptions) -> str:
    cap = f"the {options.memory_mb} MiB cap (--memory)" if options.memory_mb else "the available memory"
    return f"{entry.path}: out of memory: the verifier needed more than {cap}"


def _worker(conn: Connection, entry: Entry, options: BatchOptions) -> None:
    """Child process body: cap memory, verify, send the result as JSON. Ctrl-C is the parent's
    to handle (it kills its workers), so a worker ignores it rather than dying with a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if options.memory_mb:
        limit = options.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        payload = run_entry(entry, options).model_dump_json()
    except MemoryError:  # serializing a big report can be the allocation that fails
        payload = EntryResult(entry=entry.name, kind=entry.kind, status="out_of_memory",
                              error=memory_message(entry, options)).model_dump_json()
    conn.send_bytes(payload.encode())
    conn.close()


# --- the scheduler -----------------------------------------------------------------------------------


_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _context() -> multiprocessing.context.BaseContext:
    """Forkserver workers with the verifier preloaded and one BLAS thread each (jobs x threads
    would oversubscribe the cores); fork where there is no forkserver."""
    for var in _THREAD_VARS:
        os.environ.setdefault(var, "1")  # read by the forkserver when it starts
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["refine.batch.local", "refine.pipeline", "refine.batch.autoshard"])
        return ctx
    return multiprocessing.get_context("fork")


class _Running:
    def __init__(self, entry: Entry, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.entry, self.process, self.conn = entry, process, conn
        self.start = time.perf_counter()


def worker_died(entry: Entry, exitcode: int | None, options: BatchOptions, seconds: float) -> EntryResult:
    """The result of a worker that ended without sending one."""
    if exitcode is not None and exitcode < 0:
        sig = signal.Signals(-exitcode).name
        how = f"the worker was killed by {sig}"
        if options.memory_mb and -exitcode in (signal.SIGKILL, signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS):
            how += f" (likely out of memory under the {options.memory_mb} MiB cap)"
    else:
        how = f"the worker exited with code {exitcode} without a result"
    return EntryResult(entry=entry.name, kind=entry.kind, status="crashed", error=f"{entry.path}: {how}",
                       seconds=round(seconds, 3))


def _run_parallel(entries: list[Entry], options: BatchOptions, done: Callable[[EntryResult], None],
                  started: Callable[[Entry], None]) -> None:
    """Run every entry in its own worker, at most `jobs` at a time, killing those past the limit."""
    ctx = _context()
    pending = list(reversed(entries))
    running: list[_Running] = []
    try:
        while pending or running:
            while pending and len(running) < options.jobs:
                entry = pending.pop()
                recv, send = ctx.Pipe(duplex=False)
                process = ctx.Process(target=_worker, args=(send, entry, options), name=f"refine-batch {entry.name}",
                                      daemon=True)
                process.start()
                send.close()  # the child holds the only write end: EOF once it is gone
                running.append(_Running(entry, process, recv))
                started(entry)
            now = time.perf_counter()
            deadlines = [r.start + options.timeout - now for r in running] if options.timeout else []
            ready = set(wait([r.conn for r in running], timeout=max(0.0, min(deadlines)) if deadlines else None))
            now = time.perf_counter()
            for run in list(running):
                result: EntryResult | None = None
                if run.conn in ready:
                    try:
                        result = EntryResult.model_validate_json(run.conn.recv_bytes())
                    except (EOFError, OSError, ValueError):
                        run.process.join()
                        result = worker_died(run.entry, run.process.exitcode, options, now - run.start)
                elif options.timeout and now - run.start >= options.timeout:
                    run.process.kill()
                    result = EntryResult(entry=run.entry.name, kind=run.entry.kind, status="timeout",
                                         error=f"{run.entry.path}: exceeded the {options.timeout:g} s time limit (--timeout)",
                                         seconds=round(now - run.start, 3))
                if result is None:
                    continue
                run.process.join()
                run.conn.close()
                running.remove(run)
                done(result)
    finally:
        for run in running:  # interrupted: leave no worker behind
            run.process.kill()
            run.process.join()


# --- the batch ---------------------------------------------------------------------------------------


def run_batch(root: Path, options: BatchOptions, callbacks: Callbacks | None = None) -> BatchReport:
    """Verify every entry under `root` (cached results first, the rest in workers).

    Bad input that concerns the whole batch (no entries, a bad --rules directory, an unusable
    --cache-dir) is an InputError before any work; anything about one entry is in its result.
    `callbacks` follow the progress (refine batch's progress bar).
    """
    callbacks = callbacks or Callbacks()
    start = time.perf_counter()
    entries = find_entries(root, options.plan_tp)
    digest = rules_digest(options.rules)  # InputError for a bad --rules directory
    cache: Cache | None = None
    if options.use_cache:
        if options.cache_dir is not None:
            _check_cache_dir(options.cache_dir)
        cache = Cache(options.cache_dir or root / CACHE_DIR_NAME)
    results: dict[str, EntryResult] = {}
    keys: dict[str, str] = {}
    todo: list[Entry] = []
    for entry in entries:
        if cache is None:  # no key to compute: nothing is read or written
            todo.append(entry)
            continue
        try:
            keys[entry.name] = cache_key(entry, options, digest)
        except OSError:
            todo.append(entry)  # unreadable: the worker reports it
            continue
        hit = cache.get(keys[entry.name])
        if hit is not None:
            hit.entry, hit.cached = entry.name, True
            results[entry.name] = hit
        else:
            todo.append(entry)
    callbacks.on_plan(entries, len(results))

    def done(result: EntryResult) -> None:
        results[result.entry] = result
        if cache is not None and result.status in _CACHEABLE and result.entry in keys:
            cache.put(keys[result.entry], result)
        callbacks.on_done(result)

    if options.ray is not None and todo:
        from refine.batch import ray_cluster as ray_batch  # (the optional extra: imported only when asked for)

        ray_batch.run_on_ray(todo, options, options.ray, done, callbacks.on_start)
    else:
        _run_parallel(todo, options, done, callbacks.on_start)
    return BatchReport(
        root=str(root), refine_version=refine.__version__, rules_digest=digest, jobs=options.jobs,
        timeout=options.timeout, memory_mb=options.memory_mb, plan=options.plan,
        seconds=round(time.perf_counter() - start, 3), entries=[results[e.name] for e in entries])


# --- outputs -----------------------------------------------------------------------------------------


def _summary_line(result: EntryResult) -> str:
    """What went wrong with an entry, on one line (for the JUnit message)."""
    want = result.expected + (f" at {result.expected_node}" if result.expected_node else "")
    if result.status in ("verified", "refuted", "unproven"):
        got = result.status + (f" at {result.failing_node}" if result.failing_node else "")
        reason = result.report.failure.reason if result.report and result.report.failure and result.status != "verified" else ""
        return _one_line(f"expected {want}, got {got}" + (f": {reason}" if reason else ""))
    return _one_line(f"{result.status}: {result.error or ''}")


def render_junit(batch: BatchReport) -> str:
    """JUnit XML: one testsuite, one testcase per entry; an entry that got the wrong verdict is
    a failure (body: the core's text report), one without a verdict is an error."""
    from refine.report.render import render_text

    suites = ET.Element("testsuites", name="refine.batch.local")
    suite = ET.SubElement(suites, "testsuite", name="refine.batch.local", timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
    props = ET.SubElement(suite, "properties")
    for key, value in [("root", batch.root), ("refine_version", batch.refine_version), ("plan", batch.plan or ""),
                       ("rules_digest", batch.rules_digest)]:
        ET.SubElement(props, "property", name=key, value=value)
    failures = errors = 0
    for result in batch.entries:
        case = ET.SubElement(suite, "testcase", classname="refine.batch.local", name=result.entry, time=f"{result.seconds:.3f}")
        if result.ok:
            continue
        verdict = result.status in ("verified", "refuted", "unproven")
        failures, errors = failures + verdict, errors + (not verdict)
        el = ET.SubElement(case, "failure" if verdict else "error", message=_summary_line(result), type=result.status)
        el.text = render_text(result.report) if result.report is not None else (result.error or result.status)
    for parent in (suites, suite):
        parent.set("tests", str(len(batch.entries)))
        parent.set("failures", str(failures))
        parent.set("errors", str(errors))
        parent.set("time", f"{batch.seconds:.3f}")
    suite.set("skipped", "0")
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def render_json(batch: BatchReport) -> str:
    return batch.model_dump_json(indent=1) + "\n"


STATUS_STYLE = {"verified": "green", "refuted": "red", "unproven": "yellow", "nothing_sharded": "yellow", "error": "magenta",
                "timeout": "magenta", "out_of_memory": "magenta", "crashed": "magenta"}


def detail(result: EntryResult) -> str:
    """The table's last column: the failing node, the error, or what the sharder did."""
    if result.error:
        return result.error
    parts = []
    if result.failing_node:
        failure = result.report.failure if result.report else None
        parts.append(f"{result.failing_node} ({failure.op})" if failure else result.failing_node)
    if result.plan is not None:
        parts.append(result.plan.summary)
    return "; ".join(p for p in parts if p)


def summary_table(batch: BatchReport, ascii_only: bool = False) -> Table:
    """The summary: entry, verdict, expected, time, failing node (or error) for failures;
    paths in errors are shown relative to the root."""
    from rich import box
    from rich.table import Table

    prefix = batch.root.rstrip("/") + "/"
    table = Table(title=f"refine batch {batch.root}", title_justify="left", box=box.ASCII if ascii_only else box.SIMPLE_HEAD)
    for col, kw in (("entry", {}), ("verdict", {}), ("expected", {}), ("ok", {}), ("time", {"justify": "right"}),
                    ("failing node / error", {"overflow": "fold"})):
        table.add_column(col, **kw)
    for r in batch.entries:
        time_text = f"{r.seconds:.1f}s" + (" (cached)" if r.cached else "")
        expected = r.expected + (f" at {r.expected_node}" if r.expected_node else "")
        table.add_row(r.entry, f"[{STATUS_STYLE[r.status]}]{r.status}[/]", expected,
                      "[green]ok[/]" if r.ok else "[bold red]FAIL[/]", time_text, detail(r).replace(prefix, ""))
    return table


def summary_line(batch: BatchReport) -> str:
    counts = batch.counts()
    parts = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    cached = sum(1 for e in batch.entries if e.cached)
    bad = sum(1 for e in batch.entries if not e.ok)
    verdict = "all as expected" if bad == 0 else f"{bad} not as expected"
    return (f"{len(batch.entries)} entr{'y' if len(batch.entries) == 1 else 'ies'} ({parts}; {cached} from cache) in {batch.seconds:.1f}s "
            f"with {batch.jobs} job{'s' if batch.jobs != 1 else ''}: {verdict}")


def write_outputs(batch: BatchReport, json_path: Path | None, junit_path: Path | None) -> None:
    """Write the requested files, each atomically; a failure is an InputError naming the file."""
    from refine.report.schema import write_atomic

    for path, what, render in ((json_path, "JSON", render_json), (junit_path, "JUnit", render_junit)):
        if path is None:
            continue
        try:
            write_atomic(path, render(batch))
        except OSError as exc:
            raise InputError(path, f"cannot write the {what} report ({exc.strerror or type(exc).__name__})") from None


# --- progress ----------------------------------------------------------------------------------------


@dataclass
class Callbacks:
    """What run_batch calls as the batch goes: once the work is known, per start, per result."""

    on_plan: Callable[[list[Entry], int], None] = lambda _entries, _cached: None
    on_start: Callable[[Entry], None] = lambda _entry: None
    on_done: Callable[[EntryResult], None] = lambda _result: None


@contextmanager
def progress_bar(quiet: bool, force: bool = False) -> Iterator[Callbacks]:
    """A rich progress bar on stderr (entries done / total, the ones running, one line per
    finished entry above the bar); only on a terminal, never with --quiet."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if quiet or not (force or console.is_terminal):
        yield Callbacks()
        return
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True)
    task = bar.add_task("finding entries", total=None)
    running: list[str] = []

    def describe() -> None:
        shown = ", ".join(running[:3]) + (f" +{len(running) - 3}" if len(running) > 3 else "")
        bar.update(task, description=f"verifying {shown}" if running else "verifying")

    def on_plan(entries: list[Entry], cached: int) -> None:
        bar.update(task, total=len(entries), completed=cached)
        if cached:
            bar.console.print(f"{cached} of {len(entries)} entries unchanged since the last run (cached)")

    def on_start(entry: Entry) -> None:
        running.append(entry.name)
        describe()

    def on_done(result: EntryResult) -> None:
        if result.entry in running:
            running.remove(result.entry)
        mark = "[green]ok[/]" if result.ok else "[bold red]FAIL[/]"
        bar.console.print(f"{mark} {result.entry}: [{STATUS_STYLE[result.status]}]{result.status}[/] "
                          f"({result.seconds:.1f}s)", highlight=False)
        bar.advance(task)
        describe()

    with bar:
        yield Callbacks(on_plan, on_start, on_done)


def print_summary(batch: BatchReport) -> None:
    """The summary table and one closing line on stdout (coloured on a terminal)."""
    from rich.console import Console

    console = Console(highlight=False)
    terminal = console.is_terminal
    if not terminal:
        console = Console(highlight=False, width=max(console.width, 160), no_color=True)
    console.print(summary_table(batch, ascii_only=not terminal))
    console.print(summary_line(batch))
