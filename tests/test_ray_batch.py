"""`refine batch --ray`: the batch on a real Ray cluster, started here on the loopback address.

Needs the `ray` extra (the CI installs it); a cluster is started once for the module with
`ray start --head` and stopped at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import SWEEP, invoke
from refine.batch.entries import BatchOptions
from refine.batch.local import run_batch
from refine.batch.output import render_json
from refine.errors import InputError

ray = pytest.importorskip("ray")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RAY = str(Path(sys.executable).parent / "ray")
TASK_TITLE = "ray::_task_body"  # a Ray worker's process title while it runs an entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _own_processes(temp_dir: str) -> list[int]:
    """The processes of the cluster started with `temp_dir` (its head's processes name it on
    their command lines) and their descendants (the workers, which retitle themselves): never
    another cluster's on the same machine, which `ray stop --force` or a bare pgrep would hit."""
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    heads = {pid for pid in pids if temp_dir in _cmdline(pid)}
    own = set(heads)
    for pid in pids:
        ancestor, seen = _parent(pid), 0
        while ancestor > 1 and seen < 64:
            if ancestor in heads:
                own.add(pid)
                break
            ancestor, seen = _parent(ancestor), seen + 1
    return sorted(own - {os.getpid()})


@pytest.fixture(scope="module")
def ray_head() -> Iterator[tuple[str, str]]:
    """A two-CPU Ray head on 127.0.0.1 with a temp dir of its own ((address, temp dir)); its
    processes, and only those, are stopped after the module's tests."""
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rayt", dir="/tmp")  # (short: Ray's socket paths live under it)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                    "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
                   check=True, capture_output=True, env=env)
    try:
        yield f"127.0.0.1:{port}", temp_dir
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for pid in _own_processes(temp_dir):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _own_processes(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in _own_processes(temp_dir):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(ray_head: tuple[str, str]) -> str:
    """The test cluster's address."""
    return ray_head[0]


@pytest.fixture
def examples(tmp_path: Path) -> Path:
    """Four bundled examples (two correct, two buggy) to batch."""
    root = tmp_path / "batch"
    for name in ("mlp_tp2", "mlp_tp2_pp2", "mlp_missing_allreduce", "mlp_pp_send_partial"):
        shutil.copytree(EXAMPLES / name, root / name)
    return root


def _statuses(batch) -> dict[str, str]:  # noqa: ANN001 - a BatchReport
    return {e.entry: e.status for e in batch.entries}


@pytest.mark.skipif(not SWEEP, reason="harness.SWEEP: the CLI test runs the same entries on the cluster")
def test_batch_on_ray_gives_what_the_local_pool_gives(cluster: str, examples: Path) -> None:
    on_ray = run_batch(examples, BatchOptions(jobs=2, ray=cluster, use_cache=False))
    local = run_batch(examples, BatchOptions(jobs=2, use_cache=False))
    assert on_ray.ok and local.ok, render_json(on_ray)
    assert _statuses(on_ray) == _statuses(local) == {
        "mlp_tp2": "verified", "mlp_tp2_pp2": "verified", "mlp_missing_allreduce": "refuted", "mlp_pp_send_partial": "refuted"}
    assert [e.failing_node for e in on_ray.entries] == [e.failing_node for e in local.entries]


def test_cached_verdicts_are_shared_with_the_local_pool(cluster: str, examples: Path) -> None:
    """The cache is the local one: entries verified on Ray are not verified again locally."""
    first = run_batch(examples, BatchOptions(jobs=2, ray=cluster))
    again = run_batch(examples, BatchOptions(jobs=2))
    assert not any(e.cached for e in first.entries) and all(e.cached for e in again.entries), (render_json(first), render_json(again))
    assert _statuses(first) == _statuses(again)


def test_a_worker_killed_mid_entry_is_retried(ray_head: tuple[str, str], examples: Path) -> None:
    """SIGKILL the Ray worker while it runs an entry (under --memory it waits on its capped
    child): Ray runs the task again and the entry still gets its verdict."""
    cluster, temp_dir = ray_head
    results: list = []
    batch = threading.Thread(target=lambda: results.append(
        run_batch(examples, BatchOptions(jobs=1, ray=cluster, memory_mb=2048, use_cache=False))))
    batch.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and time.monotonic() < deadline and batch.is_alive():
        found = [pid for pid in _own_processes(temp_dir) if TASK_TITLE in _cmdline(pid)]
        if found:
            killed = found[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.02)
    batch.join(timeout=300)
    assert killed is not None, "no Ray worker ran an entry"
    assert results and results[0].ok, render_json(results[0]) if results else "the batch did not finish"
    assert _statuses(results[0])["mlp_tp2"] == "verified"


def test_time_and_memory_limits_hold_on_ray(cluster: str, examples: Path) -> None:
    """--timeout stops the entry (the capped child takes longer than 0.3 s just to start);
    --memory caps the child that verifies (far too little: no result)."""
    slow = run_batch(examples, BatchOptions(jobs=2, ray=cluster, timeout=0.3, memory_mb=2048, use_cache=False))
    assert set(_statuses(slow).values()) == {"timeout"}, render_json(slow)
    starved = run_batch(examples, BatchOptions(jobs=2, ray=cluster, memory_mb=64, use_cache=False))
    assert set(_statuses(starved).values()) <= {"out_of_memory", "crashed"}
    assert all("memory" in (e.error or "") or "killed" in (e.error or "") or "exited" in (e.error or "")
               for e in starved.entries), render_json(starved)


def test_no_cluster_at_the_address_is_one_line(examples: Path) -> None:
    if ray.is_initialized():
        ray.shutdown()
    with pytest.raises(InputError, match="no Ray cluster answers there"):
        run_batch(examples, BatchOptions(jobs=1, ray=f"127.0.0.1:{_free_port()}", use_cache=False))


def test_without_the_extra_ray_is_one_line(monkeypatch: pytest.MonkeyPatch, examples: Path) -> None:
    import importlib

    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module",
                        lambda name, *a: (_ for _ in ()).throw(ImportError(name)) if name == "ray" else real(name, *a))
    with pytest.raises(InputError, match=r"pip install 'refine\[ray\]'"):
        run_batch(examples, BatchOptions(jobs=1, ray="auto", use_cache=False))


def test_cli_batch_on_ray(cluster: str, examples: Path, tmp_path: Path) -> None:
    if ray.is_initialized():
        ray.shutdown()
    out = tmp_path / "batch.json"
    result = invoke("batch", examples, "--ray", cluster, "--no-cache", "--json", out)
    assert result.exit_code == 0, result.output
    assert "mlp_pp_send_partial" in result.output
    assert {e["entry"]: e["status"] for e in json.loads(out.read_text())["entries"]}["mlp_tp2_pp2"] == "verified"
    bad = invoke("batch", examples, "--ray", f"127.0.0.1:{_free_port()}")
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1, bad.output
