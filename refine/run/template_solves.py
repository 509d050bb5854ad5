"""Layer template solves, here or ahead of need in worker processes (`refine verify --jobs N`).

A memoized run (refine/run/memo.py) walks the call sites in order and solves each new (template,
key) when the walk reaches it. The next distinct layer's key is read off the previous layer's
summary, so the solves of one walk form a chain and none is ready before the one before it
ends (benchmarks/waves.py). With N jobs the chain is *guessed*: before a walk, the same walk
runs with every layer not solved yet taken to pass its inputs' relations through to its outputs
of the same position and shape (what a residual layer of a stack does: a dense layer followed
by an MoE layer, attention and linear-attention layers in turn), and every (template, key) it
meets is queued. N - 1 worker processes solve the queue ahead while this process solves what
the real walk needs, or, while a worker holds that, the next queued one.

Only the real walk's own (template, key) pairs are ever taken from here, solved by the same
`memo.solve_template` as without workers: a wrong guess costs one wasted solve, never a
different summary.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refine.run.engine import Derived
from refine.lowering.facts import FactSet

Key = frozenset[tuple[int, str, int, str]]
Summary = list[tuple[int, str, int, str]]
Solved = tuple[Summary, Derived]
Job = tuple[str, Key]  # (template, key)
SolveFn = Callable[[FactSet, Key, "list[Path] | None"], Solved]


@dataclass
class _Worker:
    """One worker process and the job it holds (None: idle)."""

    process: Any
    conn: multiprocessing.connection.Connection
    job: Job | None = None
    templates: set[str] = field(default_factory=set)  # templates whose facts it has been sent


def _serve(conn: multiprocessing.connection.Connection, solve: SolveFn, rule_dirs: list[Path] | None) -> None:
    """A worker: solve each (template, facts or None, key) received, send the result back (None
    for a solve that raised: the parent solves that pair itself if its walk needs it, and so
    raises the error where it belongs). The facts come with a template's first pair only."""
    templates: dict[str, FactSet] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        template, facts, key = message
        if facts is not None:
            templates[template] = facts
        try:
            solved = solve(templates[template], key, rule_dirs)
        except Exception:  # noqa: BLE001
            solved = None
        conn.send(solved)


class TemplateSolver:
    """Solves (template, key) pairs for one run: `__call__` gives a pair's result, solving it
    here unless a worker holds it; `ahead` queues pairs a guessed walk met, for the workers."""

    def __init__(self, templates: dict[str, FactSet], rule_dirs: list[Path] | None, jobs: int, solve: SolveFn) -> None:
        self.templates, self.rule_dirs, self._solve = templates, rule_dirs, solve
        self._workers: list[_Worker] = []
        self._started = False
        self._jobs = jobs
        self._queue: list[Job] = []
        self._done: dict[Job, Solved] = {}
        self._seen: set[Job] = set()  # every pair queued, solved or taken
        self.solved = 0  # solves run (here or by a worker)
        self.taken_ahead = 0  # results a worker or an idle wait had ready when needed

    @property
    def parallel(self) -> bool:
        return self._jobs > 1

    def ahead(self, pairs: Iterable[Job]) -> None:
        """Queue pairs for the workers (each pair once per run); starts them on first use."""
        fresh = [p for p in pairs if p not in self._seen]
        if not self.parallel or not fresh:
            return
        self._seen.update(fresh)
        self._queue.extend(fresh)
        if not self._started:
            self._start()
        self._dispatch(keep_first=True)  # (the walk needs the first at once: it is solved here)

    def __call__(self, template: str, key: Key) -> Solved:
        job = (template, key)
        self._seen.add(job)
        while True:
            self._collect(block=False)
            if job in self._done:
                self.taken_ahead += 1
                return self._done.pop(job)
            if job in self._queue:
                self._queue.remove(job)
                self._dispatch()
                return self._here(job)
            if not any(w.job == job for w in self._workers):
                self._dispatch()
                return self._here(job)
            if self._queue:  # a worker holds it: solve the next queued pair meanwhile
                other = self._queue.pop(0)
                try:
                    self._done[other] = self._here(other)
                except Exception:  # noqa: BLE001 (a guessed pair: solved again, and raised, only if needed)
                    pass
            else:
                self._collect(block=True)

    def close(self) -> None:
        """Stop the workers (a solve still running is abandoned)."""
        for w in self._workers:
            w.conn.close()
            w.process.kill()
            w.process.join()
        self._workers = []

    # --- inside -----------------------------------------------------------------------------

    def _here(self, job: Job) -> Solved:
        self.solved += 1
        return self._solve(self.templates[job[0]], job[1], self.rule_dirs)

    def _start(self) -> None:
        # a fork starts at once with the modules loaded (the worker only solves and writes to its
        # pipe); where fork is unsafe, a fresh interpreter
        self._started = True
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        for _ in range(self._jobs - 1):
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(child, self._solve, self.rule_dirs))
            try:
                process.start()
            except (AssertionError, OSError):  # (a daemonic process may not start one; out of processes)
                parent.close()
                break
            finally:
                child.close()
            self._workers.append(_Worker(process, parent))

    def _dispatch(self, keep_first: bool = False) -> None:
        """Hand queued pairs to idle workers (with `keep_first`, all but the first)."""
        for w in list(self._workers):
            if w.job is None and len(self._queue) > keep_first:
                w.job = self._queue.pop(int(keep_first))
                template, key = w.job
                try:
                    w.conn.send((template, self.templates[template] if template not in w.templates else None, key))
                except OSError:  # the worker died
                    self._lost(w)
                    continue
                w.templates.add(template)

    def _lost(self, w: _Worker) -> None:
        """A worker that died (killed, out of memory): its pair goes back to the queue's head."""
        if w.job is not None:
            self._queue.insert(0, w.job)
        self._workers.remove(w)
        w.process.kill()
        w.process.join()

    def _collect(self, block: bool) -> None:
        """Take the results the workers have finished (with `block`, wait for one)."""
        busy = [w for w in self._workers if w.job is not None]
        if not busy:
            return
        ready = multiprocessing.connection.wait([w.conn for w in busy], timeout=None if block else 0)
        for w in busy:
            if w.conn in ready:
                try:
                    value = w.conn.recv()
                except (EOFError, OSError):
                    self._lost(w)
                    continue
                if value is not None:
                    self._done[w.job] = value
                self.solved += 1
                w.job = None
        self._dispatch()
