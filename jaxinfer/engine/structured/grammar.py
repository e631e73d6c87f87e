"""Structured outputs on the host: a request's constraint (params.py) compiled into an
llguidance grammar (checked first by compile_process.py), its prototype matcher cached
by `spec()`, and one matcher per constrained completion that consumes its tokens
(`Constraints.advance`); beside them each completion's token filter (bad_words,
allowed_token_ids: token_filter.py). No jax, no numpy: the runner fills the mask from
these. See docs/structured_outputs.md (#limits, #how-it-works).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import pathlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import llguidance

from jaxinfer.engine.request import Request, SamplingParams
from jaxinfer.engine.structured import StructuredOutputsParams, compile_process
from jaxinfer.engine.structured.compile_process import first_line
from jaxinfer.engine.structured.token_filter import MaskRow, TokenFilter

log = logging.getLogger(__name__)
CACHE_SIZE = 64  # prototype matchers kept (distinct constraints)
MAX_SPEC_CHARS = 1_000_000  # a constraint's text: schema, regex, grammar or choices
MAX_CHOICES = 100_000


class GrammarCompiler:
    """Constraints -> prototype matchers for one tokenizer, cached by spec."""

    def __init__(self, tokenizer_path: pathlib.Path, *, vocab_size: int,
                 eos_token_id: int | None) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_path.read_text(),
                                                n_vocab=vocab_size, eos_token=eos_token_id)
        self.processes = compile_process.GrammarProcesses(str(tokenizer_path), vocab_size,
                                                          eos_token_id)
        self._native = _StackThread(compile_process.NATIVE_STACK_BYTES)
        self._cache: collections.OrderedDict[tuple[str, str], llguidance.LLMatcher] = (
            collections.OrderedDict())
        self._lock = threading.Lock()  # preparing threads share the cache
        self.hits = self.misses = 0

    def prototype(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The constraint's matcher, never advanced (copy it); ValueError naming the field."""
        key = params.spec()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
            self.misses += 1
        kind, text = key
        try:
            _check_size(params, text)
            grammar = self.processes.compile(kind, text)
            matcher = self._native.run(llguidance.LLMatcher, self.tokenizer, grammar,
                                       log_level=0, limits=compile_process.limits())
            if matcher.is_error():
                raise ValueError(first_line(matcher.get_error()))
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
        with self._lock:
            self._cache[key] = matcher
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def close(self) -> None:
        self.processes.close()


def _check_size(params: StructuredOutputsParams, text: str) -> None:
    if params.choice is not None and len(params.choice) > MAX_CHOICES:
        raise ValueError(f"{len(params.choice)} choices, over the limit of {MAX_CHOICES}")
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{len(text)} characters, over the limit of {MAX_SPEC_CHARS}")


class _StackThread:
    """One thread with a stack of `stack_bytes`, started on first use, that runs calls
    in turn: the grammar compiler recurses over a grammar's nesting."""

    def __init__(self, stack_bytes: int) -> None:
        self._stack_bytes = stack_bytes
        self._calls: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._thread is None:
                previous = threading.stack_size(self._stack_bytes)
                try:
                    self._thread = threading.Thread(target=self._serve, daemon=True,
                                                    name="grammar")
                    self._thread.start()
                finally:
                    threading.stack_size(previous)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, fn, args, kwargs))
        return future.result()

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._calls.get()
            try:
                future.set_result(fn(*args, **kwargs))
            except Exception as e:  # the caller's to handle
                future.set_exception(e)


