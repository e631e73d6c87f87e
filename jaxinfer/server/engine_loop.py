"""The one thread that owns the Engine (`EngineLoop`): prompts prepared on other threads,
commands through a thread-safe queue, each step's deltas posted to the handlers'
streams, admission bounded by `max_waiting_requests`. See docs/serving.md#admission.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import (
    PreparedRequest,
    RequestOutput,
    SamplingParams,
)
from jaxinfer.server import adapters, protocol, tools
from jaxinfer.server.protocol import APIError
from jaxinfer.server.streams import Inbox, Stream, Update, moved, piece_of

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5  # how long the idle thread blocks on its queue before looking again
PREPARING_THREADS = 4  # prompts tokenized at once


@dataclasses.dataclass(frozen=True, kw_only=True)
class Submission:
    """One prompt (text, token ids, or chat messages) and how to sample it."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    params: SamplingParams
    add_generation_prompt: bool = True
    limit: protocol.MaxTokens = protocol.MaxTokens(16)
    echo: bool = False  # the handler needs the prompt's text (`Stream.prompt_text`)
    tools: list[dict] | None = None  # chat: the functions the template shows the model
    continue_final_message: bool = False  # chat: go on writing the last message
    template_kwargs: dict | None = None  # chat: the template's variables (vLLM's)
    priority: int = 0  # lower runs first
    # the field an output constraint came in: the param of an error compiling it
    constraint_field: str | None = None
    lora: Any = None  # the LoRARequest of the adapter the request's `model` named


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A submission made ready off the engine thread: checked, tokenized, final params."""

    request: PreparedRequest
    text: str  # the echoed prompt (`Submission.echo`), else ""
    priority: int = 0
    lora: Any = None  # attached on the engine thread, which alone touches adapters


class EngineLoop:
    """Runs `engine` on a background thread; the faces submit, abort and read metrics."""

    def __init__(self, engine: Engine, *, max_waiting_requests: int) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.accepting = True
        self.failure: str | None = None  # set once engine.step() failed
        self._commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._streams: dict[str, tuple[Stream, list[bool]]] = {}  # id -> (stream, done[i])
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._admitting = 0  # completions submitted, not yet added to the engine
        self._waiting = 0  # completions the scheduler holds waiting, after the last step
        self._slots = engine.counts()[2]  # max_num_seqs, of every data-parallel replica
        self._free = self._slots  # slots the running batch does not use, after the last step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # Tokenizing and checking prompts: never on the engine thread, so a long prompt
        # cannot stall the others' steps.
        self._preparers = concurrent.futures.ThreadPoolExecutor(
            PREPARING_THREADS, thread_name_prefix="prepare")

    # ---- the handlers' side (event loop thread) --------------------------------------

    def start(self) -> None:
        self._thread.start()

    async def submit(self, submissions: list[Submission], inbox: Inbox) -> list[Stream]:
        """Queue one HTTP request's prompts, all or none: returns once the engine added
        them all; else raises APIError before any of them started."""
        total = sum(submission.params.n for submission in submissions)
        self._check_capacity(submissions, total)
        if not self.healthy:
            raise APIError(503, f"the engine failed: {self.failure}", code="engine_failed")
        if not self.accepting:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        with self._lock:
            if self._waiting + self._admitting + total > self.max_waiting_requests + self._free:
                raise APIError(503, f"too many requests waiting (max_waiting_requests="
                               f"{self.max_waiting_requests}); retry later",
                               code="overloaded", retry_after=1)
            self._admitting += total
        loop = asyncio.get_running_loop()
        try:
            prepared = await asyncio.gather(*(
                loop.run_in_executor(self._preparers, self._prepare, submission)
                for submission in submissions))
        except BaseException:
            with self._lock:
                self._admitting -= total
            raise
        streams = [Stream(inbox, f"req-{next(self._ids)}", p.request.params.n, p.text)
                   for p in prepared]
        added = loop.create_future()
        self._commands.put(("add", list(zip(prepared, streams, strict=True)), added))
        try:
            await added
        except asyncio.CancelledError:
            for stream in streams:
                self.abort(stream.request_id)
            raise
        for stream, p, submission in zip(streams, prepared, submissions, strict=True):
            stream.prompt_token_ids = p.request.prompt_token_ids
            stream.constraint_field = submission.constraint_field
        return streams

    def _check_capacity(self, submissions: list[Submission], total: int) -> None:
        """400 for a request of more completions than the server ever admits at once (a
        503 would be retried forever)."""
        capacity = self.max_waiting_requests + self._slots
        if total <= capacity:
            return
        n = submissions[0].params.n
        what = f"n={n}" if len(submissions) == 1 else f"{len(submissions)} prompts x n={n}"
        raise APIError(400, f"the request asks for {total} completions ({what}), more than "
                       f"the server ever admits at once: {capacity} (max_num_seqs "
                       f"{self._slots} + max_waiting_requests {self.max_waiting_requests}); "
                       "send fewer prompts or a smaller n",
                       param="n" if len(submissions) == 1 else "prompt")

    def _prepare(self, submission: Submission) -> Prepared:
        """On a preparing thread: the prompt tokenized (the tokenizer lets go of the GIL)
        and the request checked; an APIError if it cannot be served."""
        try:
            ids = self._prompt_ids(submission)
            params = protocol.fit_max_tokens(submission.params, len(ids),
                                             self.engine.max_model_len, submission.limit)
        except (ValueError, TypeError) as e:
            if isinstance(e, APIError):
                raise
            raise APIError(400, str(e), param=_param(submission, e)) from None
        try:
            request = self.engine.prepare(submission.prompt, params, prompt_token_ids=ids)
            text = self._prompt_text(submission.prompt, ids) if submission.echo else ""
        except APIError:
            raise
        except (ValueError, TypeError) as e:  # a constraint the engine cannot compile too
            raise APIError(400, str(e), param=_param(submission, e, prepared=True)) from None
        except Exception as e:
            log.exception("preparing a request failed")
            raise APIError(500, f"adding the request failed: {e}") from None
        return Prepared(request, text, submission.priority, submission.lora)

    def _prompt_ids(self, submission: Submission) -> list[int]:
        chat = {} if submission.messages is None else {
            "continue_final_message": submission.continue_final_message,
            "template_kwargs": submission.template_kwargs}
        if submission.tools is not None:
            return tools.prompt_token_ids(self.engine, submission.messages, submission.tools,
                                          submission.add_generation_prompt, **chat)
        return self.engine.prompt_token_ids(
            submission.prompt, submission.messages,
            add_generation_prompt=submission.add_generation_prompt,
            truncate=submission.params.truncate_prompt_tokens, **chat)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages (a client went away); unknown ids: nothing."""
        self._commands.put(("abort", request_id))

    def abort_all(self, message: str) -> None:
        """Fail every request in flight with a 503 carrying `message`."""
        self._commands.put(("abort_all", message))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """`fn(engine)` run on the engine thread between steps (metrics snapshots)."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, future))
        return await future

    @property
    def healthy(self) -> bool:
        return self.failure is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + self._admitting

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)
        self._preparers.shutdown(wait=False, cancel_futures=True)

    # ---- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception as e:  # the engine is broken: fail everyone, stay to say so
                if self.healthy:
                    self._fail_engine(e)
                else:
                    log.exception("the engine thread failed again")

    def _iterate(self) -> None:
        """Handle the commands waiting (wait for one when idle), then run one step."""
        busy = self._runnable()
        self._drain(block=not busy)
        with self._lock:  # aborts free slots too, and may leave the engine idle
            self._count()
        if not self._runnable():
            return
        outputs = self.engine.step()
        for output in outputs:
            self._deliver(output)
        with self._lock:
            self._count()

    def _runnable(self) -> bool:
        """Whether a step would do work: paused (pause_generation), requests wait."""
        return (self.healthy and self.engine.has_unfinished()
                and not getattr(self.engine, "paused", False))

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else \
                self._commands.get_nowait()
            while True:
                self._handle(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _handle(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "add":
            self._add(command[1], command[2])
        elif kind == "abort":
            self._abort(command[1], None)
        elif kind == "abort_all":
            for request_id in list(self._streams):
                self._abort(request_id, APIError(503, command[1], code="shutting_down"))
        elif kind == "call":
            _, fn, future = command
            try:
                resolve(future, fn(self.engine))
            except Exception as e:
                resolve(future, error=e)

    def _add(self, group: list[tuple[Prepared, Stream]], added: asyncio.Future) -> None:
        """Add one HTTP request's prompts to the engine, all or none."""
        streams = []
        try:
            if not self.healthy:
                raise APIError(503, f"the engine failed: {self.failure}", code="engine_failed")
            if self.engine.is_sleeping():  # vLLM's answer while asleep
                raise APIError(503, "the model is sleeping: POST /wake_up first",
                               code="sleeping")
            for prepared, stream in group:
                request = adapters.attach(self.engine, prepared.request, prepared.lora)
                self.engine.add_prepared(stream.request_id, request, priority=prepared.priority)
                streams.append(stream)
        except Exception as e:
            if not isinstance(e, APIError):
                log.exception("adding request %s failed", group[len(streams)][1].request_id)
                e = APIError(500, f"adding the request failed: {e}")
            for stream in streams:
                self.engine.abort(stream.request_id)
                self.engine.release(stream.request_id)
            resolve(added, error=e)
        else:
            for stream in streams:
                self._streams[stream.request_id] = (stream, [False] * stream.n)
            resolve(added)
        finally:
            with self._lock:
                self._admitting -= sum(stream.n for _, stream in group)
                self._count()

    def _count(self) -> None:
        self._waiting, running, _ = self.engine.counts()
        self._free = max(0, self._slots - running)

    def _prompt_text(self, prompt: str | list[int] | None, ids: list[int]) -> str:
        """What an echo shows: a text prompt as given, token ids decoded (special tokens
        kept), nothing without a tokenizer."""
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=False)

    def _deliver(self, output: RequestOutput) -> None:
        entry = self._streams.get(output.request_id)
        if entry is None:
            return
        stream, done = entry
        failed = next((c for c in output.outputs if c.finish_reason == "error"), None)
        if failed is not None:  # its output constraint failed: the client is told so
            self._abort(output.request_id, APIError(
                400, f"{stream.constraint_field or 'structured_outputs'}: {failed.stop_reason}",
                param=stream.constraint_field, code="constraint_failed"))
            return
        try:
            stream.num_cached_tokens = output.num_cached_tokens
            pieces = [p for p in map(piece_of, output.outputs) if moved(p, done)]
            for piece in pieces:
                done[piece.index] = piece.finish_reason is not None
            if output.finished:
                self._forget(output.request_id)
            stream.post(Update(pieces, output.finished,
                               prompt_logprobs=output.prompt_logprobs))
        except Exception as e:  # this request alone fails
            log.exception("request %s failed", output.request_id)
            self._abort(output.request_id, APIError(500, f"the request failed: {e}"))

    def _abort(self, request_id: str, error: APIError | None) -> None:
        if request_id not in self._streams:
            return
        stream, _ = self._streams[request_id]
        self.engine.abort(request_id)
        self._forget(request_id)
        if error is not None:
            stream.post(Update([], True, error))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.release(request_id)

    # Called once, with the failure, after the requests in flight were failed: a
    # multi-host server exits then (server/__init__.py), a lost process cannot rejoin.
    on_failure: Callable[[str], None] | None = None

    def fail(self, error: Exception) -> None:
        """Fail the engine from another thread, the engine thread being stuck in a step
        that does not return (the multi-host step watchdog)."""
        if self.healthy:
            self._fail_engine(error)

    def _fail_engine(self, error: Exception) -> None:
        log.error("the engine failed; failing %d requests", len(self._streams),
                  exc_info=error)
        self.failure = f"{type(error).__name__}: {error}"
        for stream, _ in list(self._streams.values()):
            stream.post(Update([], True, APIError(500, f"the engine failed: {self.failure}",
                                                  code="engine_failed")))
        self._streams.clear()
        if self.on_failure is not None:
            self.on_failure(self.failure)


def _param(submission: Submission, error: Exception, prepared: bool = False) -> str:
    """The field an engine-side ValueError is about: the one it opens with (`top_k=...`,
    `min_tokens with 20 stop ids`), else the prompt. Preparing a constrained request, an
    error that names no other field is the constraint's (the engine compiles it then)."""
    head = protocol.error_field(error)
    constrained = prepared and submission.params.structured_outputs is not None
    if constrained and head in (None, "structured_outputs") and submission.constraint_field:
        return submission.constraint_field
    if head is not None:
        return submission.limit.field if head == "max_tokens" else head
    return "messages" if submission.messages is not None else "prompt"


def resolve(future: asyncio.Future, value: Any = None, *,
             error: BaseException | None = None) -> None:
    """Settle an asyncio future from another thread (unless its waiter gave up): the
    engine's, or the pooling loop's."""
    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    with contextlib.suppress(RuntimeError):  # a closed event loop: nobody waits
        future.get_loop().call_soon_threadsafe(settle)

