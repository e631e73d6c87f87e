"""Structured outputs and forced tool calls through the official `openai` client against
the shared demo-model server, sampling at temperature 1.0: every output obeys its
constraint (JSON validated with `jsonschema`, regexes matched whole) and ends by itself
(`finish_reason` "stop", or "tool_calls"); malformed constraints are 400s naming the field,
after which the server answers exactly as before."""

from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import openai
import pydantic
import pytest

PROMPT = "import json\n\n\ndef load(path):"
MESSAGES = [{"role": "user", "content": "def main():"}]
# nested, every string, number and list bounded: a whole value always fits max_tokens
PERSON = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "tags", "address"],
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "maxItems": 3,
                 "items": {"type": "string", "enum": ["red", "green", "blue"]}},
        "address": {"type": "object", "additionalProperties": False,
                    "required": ["city", "zip"],
                    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The forecast of a city.",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def _person(client, server, seed: int) -> tuple[str, str]:
    response = client.chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=200,
        response_format=RESPONSE_FORMAT)
    return response.choices[0].message.content, response.choices[0].finish_reason


def _check_people(client, server, count: int) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: _person(client, server, s), range(count)))
    for text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for text, _ in results}) > count // 2  # sampled, not one answer


def test_json_schema_outputs_validate_and_stop(client, server):
    _check_people(client, server, 24)


@pytest.mark.slow
def test_json_schema_outputs_validate_and_stop_100(client, server):
    _check_people(client, server, 100)


def test_completions_take_response_format_and_json_object(client, server):
    response = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=200, temperature=1.0, seed=1, n=4,
        extra_body={"response_format": RESPONSE_FORMAT})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)
    anything = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=300, temperature=1.0, seed=2,
        response_format={"type": "json_object"})
    choice = anything.choices[0]
    if choice.finish_reason == "stop":  # any object: it may run past max_tokens
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.lstrip().startswith("{")


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(pattern="^(Paris|Rome|Oslo)$")
    zip: str = pydantic.Field(pattern="^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[A-Za-z]{1,8}$")
    age: int = pydantic.Field(ge=0, le=120)
    address: Address


def test_parse_returns_the_pydantic_model(client, server):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=server.model, messages=MESSAGES, temperature=1.0, seed=seed,
            max_tokens=200, response_format=Person)
        message = completion.choices[0].message
        assert isinstance(message.parsed, Person) and completion.choices[0].finish_reason == "stop"
        assert message.parsed == Person.model_validate_json(message.content)


@pytest.mark.parametrize("constraint,pattern", [
    ({"regex": r"[a-z]{2,6}@example\.(com|org)"}, r"[a-z]{2,6}@example\.(com|org)"),
    ({"choice": ["yes", "no", "maybe later"]}, r"yes|no|maybe later"),
    ({"grammar": 'root ::= num "+" num\nnum ::= [1-9] [0-9]?'}, r"[1-9][0-9]?\+[1-9][0-9]?"),
    ({"grammar": 'start: NUM "*" NUM\nNUM: /[1-9][0-9]?/'}, r"[1-9][0-9]?\*[1-9][0-9]?"),
])
def test_regex_choice_and_grammar(client, server, constraint, pattern):
    extra = {"structured_outputs": constraint}
    chat = client.chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=1.0, seed=0, n=4, max_tokens=40,
        extra_body=extra)
    text = client.completions.create(model=server.model, prompt=PROMPT, temperature=1.0,
                                     seed=0, n=4, max_tokens=40, extra_body=extra)
    outputs = [(c.message.content, c.finish_reason) for c in chat.choices] + [
        (c.text, c.finish_reason) for c in text.choices]
    for output, finish in outputs:
        assert re.fullmatch(pattern, output) and finish == "stop", output


MALFORMED = [  # (extra body, the param the 400 names); each half checked by us, half by
    # the engine compiling the constraint
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "nonsense"}}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "array", "items": {"$ref": "#/$defs/none"}}}}},
     "response_format.json_schema"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "(x"}}},
     "structured_outputs.json"),
    ({"structured_outputs": {"grammar": 'root ::= ("a"'}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}},
     "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": "this is not a grammar"}},
     "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"lark": "start: 'a'"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
]


def test_malformed_constraints_are_400s_naming_the_field(client, server):
    greedy = dict(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0)
    before = client.completions.create(**greedy).choices[0].text
    assert len(MALFORMED) == 20
    for extra, param in MALFORMED:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8,
                                      extra_body=extra)
        assert error.value.param == param, (extra, error.value.message)
    assert client.completions.create(**greedy).choices[0].text == before
    assert server.process.poll() is None


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_validate_whole_and_streamed(client, server, tool_choice):
    kwargs = dict(model=server.model, messages=MESSAGES, tools=[WEATHER, CLOCK],
                  tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0,
                  max_tokens=120)
    for seed in range(4):
        choice = client.chat.completions.create(**kwargs, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        ((name, arguments),) = _calls(choice.message)
        jsonschema.validate(arguments, SCHEMAS[name])
        assert choice.message.tool_calls[0].id.startswith("chatcmpl-tool-")
        if tool_choice != "required":
            assert name == "get_time"
        chunks = list(client.chat.completions.create(**kwargs, seed=seed, stream=True))
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        first = deltas[0]
        assert (first.index, first.type, first.function.name, first.function.arguments) == (
            0, "function", name, "")
        assert first.id.startswith("chatcmpl-tool-")
        assert all(d.id is None and d.function.name is None for d in deltas[1:])
        assert json.loads("".join(d.function.arguments for d in deltas[1:])) == arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def _forced_call(client, server, tool_choice, seed: int, stream: bool) -> tuple[str, dict]:
    kwargs = dict(model=server.model, messages=MESSAGES, tools=[WEATHER, CLOCK],
                  tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0,
                  max_tokens=120, seed=seed)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = _calls(choice.message)
        return call
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    return deltas[0].function.name, json.loads("".join(d.function.arguments for d in deltas))


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate_100_of_100_whole_and_streamed(client, server, tool_choice):
    for stream in (False, True):
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            calls = list(pool.map(
                lambda seed, s=stream: _forced_call(client, server, tool_choice, seed, s),
                range(100)))
        for name, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[name])
            assert tool_choice == "required" or name == "get_weather"


@pytest.mark.slow
@pytest.mark.parametrize("constraint,pattern", [
    ({"regex": r"[a-z]{2,6}@example\.(com|org)"}, r"[a-z]{2,6}@example\.(com|org)"),
    ({"choice": ["yes", "no", "maybe later"]}, r"yes|no|maybe later"),
    ({"grammar": 'root ::= num "+" num\nnum ::= [1-9] [0-9]?'}, r"[1-9][0-9]?\+[1-9][0-9]?"),
])
def test_regex_choice_and_grammar_100_of_100(client, server, constraint, pattern):
    outputs = []
    for seed in (0, 50):  # completion i samples with seed + i: 100 distinct seeds
        response = client.completions.create(
            model=server.model, prompt=PROMPT, temperature=1.0, seed=seed, n=50,
            max_tokens=40, extra_body={"structured_outputs": constraint})
        outputs += [(c.text, c.finish_reason) for c in response.choices]
    assert len(outputs) == 100
    for output, finish in outputs:
        assert re.fullmatch(pattern, output) and finish == "stop", output
