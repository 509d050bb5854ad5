"""`refine batch --ray ADDRESS`: the batch's entries as Ray tasks on an existing cluster.

The local scheduler (refine/batch/local.py) runs each entry in a fresh process with a time and a
memory limit. Here each entry is one Ray task with the same limits. Under `--memory` the task
verifies in a fresh child process whose address space it caps (a Ray worker itself maps
gigabytes before it runs anything, so it cannot take the cap; the child dies with its worker);
without a cap it verifies in the worker, which Ray reuses. The driver keeps at most `--jobs` tasks in flight (default: the cluster's CPUs) and force-cancels
one that runs past `--timeout`. A task whose worker dies (killed, its node lost) is retried by
Ray up to `RETRIES` times, then reported as `crashed`. Results come back as the same
EntryResult JSON the local workers send, so the cache, the table, JSON and JUnit are the
local ones. Ray is an optional extra (`pip install 'refine[ray]'`); the verifier never needs it.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from refine.batch.entries import BatchOptions, Entry, EntryResult
from refine.batch.verify_entry import memory_message, run_entry, worker_died
from refine.errors import InputError

RETRIES = 2  # re-runs of a task whose worker died, before it counts as crashed
_POLL_SECONDS = 1.0  # how often the driver looks for tasks past their time limit
_joined: str | None = None  # the address this process joined


def _ray() -> Any:
    """The ray module, or one clear line if the extra is not installed."""
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise InputError(None, "--ray needs Ray, an optional extra: pip install 'refine[ray]'") from None


def connect(address: str) -> Any:
    """Join the running cluster at `address` (`auto`: the one started on this machine with
    `ray start --head`); a cluster that is not there is one line, not a traceback."""
    global _joined
    ray = _ray()
    if ray.is_initialized():
        if _joined == address:
            return ray
        ray.shutdown()  # (joined elsewhere, earlier in this process)
    if address != "auto" and not _listening(address):  # (ray.init would retry for minutes)
        raise InputError(None, f"--ray {address}: no Ray cluster answers there; start one with `ray start --head`, "
                               "or give the address it printed")
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = " ".join(str(exc).split())[:300]
        raise InputError(None, f"--ray {address}: cannot join a Ray cluster there ({first}); start one with "
                               "`ray start --head`, or give the address it printed") from None
    _joined = address
    return ray


def _listening(address: str) -> bool:
    """Does anything accept connections at HOST:PORT (a Ray head's GCS port)?"""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=5):
            return True
    except (OSError, ValueError):
        return False


def _task_body(entry_json: str, options_json: str) -> str:
    """What a Ray worker runs for one entry: the result as JSON."""
    entry, options = Entry.model_validate_json(entry_json), BatchOptions.model_validate_json(options_json)
    if not options.memory_mb:
        return run_entry(entry, options).model_dump_json()
    start = time.perf_counter()
    try:
        child = subprocess.run([sys.executable, "-m", "refine.batch.ray_cluster"], capture_output=True, text=True,
                               input=json.dumps({"entry": entry_json, "options": options_json}),
                               preexec_fn=lambda: _limit_child(options.memory_mb), timeout=options.timeout)
    except subprocess.TimeoutExpired:
        return EntryResult(entry=entry.name, kind=entry.kind, status="timeout", seconds=round(time.perf_counter() - start, 3),
                           error=f"{entry.path}: exceeded the {options.timeout:g} s time limit (--timeout)").model_dump_json()
    if child.returncode == 0 and child.stdout.strip():
        return child.stdout
    return worker_died(entry, child.returncode, options, time.perf_counter() - start).model_dump_json()


def _limit_child(memory_mb: int) -> None:
    """In the child, before it runs: the address-space cap, and death with the Ray worker
    (PR_SET_PDEATHSIG), so that a killed or cancelled task leaves nothing running."""
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG (Linux)


def _child_main() -> None:
    """`python -m refine.batch.ray_cluster`: verify the entry given on stdin, print the result's JSON."""
    given = json.loads(sys.stdin.read())
    entry, options = Entry.model_validate_json(given["entry"]), BatchOptions.model_validate_json(given["options"])
    try:
        payload = run_entry(entry, options).model_dump_json()
    except MemoryError:  # serializing a big report can be the allocation that fails
        payload = EntryResult(entry=entry.name, kind=entry.kind, status="out_of_memory",
                              error=memory_message(entry, options)).model_dump_json()
    sys.stdout.write(payload)


def run_on_ray(entries: list[Entry], options: BatchOptions, address: str, done: Callable[[EntryResult], None],
               started: Callable[[Entry], None]) -> None:
    """Run every entry as a Ray task, at most `options.jobs` in flight, each within the limits."""
    ray = connect(address)
    task = ray.remote(num_cpus=1, max_retries=RETRIES, retry_exceptions=False)(_task_body)
    jobs = options.jobs
    options_json = options.model_dump_json()
    pending = list(reversed(entries))
    running: dict[Any, tuple[Entry, float]] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                entry = pending.pop()
                running[task.remote(entry.model_dump_json(), options_json)] = (entry, time.perf_counter())
                started(entry)
            ready, _ = ray.wait(list(running), num_returns=1, timeout=_POLL_SECONDS)
            now = time.perf_counter()
            for ref in list(running):
                entry, start = running[ref]
                if ref in ready:
                    result = _collect(ray, ref, entry, now - start)
                elif options.timeout and now - start >= options.timeout:
                    ray.cancel(ref, force=True)
                    result = EntryResult(entry=entry.name, kind=entry.kind, status="timeout",
                                         error=f"{entry.path}: exceeded the {options.timeout:g} s time limit (--timeout)",
                                         seconds=round(now - start, 3))
                else:
                    continue
                del running[ref]
                done(result)
    finally:
        for ref in running:  # interrupted: leave no task behind
            ray.cancel(ref, force=True)


def _collect(ray: Any, ref: Any, entry: Entry, seconds: float) -> EntryResult:
    """A finished task's result, or `crashed` with the reason when its worker kept dying."""
    try:
        return EntryResult.model_validate_json(ray.get(ref))
    except ray.exceptions.RayError as exc:
        why = " ".join(str(exc).split())[:300]
        return EntryResult(entry=entry.name, kind=entry.kind, status="crashed", seconds=round(seconds, 3),
                           error=f"{entry.path}: the Ray task failed after {RETRIES} retries: {why}")


def cluster_cpus(address: str) -> int:
    """The CPUs the cluster at `address` offers (the default --jobs under --ray)."""
    ray = connect(address)
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


if __name__ == "__main__":
    _child_main()
