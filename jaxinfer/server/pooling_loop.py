"""The one thread that owns a PoolingEngine (`PoolingLoop`): handlers tokenize and check
their inputs on a few preparing threads, queue them, and the thread pools everything
queued in one `engine.pool` call, so concurrent requests share a batch. A batch that
fails is pooled again request by request: the error reaches its own request only. See
docs/pooling.md#serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxinfer.server.engine_loop import resolve
from jaxinfer.server.protocol import APIError

if TYPE_CHECKING:
    from jaxinfer.pooling.engine import Input, Pooled, PoolingEngine

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # how long the idle thread blocks on its queue before looking again
PREPARING_THREADS = 4  # requests tokenized (or their answers rendered) at once


@dataclasses.dataclass
class _Job:
    """One HTTP request's inputs and the future its handler awaits."""

    inputs: list[Input]
    future: asyncio.Future


class PoolingLoop:
    """Runs `engine.pool` on a background thread for the handlers; the server's face
    (`healthy`, `accepting`, `num_in_flight`, `abort_all`) is EngineLoop's."""

    def __init__(self, engine: PoolingEngine, *, max_waiting_requests: int) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests  # inputs queued, not yet pooling
        self.accepting = True
        self.failure: str | None = None  # never set: a failed batch fails its requests only
        self._commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0  # inputs queued
        self._running = 0  # inputs in the engine.pool call under way
        self._jobs = 0  # requests queued or pooling
        self.totals = {"requests": 0, "failed_requests": 0, "inputs": 0,
                       "prompt_tokens": 0, "batches": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pooling", daemon=True)
        # tokenizing off the pooling thread: a long input cannot hold a batch back
        self._preparers = concurrent.futures.ThreadPoolExecutor(
            PREPARING_THREADS, thread_name_prefix="pooling-prepare")

    # ---- the handlers' side (event loop thread) --------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)
        self._preparers.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return self.failure is None

    @property
    def num_in_flight(self) -> int:
        return self._jobs

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a preparing thread (tokenizing, checking, rendering)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._preparers, functools.partial(fn, *args))

    async def pool(self, inputs: list[Input]) -> list[Pooled]:
        """The inputs pooled in the thread's next batch, with whatever else is queued."""
        self._admit(len(inputs))
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("pool", _Job(inputs, future)))
        return await future

    def _admit(self, size: int) -> None:
        if not self.accepting:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        with self._lock:
            # a request alone is always taken: refused, it would be retried forever
            if self._waiting and self._waiting + size > self.max_waiting_requests:
                raise APIError(503, f"too many inputs waiting (max_waiting_requests="
                               f"{self.max_waiting_requests}); retry later",
                               code="overloaded", retry_after=1)
            self._waiting += size
            self._jobs += 1

    def abort_all(self, message: str) -> None:
        """Fail every request still queued with a 503 carrying `message` (a batch being
        pooled finishes: a step cannot be stopped midway)."""
        self._commands.put(("abort_all", message))

    def snapshot(self) -> dict[str, int]:
        """The counters and gauges /metrics shows."""
        with self._lock:
            return {**self.totals, "waiting": self._waiting, "running": self._running}

    # ---- the pooling thread ----------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                commands = [self._commands.get(timeout=IDLE_WAIT_S)]
            except queue.Empty:
                continue
            with contextlib.suppress(queue.Empty):
                while True:
                    commands.append(self._commands.get_nowait())
            try:
                self._handle(commands)
            except Exception:  # never lose the thread: its requests were told already
                log.exception("the pooling thread failed")

    def _handle(self, commands: list[tuple[Any, ...]]) -> None:
        jobs: list[_Job] = []
        for command in commands:
            if command[0] == "pool":
                jobs.append(command[1])
                with self._lock:
                    self._waiting -= len(command[1].inputs)
            elif command[0] == "abort_all":
                for job in jobs:
                    self._finish(job, error=APIError(503, command[1], code="shutting_down"))
                jobs = []
        if jobs:
            self._pool(jobs)

    def _pool(self, jobs: list[_Job]) -> None:
        """One engine.pool call for every job's inputs; on failure, each job alone."""
        inputs = [item for job in jobs for item in job.inputs]
        with self._lock:
            self._running = len(inputs)
        try:
            pooled = self.engine.pool(inputs)
        except Exception as e:
            if len(jobs) > 1:
                log.warning("a batch of %d requests failed (%s); pooling each alone",
                            len(jobs), e)
                for job in jobs:
                    self._pool([job])
                return
            log.exception("pooling a request failed")
            self._finish(jobs[0], error=APIError(500, f"pooling failed: "
                                                 f"{type(e).__name__}: {e}"))
            return
        finally:
            with self._lock:
                self._running = 0
        with self._lock:
            self.totals["batches"] += 1
        start = 0
        for job in jobs:
            self._finish(job, pooled[start:start + len(job.inputs)])
            start += len(job.inputs)

    def _finish(self, job: _Job, value: Any = None, *, error: APIError | None = None) -> None:
        with self._lock:
            self._jobs -= 1
            if error is None:
                self.totals["requests"] += 1
                self.totals["inputs"] += len(job.inputs)
                self.totals["prompt_tokens"] += sum(len(ids) for ids, _ in job.inputs)
            else:
                self.totals["failed_requests"] += 1
        resolve(job.future, value, error=error)
