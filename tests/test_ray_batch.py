"""`refine batch --ray`: the batch on a real Ray cluster, started here on the loopback address.

Needs the `ray` extra (the CI installs it); a cluster is started once for the module with
`ray start --head` and stopped at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import invoke
from refine.batch import BatchOptions, render_json, run_batch
from refine.errors import InputError

ray = pytest.importorskip("ray")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RAY = str(Path(sys.executable).parent / "ray")
TASK_TITLE = "ray::_task_body"  # a Ray worker's process title while it runs an entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A two-CPU Ray head on 127.0.0.1 (its address), stopped after the module's tests."""
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, capture_output=True, env=env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], capture_output=True, env=env)


@pytest.fixture
def examples(tmp_path: Path) -> Path:
    """Four bundled examples (two correct, two buggy) to batch."""
    root = tmp_path / "batch"
    for name in ("mlp_tp2", "mlp_tp2_pp2", "mlp_missing_allreduce", "mlp_pp_send_partial"):
        shutil.copytree(EXAMPLES / name, root / name)
    return root


def _statuses(batch) -> dict[str, str]:  # noqa: ANN001 - a BatchReport
    return {e.entry: e.status for e in batch.entries}


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


def test_a_worker_killed_mid_entry_is_retried(cluster: str, examples: Path) -> None:
    """SIGKILL the Ray worker while it runs an entry (under --memory it waits on its capped
    child): Ray runs the task again and the entry still gets its verdict."""
    results: list = []
    batch = threading.Thread(target=lambda: results.append(
        run_batch(examples, BatchOptions(jobs=1, ray=cluster, memory_mb=2048, use_cache=False))))
    batch.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and time.monotonic() < deadline and batch.is_alive():
        found = subprocess.run(["pgrep", "-f", TASK_TITLE], capture_output=True, text=True).stdout.split()
        if found:
            killed = int(found[0])
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
