"""One `refine batch` entry verified, in a worker process of its own (refine/batch/local.py's pool,
or a Ray task: refine/batch/ray_cluster.py), and the cache of verdicts.

Verdicts are cached under a key hashing the entry's files, the options that change a verdict,
every rule file (`refine.run.engine.rule_files`, user `--rules` directories included), refine's
version and the source of the refine package: a re-run only verifies what changed, and a
change to any rule file invalidates every cached verdict. Timeouts and crashes are never
cached. Cache files are written atomically.
"""

from __future__ import annotations

import hashlib
import os
import resource
import signal
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

from refine.batch.entries import BatchOptions, Entry, EntryResult
from refine.config import CONFIG_NAME, load_config
from refine.errors import InputError
from refine.report.schema import Report
from refine.run.engine import rule_files
from refine.version import __version__

CACHE_DIR_NAME = ".refine-cache"
CACHEABLE = ("verified", "refuted", "unproven", "nothing_sharded", "error")  # deterministic in the hashed inputs

# --- the cache ---------------------------------------------------------------------------------


def _hash_file(h: "hashlib._Hash", path: Path, label: str) -> None:
    h.update(f"\0{label}\0{path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def rules_digest(rule_dirs: tuple[Path, ...] | list[Path] = ()) -> str:
    """A digest of what decides a verdict besides the entry: every rule file (built-in and
    --rules), refine's version and the refine package's source."""
    h = hashlib.sha256(f"refine {__version__}".encode())
    for i, path in enumerate(rule_files(list(rule_dirs))):
        try:
            _hash_file(h, path, f"rule {i} {path.name}")
        except OSError as exc:
            raise InputError(path, f"cannot read the rule file ({exc.strerror or type(exc).__name__})") from None
    package = Path(__file__).resolve().parent.parent  # (the refine package)
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


def check_cache_dir(path: Path) -> None:
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
    from refine import pipeline
    from refine.batch import autoshard
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
            result.status, result.error = "crashed", one_line(f"{entry.path}: RuntimeError: {exc}")
    except Exception as exc:  # noqa: BLE001 - a bug in refine on one entry must not stop the batch
        result.status, result.error = "crashed", one_line(f"{entry.path}: {type(exc).__name__}: {exc}")
    result.seconds = round(time.perf_counter() - start, 3)
    return result


def one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def memory_message(entry: Entry, options: BatchOptions) -> str:
    cap = f"the {options.memory_mb} MiB cap (--memory)" if options.memory_mb else "the available memory"
    return f"{entry.path}: out of memory: the verifier needed more than {cap}"


def worker(conn: Connection, entry: Entry, options: BatchOptions) -> None:
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