class Constraints:
    """The engine's host-mask state: the compiler (made on first use), the matcher of
    each constrained completion in flight, and the token filter (bad_words,
    allowed_token_ids; token_filter.py) of each completion that has one."""

    def __init__(self, model_dir: pathlib.Path | None, *, vocab_size: int,
                 eos_token_ids: Sequence[int], tokenizer: Any | None = None) -> None:
        self._model_dir = model_dir  # None: no tokenizer, no constraints
        self._tokenizer = tokenizer  # jaxinfer's Tokenizer, for bad_words; None: none
        self._vocab_size = vocab_size
        self._eos = min(eos_token_ids) if eos_token_ids else None
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._matchers: dict[str, llguidance.LLMatcher] = {}  # request id -> matcher
        self._consumed: dict[str, int] = {}  # request id -> output tokens consumed
        self._filters: dict[str, TokenFilter] = {}  # request id -> its token filter

    @property
    def compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                path = (self._model_dir or pathlib.Path()) / "tokenizer.json"
                if self._model_dir is None or not path.is_file():
                    raise ValueError("structured_outputs needs the model's tokenizer.json "
                                     "(and an engine with a tokenizer)")
                self._compiler = GrammarCompiler(path, vocab_size=self._vocab_size,
                                                 eos_token_id=self._eos)
            return self._compiler

    def check(self, params: StructuredOutputsParams | None) -> llguidance.LLMatcher | None:
        """The constraint's prototype matcher, compiled now (or cached): ValueError
        naming the field. None for an unconstrained request."""
        return None if params is None else self.compiler.prototype(params)

    def token_filter(self, params: SamplingParams) -> TokenFilter | None:
        """The request's token filter (bad words tokenized now): ValueError naming the
        field. None when it asks for none."""
        return TokenFilter.build(params, self._tokenizer, self._vocab_size)

    def add(self, request: Request, prototype: llguidance.LLMatcher | None = None,
            token_filter: TokenFilter | None = None) -> None:
        """A completion's host-mask state, if it needs one: a copy of the prototype
        `check` gave and the filter `token_filter` gave (either found or built again
        without it: a follower in lockstep gets the params alone)."""
        params = request.params.structured_outputs
        if params is not None:
            prototype = prototype or self.compiler.prototype(params)
            self._matchers[request.request_id] = prototype.deep_copy()
            self._consumed[request.request_id] = 0
        token_filter = token_filter or self.token_filter(request.params)
        if token_filter is not None:
            self._filters[request.request_id] = token_filter

    def drop(self, request: Request) -> None:
        self._matchers.pop(request.request_id, None)
        self._consumed.pop(request.request_id, None)
        self._filters.pop(request.request_id, None)

    def __len__(self) -> int:
        """Completions in flight with a matcher or a filter."""
        return len(self._matchers.keys() | self._filters.keys())

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()

    def rows(self, chunks: Sequence) -> list[tuple[int, MaskRow]]:
        """(chunk index, what fills its row) of the chunks that sample and have a
        matcher, a filter or both: the rows of the step's mask to fill. Such a chunk's
        tokens are all on the host (the scheduler leaves a request that needs a token
        mask out until its last token is read)."""
        if not self._matchers and not self._filters:
            return []
        out = []
        for index, chunk in enumerate(chunks):
            request_id = chunk.request.request_id
            matcher = self._matchers.get(request_id)
            token_filter = self._filters.get(request_id)
            if chunk.num_samples and (matcher is not None or token_filter is not None):
                out.append((index, MaskRow(matcher, token_filter,
                                           chunk.request.output_token_ids)))
        return out

    def failed(self, chunks: Sequence) -> list[tuple[Request, str]]:
        """(request, why) of the chunks' unfinished requests whose matcher is in error
        (its mask for this step was not the grammar's): read before their tokens."""
        if not self._matchers:
            return []
        out = []
        for chunk in chunks:
            matcher = self._matchers.get(chunk.request.request_id)
            if matcher is not None and matcher.is_error() and not chunk.request.finished:
                out.append((chunk.request, self._error(chunk.request, matcher)))
        return out

    def advance(self, chunks: Sequence) -> list[tuple[Request, str, str | None]]:
        """Consume the tokens `Scheduler.update` appended to the chunks' constrained
        requests; returns (request, finish reason, stop reason) of the unfinished ones to
        end: "stop" where the grammar is complete, "error" (and why) where the matcher
        failed. Finished requests lose their matcher."""
        done = []
        for chunk in chunks:
            request = chunk.request
            matcher = self._matchers.get(request.request_id)
            if matcher is None:
                continue
            if request.finished:
                self.drop(request)
                continue
            start = self._consumed[request.request_id]
            new = request.output_token_ids[start:]
            if new:
                matcher.consume_tokens(new)
            self._consumed[request.request_id] = len(request.output_token_ids)
            if matcher.is_error():
                done.append((request, "error", self._error(request, matcher)))
                self.drop(request)
            elif matcher.is_stopped():
                done.append((request, "stop", None))
                self.drop(request)
        return done

    def _error(self, request: Request, matcher: llguidance.LLMatcher) -> str:
        """What a failed matcher says, in one bounded line, logged once."""
        message = (f"the output constraint failed after {len(request.output_token_ids)} "
                   f"tokens: {first_line(matcher.get_error())}")
        log.warning("request %s: %s", request.request_id, message)
        return message
