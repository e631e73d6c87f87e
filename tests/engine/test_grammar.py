"""The host side of structured outputs (engine/grammar.py), on the demo model's
tokenizer: grammars cached by spec, errors naming the field, and each completion's
matcher fed every token once (preemption recomputes tokens, never re-feeds them)."""

from __future__ import annotations

import pytest

from jaxinfer.config import DEFAULT_MODEL
from jaxinfer.engine import grammar
from jaxinfer.engine.request import Request, SamplingParams, Status
from jaxinfer.engine.scheduler import ScheduledChunk
from jaxinfer.engine.structured import StructuredOutputsParams


@pytest.fixture(scope="module")
def constraints():
    return grammar.Constraints(DEFAULT_MODEL, vocab_size=4096, eos_token_ids=[0])


def _request(rid: str, **constraint) -> Request:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)
                            if constraint else None)
    return Request(request_id=rid, prompt_token_ids=[5, 6], params=params, arrival=0,
                   seed=0, status=Status.RUNNING)


def _tokens(constraints, text: str) -> list[int]:
    return constraints.compiler.tokenizer.tokenize_str(text)


def test_grammar_compiles_once_per_spec(constraints):
    compiler = constraints.compiler
    misses = compiler.misses
    first = compiler.grammar(StructuredOutputsParams(json={"type": "integer"}))
    again = compiler.grammar(StructuredOutputsParams(json='{"type":  "integer"}'))
    assert first == again and compiler.misses == misses + 1 and compiler.hits >= 1


@pytest.mark.parametrize("constraint, message", [
    ({"json": {"type": "bogus"}}, "structured_outputs.json: Invalid type: bogus"),
    ({"regex": "(a"}, "structured_outputs.regex: "),
    ({"grammar": "root ::= ("}, "structured_outputs.grammar: "),
    ({"grammar": "start: nothing_here"}, "structured_outputs.grammar: "),
])
def test_grammar_errors_name_the_field(constraints, constraint, message):
    with pytest.raises(ValueError) as error:
        constraints.check(StructuredOutputsParams(**constraint))
    assert str(error.value).startswith(message)


def test_grammar_matcher_consumes_each_token_once_and_stops(constraints):
    request = _request("c", choice=["yes", "no"])
    free = _request("f")
    constraints.add(request)
    constraints.add(free)
    assert len(constraints) == 1  # the free request has no matcher
    chunks = [ScheduledChunk(free, 0, 2, 1), ScheduledChunk(request, 0, 2, 1)]
    assert [i for i, _ in constraints.rows(chunks)] == [1]
    tokens = _tokens(constraints, "yes")
    request.output_token_ids += tokens[:1]
    assert constraints.advance(chunks) == []
    # Preempted and recomputed: the same outputs, nothing new to feed.
    assert constraints.advance([ScheduledChunk(request, 0, 3, 1)]) == []
    request.output_token_ids += tokens[1:]
    assert constraints.advance(chunks) == [request]  # "yes" is complete: stop
    assert len(constraints) == 0


def test_grammar_finished_request_loses_its_matcher(constraints):
    request = _request("d", regex="[a-z]+")
    constraints.add(request)
    request.status = Status.FINISHED
    assert constraints.advance([ScheduledChunk(request, 0, 2, 1)]) == []
    assert len(constraints) == 0
