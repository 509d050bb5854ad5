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

Verdicts are cached (refine/batch/verify_entry.py) under a key hashing the entry's files, the options that change a verdict,
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

import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from refine.batch.entries import (
    BatchOptions,
    BatchReport,
    Entry,
    EntryResult,
    find_entries,
)
from refine.batch.output import STATUS_STYLE
from refine.batch.verify_entry import (
    CACHE_DIR_NAME,
    CACHEABLE,
    Cache,
    cache_key,
    check_cache_dir,
    rules_digest,
    worker,
    worker_died,
)
from refine.version import __version__

# --- the scheduler -----------------------------------------------------------------------------------


_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _context() -> multiprocessing.context.BaseContext:
    """Forkserver workers with the verifier preloaded and one BLAS thread each (jobs x threads
    would oversubscribe the cores); fork where there is no forkserver."""
    for var in _THREAD_VARS:
        os.environ.setdefault(var, "1")  # read by the forkserver when it starts
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["refine.batch.verify_entry", "refine.pipeline", "refine.batch.autoshard"])
        return ctx
    return multiprocessing.get_context("fork")


class _Running:
    def __init__(self, entry: Entry, process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
        self.entry, self.process, self.conn = entry, process, conn
        self.start = time.perf_counter()


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
                process = ctx.Process(target=worker, args=(send, entry, options), name=f"refine-batch {entry.name}",
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
            check_cache_dir(options.cache_dir)
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
        if cache is not None and result.status in CACHEABLE and result.entry in keys:
            cache.put(keys[result.entry], result)
        callbacks.on_done(result)

    if options.ray is not None and todo:
        from refine.batch import (
            ray_cluster as ray_batch,  # (the optional extra: imported only when asked for)
        )

        ray_batch.run_on_ray(todo, options, options.ray, done, callbacks.on_start)
    else:
        _run_parallel(todo, options, done, callbacks.on_start)
    return BatchReport(
        root=str(root), refine_version=__version__, rules_digest=digest, jobs=options.jobs,
        timeout=options.timeout, memory_mb=options.memory_mb, plan=options.plan,
        seconds=round(time.perf_counter() - start, 3), entries=[results[e.name] for e in entries])


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
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

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


