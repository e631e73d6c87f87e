"""The host side of structured outputs (engine/structured/grammar.py), on the demo model's
tokenizer: grammars cached by spec, errors naming the field, and each completion's
matcher fed every token once (preemption recomputes tokens, never re-feeds them)."""

from __future__ import annotations

import pytest

from jaxinfer.config import DEFAULT_MODEL
from jaxinfer.engine.core.scheduler import ScheduledChunk
from jaxinfer.engine.request import Request, SamplingParams, Status
from jaxinfer.engine.structured import StructuredOutputsParams, grammar


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
    first = compiler.prototype(StructuredOutputsParams(json={"type": "integer"}))
    again = compiler.prototype(StructuredOutputsParams(json='{"type":  "integer"}'))
    assert first is again and compiler.misses == misses + 1 and compiler.hits >= 1


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
    assert constraints.advance(chunks) == [(request, "stop", None)]  # "yes" is complete
    assert len(constraints) == 0


def test_grammar_finished_request_loses_its_matcher(constraints):
    request = _request("d", regex="[a-z]+")
    constraints.add(request)
    request.status = Status.FINISHED
    assert constraints.advance([ScheduledChunk(request, 0, 2, 1)]) == []
    assert len(constraints) == 0


def _chain_lark(rules: int) -> str:
    """Rules nested `rules` deep: llguidance's compiler recursed past an 8 MiB stack
    (a segfault) from about 3,000 of them."""
    body = "".join(f'r{i}: "a" r{i + 1} | "b"\n' for i in range(rules))
    return f'start: r0\n{body}r{rules}: "z"\n'


def _chain_gbnf(rules: int) -> str:
    body = "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(rules))
    return f'root ::= r0\n{body}r{rules} ::= "z"\n'


def test_grammar_too_deep_for_the_compiler_is_refused_not_fatal(constraints):
    """The child process that compiles it crashes; this process does not, and the next
    constraint compiles in a fresh child."""
    crashes = constraints.compiler.processes.crashes
    with pytest.raises(ValueError, match=r"^structured_outputs\.grammar: the grammar "
                       r"compiler crashed on it \(SIGSEGV\)"):
        constraints.check(StructuredOutputsParams(grammar=_chain_lark(3000)))
    assert constraints.compiler.processes.crashes == crashes + 1
    assert constraints.check(StructuredOutputsParams(grammar=_chain_lark(500))) is not None


def test_grammar_compile_time_is_bounded(constraints):
    """Converting 10,000 GBNF rules to Lark runs for minutes in pure Python: the child
    is stopped at the time limit."""
    timeouts = constraints.compiler.processes.timeouts
    with pytest.raises(ValueError, match="took longer than 10 s"):
        constraints.check(StructuredOutputsParams(grammar=_chain_gbnf(10_000)))
    assert constraints.compiler.processes.timeouts == timeouts + 1


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
])
def test_schema_without_a_finite_instance_is_refused(constraints, schema):
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: no output satisfies"):
        constraints.check(StructuredOutputsParams(json=schema))


def test_choice_list_past_the_parser_row_limit_matches_whole(constraints):
    """10,000 choices: one lexer terminal, not a parser row of 10,000 items (which
    llguidance refuses after the first token)."""
    choices = [f"ch{i}" for i in range(10_000)]
    request = _request("big", choice=choices)
    constraints.add(request)
    chunk = ScheduledChunk(request, 0, 2, 1)
    for token in _tokens(constraints, "ch9876"):
        request.output_token_ids.append(token)
        ended = constraints.advance([chunk])
    assert ended == [(request, "stop", None)]


def test_matcher_error_finishes_with_error_not_stop(constraints):
    """A rule of 2,500 alternatives passes the first mask and fails after one token
    (llguidance's row limit): the request ends in "error" with one bounded line."""
    alternatives = " | ".join(f'"a{i}"' for i in range(2500))
    request = _request("row", grammar=f'start: "x" r\nr: {alternatives}\n')
    constraints.add(request)
    chunk = ScheduledChunk(request, 0, 2, 1)
    request.output_token_ids += _tokens(constraints, "x")
    ended = constraints.advance([chunk]) or constraints.failed([chunk])
    assert len(ended) == 1 and ended[0][0] is request and "error" in ended[0]
    why = ended[0][-1]
    assert why.startswith("the output constraint failed after 1 tokens: ")
    assert "\n" not in why and len(why) < 400
