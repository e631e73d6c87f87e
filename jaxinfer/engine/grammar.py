"""Structured outputs on the host: a request's constraint (engine/structured.py) compiled
into an llguidance grammar, and one matcher per constrained completion. No jax, no
numpy: the step's bitmask is filled in the runner (runner/token_masks.py) from the
matchers this module hands it.

A grammar compiles once per distinct constraint (`StructuredOutputsParams.spec()`, an LRU
of `CACHE_SIZE`), is validated against the tokenizer, and a constraint that cannot
compile is a ValueError naming the field ("structured_outputs.json: ..."), raised when
the request is checked, so it never reaches a step. Each completion (n > 1: each of
them) gets its own matcher, which consumes the completion's tokens once each, when the
host reads them (`Constraints.advance`: a preempted request keeps its tokens, so its
recompute consumes nothing again); a matcher that has stopped (the grammar is complete)
finishes its request with "stop".
"""

from __future__ import annotations

import collections
import json
import logging
import pathlib
from collections.abc import Sequence

import llguidance

from jaxinfer.engine.request import Request
from jaxinfer.engine.structured import StructuredOutputsParams

log = logging.getLogger(__name__)
CACHE_SIZE = 256  # compiled grammars kept (distinct constraints)
JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarCompiler:
    """Constraints -> llguidance grammars for one tokenizer, cached by spec."""

    def __init__(self, tokenizer_json: str, *, vocab_size: int, eos_token_id: int | None
                 ) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_token_id)
        self._cache: collections.OrderedDict[tuple[str, str], str] = (
            collections.OrderedDict())
        self.hits = self.misses = 0

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The checked llguidance grammar of `params`; ValueError naming the field."""
        key = params.spec()
        if key in self._cache:
            self._cache.move_to_end(key)
            self.hits += 1
            return self._cache[key]
        self.misses += 1
        kind, text = key
        try:
            grammar = _grammar(kind, text)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"structured_outputs.{kind}: {error.strip()}")
        self._cache[key] = grammar
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return grammar

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(params))
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error()}")
        return matcher


def _grammar(kind: str, text: str) -> str:
    """The llguidance grammar of a spec. JSON is compact (no whitespace between tokens
    but the separators', vLLM's `disable_any_whitespace`): with free whitespace a small
    model pads a document until max_tokens. `grammar` is EBNF (GBNF) or Lark, told
    apart by llguidance; `choice` an alternation of the literal strings."""
    if kind in ("json", "json_object"):
        schema = json.loads(text) if kind == "json" else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    return llguidance.grammar_from(kind, text)  # choice: spec() gives a JSON list


class Constraints:
    """The engine's structured-output state: the compiler (made on first use) and the
    matcher of each constrained completion in flight."""

    def __init__(self, model_dir: pathlib.Path | None, *, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> None:
        self._model_dir = model_dir  # None: no tokenizer, no constraints
        self._vocab_size = vocab_size
        self._eos = min(eos_token_ids) if eos_token_ids else None
        self._compiler: GrammarCompiler | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}  # request id -> matcher
        self._consumed: dict[str, int] = {}  # request id -> output tokens consumed

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            path = (self._model_dir or pathlib.Path()) / "tokenizer.json"
            if self._model_dir is None or not path.is_file():
                raise ValueError("structured_outputs needs the model's tokenizer.json "
                                 "(and an engine with a tokenizer)")
            self._compiler = GrammarCompiler(path.read_text(), vocab_size=self._vocab_size,
                                             eos_token_id=self._eos)
        return self._compiler

    def check(self, params: StructuredOutputsParams | None) -> None:
        """Compile (or find cached) the grammar now: ValueError naming the field."""
        if params is not None:
            self.compiler.grammar(params)

    def add(self, request: Request) -> None:
        """A matcher for a constrained completion (others are ignored)."""
        if request.params.structured_outputs is not None:
            self._matchers[request.request_id] = self.compiler.matcher(
                request.params.structured_outputs)
            self._consumed[request.request_id] = 0

    def drop(self, request: Request) -> None:
        self._matchers.pop(request.request_id, None)
        self._consumed.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._matchers)

    def rows(self, chunks: Sequence) -> list[tuple[int, llguidance.LLMatcher]]:
        """(chunk index, matcher) of the constrained chunks that sample: the rows of the
        step's mask to fill. Such a chunk's tokens are all on the host (the scheduler
        leaves a constrained request out until its last token is read)."""
        if not self._matchers:
            return []
        return [(i, self._matchers[c.request.request_id]) for i, c in enumerate(chunks)
                if c.num_samples and c.request.request_id in self._matchers]

    def advance(self, chunks: Sequence) -> list[Request]:
        """Consume the tokens `Scheduler.update` appended to the chunks' constrained
        requests; returns the unfinished ones whose grammar is complete (to finish with
        "stop"). Finished requests lose their matcher."""
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
            if new and not matcher.consume_tokens(new):
                log.warning("request %s: a sampled token broke its grammar: %s",
                            request.request_id, matcher.get_error())
            self._consumed[request.request_id] = len(request.output_token_ids)
            if matcher.is_stopped() or matcher.is_error():
                done.append(request)
                self.drop(request)
        return done

