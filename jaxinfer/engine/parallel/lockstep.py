"""Multi-host serving: one engine run in lockstep by every process, fed by process 0.
Its `Leader` records each add and abort between steps and publishes them before the
t-th `step()` (channel.py); `follow` applies them on the other processes in the same
order and steps; `check_lockstep` refuses what would split their state; `Watchdog`
fails a step that never returns. Plain Python: the channel is passed in, so no jax.
See docs/serving.md#multi-host-serving.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import PreparedRequest, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class Channel(Protocol):
    def publish(self, step: int, message: bytes) -> None: ...

    def receive(self, step: int) -> bytes | None: ...


def check_lockstep(config: EngineConfig) -> None:
    """Raise ValueError for engine settings whose state could differ between processes."""
    if config.data_parallel_size > 1:
        raise ValueError(f"data_parallel_size={config.data_parallel_size}: multi-host "
                         "serving runs one engine over every process's devices; combine it "
                         "with data parallelism by running one server per replica")
    spec = config.speculative_config
    if spec is not None and spec.adaptive:
        raise ValueError("speculative_config adaptive=true picks k from each process's own "
                         "step times, which differ between processes: set \"adaptive\": "
                         "false for multi-host serving")


def encode(step: int, ops: Sequence[list], shutdown: bool = False) -> bytes:
    """Message `step`: its operations and whether it is the last."""
    return json.dumps({"step": step, "ops": list(ops), "shutdown": shutdown},
                      separators=(",", ":")).encode()


def add_op(request_id: str, prepared: PreparedRequest, priority: int) -> list:
    if prepared.lora is not None:  # each host would read it, and might fail alone
        raise ValueError("lora_request on a multi-host job: not supported (the hosts run "
                         "one schedule, and an adapter one of them cannot read would "
                         "split it); serve adapters with one process per host")
    params = dataclasses.asdict(prepared.params)
    return ["add", request_id, prepared.prompt, prepared.prompt_token_ids, params, priority]


def apply(engine: Engine, op: list) -> None:
    """Apply one recorded operation to a follower's engine."""
    if op[0] == "add":
        _, request_id, prompt, ids, params, priority = op
        prepared = PreparedRequest(prompt=prompt, prompt_token_ids=ids,
                                   params=SamplingParams(**params))
        engine.add_prepared(request_id, prepared, priority=priority)
    elif op[0] == "abort":
        engine.abort(op[1])
        if _known(engine, op[1]):
            engine.release(op[1])
    else:
        raise ValueError(f"unknown lockstep operation {op[0]!r}")


def _known(engine: Engine, request_id: str) -> bool:
    try:
        engine.output(request_id)
    except KeyError:
        return False
    return True


class Leader:
    """Process 0's engine: every attribute is the engine's, but adds and aborts are
    recorded and published, with the step index, before each step."""

    def __init__(self, engine: Engine, channel: Channel, *,
                 watchdog: Watchdog | None = None) -> None:
        self.engine = engine
        self.channel = channel
        self.watchdog = watchdog
        self.steps = 0  # messages published
        self._ops: list[list] = []
        self._lock = threading.Lock()  # close() may come from another thread
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, request_id: str, prompt: Any = None,
                    params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                    priority: int = 0, prompt_token_ids: list[int] | None = None) -> None:
        self.add_prepared(request_id, self.engine.prepare(
            prompt, params, messages=messages, prompt_token_ids=prompt_token_ids),
            priority=priority)

    def add_prepared(self, request_id: str, prepared: PreparedRequest, *,
                     priority: int = 0) -> None:
        self.engine.add_prepared(request_id, prepared, priority=priority)
        with self._lock:  # recorded once the engine took it: a refused add changed nothing
            self._ops.append(add_op(request_id, prepared, priority))

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        with self._lock:
            self._ops.append(["abort", request_id])

    def step(self) -> list[RequestOutput]:
        self._publish(shutdown=False)
        if self.watchdog is None:
            return self.engine.step()
        with self.watchdog.watching():
            return self.engine.step()

    def close(self) -> None:
        """Tell the followers to return (once; later steps raise)."""
        if not self._closed:
            self._publish(shutdown=True)

    def _publish(self, shutdown: bool) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the lockstep leader is closed: the followers are gone")
            ops, self._ops = self._ops, []
            self.channel.publish(self.steps, encode(self.steps, ops, shutdown))
            self.steps += 1
            self._closed = shutdown


def follow(engine: Engine, channel: Channel, *, watchdog: Watchdog | None = None,
           stop: threading.Event | None = None,
           on_step: Callable[[list[RequestOutput]], None] | None = None) -> int:
    """Run `engine` as process 0's `Leader` tells, until its shutdown message (or `stop`
    is set while no message comes); returns the number of steps run. `on_step` sees each
    step's outputs before the finished ones are released (tests)."""
    step = 0
    while stop is None or not stop.is_set():
        data = channel.receive(step)
        if data is None:  # process 0 is idle
            continue
        message = json.loads(data)
        if message["step"] != step:
            raise RuntimeError(f"lockstep message {message['step']} arrived as {step}")
        for op in message["ops"]:
            apply(engine, op)
        if message["shutdown"]:
            break
        if watchdog is None:
            outputs = engine.step()
        else:
            with watchdog.watching():
                outputs = engine.step()
        if on_step is not None:
            on_step(outputs)
        for output in outputs:
            if output.finished:
                engine.release(output.request_id)
        step += 1
    log.info("follower: process 0 said shutdown after %d step(s)", step)
    return step


class Watchdog:
    """Calls `on_hang(seconds)` once, from its own thread, when one watched step has run
    longer than `timeout_s`."""

    def __init__(self, timeout_s: float, on_hang: Callable[[float], None], *,
                 poll_s: float = 0.5) -> None:
        self.timeout_s = timeout_s
        self._on_hang = on_hang
        self._poll_s = poll_s
        self._started: float | None = None
        self._fired = False
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def watching(self) -> Iterator[None]:
        self._started = time.monotonic()
        try:
            yield
        finally:
            self._started = None

    def _watch(self) -> None:
        while not self._fired:
            time.sleep(self._poll_s)
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout_s:
                self._fired = True
                self._on_hang(time.monotonic() - started)
