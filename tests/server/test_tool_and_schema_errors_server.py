"""Tools' schemas, schema edge cases, seeds and malformed chat messages through the
official `openai` client against the shared demo-model server: under `tool_choice:
"required"` each function keeps its own `$defs` (two functions that both define `T`
are constrained each by its own, 100 calls sampled at temperature 1.0 and validated with
`jsonschema`); a schema the engine cannot compile names the tools field it came in;
the schema `true` is any value and `false` a 400; seeds take 64 bits; a tool message
names its call; arguments or bodies nested too deeply are 400s, no traceback logged."""

from __future__ import annotations

import concurrent.futures
import json
import time

import jsonschema
import openai
import pytest

from jaxinfer.engine.request import fold_seed
from jaxinfer.server import tools

MESSAGES = [{"role": "user", "content": "def main():"}]
MAX_NESTING = 128  # levels a body or a call's arguments may nest (server/messages.py)
# Two functions that each define `T`: an integer for one, a colour for the other (the
# colour's `T` reached through a second definition, a nested reference).
COUNT = {"type": "function", "function": {"name": "set_count", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["value"],
    "properties": {"value": {"$ref": "#/$defs/T"}},
    "$defs": {"T": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
COLOR = {"type": "function", "function": {"name": "set_color", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["value"],
    "properties": {"value": {"$ref": "#/$defs/U"}},
    "$defs": {"T": {"type": "string", "enum": ["red", "green", "blue"]},
              "U": {"$ref": "#/$defs/T"}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (COUNT, COLOR)}
BAD_TYPE = {"type": "function", "function": {"name": "broken", "parameters": {
    "type": "object", "properties": {"x": {"type": "strin"}}}}}
DANGLING = {"type": "function", "function": {"name": "dangling", "parameters": {
    "type": "object", "properties": {"x": {"$ref": "#/$defs/nope"}}}}}


def _error(call, *args, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as error:
        call(*args, **kwargs)
    return error.value


def _calls(choice) -> list[tuple[str, dict]]:
    assert choice.finish_reason == "tool_calls", choice
    return [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls]


# ---- tool_choice "required": each function's own definitions ----------------------------

def test_required_schema_keeps_each_functions_definitions():
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "definitions": {"Leaf": {"type": "boolean"}},
        "properties": {"leaf": {"$ref": "#/definitions/Leaf"},
                       "kids": {"type": "array", "items": {"$ref": "#"}},
                       "tag": {"enum": [{"$ref": "#"}]}}}}}
    schema = tools.required_schema([COUNT, COLOR, tree], parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "set_count", "parameters": {"value": 7}},
            {"name": "set_color", "parameters": {"value": "red"}},
            {"name": "tree", "parameters": {"leaf": True, "kids": [{"kids": [{"leaf": False}]}],
                                            "tag": {"$ref": "#"}}}]
    jsonschema.validate(good, schema)
    for bad in ({"name": "set_count", "parameters": {"value": "red"}},
                {"name": "set_color", "parameters": {"value": 7}},
                {"name": "tree", "parameters": {"kids": [{"leaf": 1}]}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)
    assert "$defs" not in schema and COUNT["function"]["parameters"]["properties"] == {
        "value": {"$ref": "#/$defs/T"}}  # the tools as sent are left as they were


def _required(client, server, seed: int) -> list:
    response = client.chat.completions.create(
        model=server.model, messages=MESSAGES, tools=[COUNT, COLOR], tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=seed, n=25, max_tokens=60)
    return response.choices


def test_required_calls_validate_against_their_own_functions_100(client, server):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        choices = [c for cs in pool.map(lambda s: _required(client, server, s),
                                        (0, 1000, 2000, 3000)) for c in cs]
    assert len(choices) == 100
    names = []
    for choice in choices:
        ((name, arguments),) = _calls(choice)
        jsonschema.validate(arguments, SCHEMAS[name])
        names.append(name)
    assert set(names) == {"set_count", "set_color"}, names  # both functions were called


def test_a_named_function_with_definitions_is_constrained_by_them(client, server):
    response = client.chat.completions.create(
        model=server.model, messages=MESSAGES, tools=[COUNT, COLOR], temperature=1.0, seed=3,
        tool_choice={"type": "function", "function": {"name": "set_color"}}, n=8,
        max_tokens=60)
    for choice in response.choices:
        ((name, arguments),) = _calls(choice)
        assert name == "set_color"
        jsonschema.validate(arguments, SCHEMAS[name])


# ---- a schema the engine cannot compile names the field it came in -----------------------

@pytest.mark.parametrize("functions,tool_choice,param", [
    ([COUNT, BAD_TYPE], {"type": "function", "function": {"name": "broken"}},
     "tools[1].function.parameters"),
    ([BAD_TYPE], "required", "tools[0].function.parameters"),
    ([COUNT, DANGLING], "required", "tools[1].function.parameters"),  # the pointer says
    ([COUNT, BAD_TYPE], "required", "tools"),  # one of them: the error does not say which
])
def test_bad_tool_parameters_name_the_tools_field(client, server, functions, tool_choice,
                                                   param):
    error = _error(client.chat.completions.create, model=server.model, messages=MESSAGES,
                   tools=functions, tool_choice=tool_choice, max_tokens=8)
    message = error.body["message"]
    assert error.param == param and message.startswith(f"{param}: "), message
    assert "structured_outputs" not in message and "anyOf" not in message, message
    if DANGLING in functions:  # the pointer as the client wrote it
        assert "'/$defs/nope'" in message, message


def test_a_bad_response_format_schema_names_response_format(client, server):
    error = _error(client.chat.completions.create, model=server.model, messages=MESSAGES,
                   max_tokens=8, response_format={"type": "json_schema", "json_schema": {
                       "name": "a", "schema": {"type": "strin"}}})
    assert error.param == "response_format.json_schema"
    assert error.body["message"].startswith("response_format.json_schema: "), error.body


# ---- the schemas true and false ----------------------------------------------------------

def test_the_schema_true_is_any_json_value(client, server):
    outputs = []
    for extra in ({"structured_outputs": {"json": True}},
                  {"response_format": {"type": "json_schema",
                                       "json_schema": {"name": "any", "schema": True}}}):
        chat = client.chat.completions.create(
            model=server.model, messages=MESSAGES, temperature=1.0, seed=4, n=4,
            max_tokens=40, extra_body=extra)
        text = client.completions.create(model=server.model, prompt="x = ", temperature=1.0,
                                         seed=4, n=4, max_tokens=40, extra_body=extra)
        outputs += [(c.message.content, c.finish_reason) for c in chat.choices]
        outputs += [(c.text, c.finish_reason) for c in text.choices]
    for output, finish in outputs:
        if finish == "stop":
            json.loads(output)
        else:  # a number or string may run to max_tokens; what came is still JSON's start
            assert finish == "length" and output[:1] in set('-0123456789"[{tfn'), output
    assert any(finish == "stop" for _, finish in outputs)


@pytest.mark.parametrize("extra,param,says", [
    ({"structured_outputs": {"json": False}}, "structured_outputs.json", "no value is valid"),
    ({"structured_outputs": {"json": "false"}}, "structured_outputs.json", "no value is valid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
                                                                 "schema": False}}},
     "response_format.json_schema", "no value is valid"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "got none"),
    ({"structured_outputs": {"json": "[" * 100_000}}, "structured_outputs.json",
     "nested too deeply"),
])
def test_the_schema_false_is_a_400_naming_the_field(client, server, extra, param, says):
    error = _error(client.completions.create, model=server.model, prompt="x", max_tokens=4,
                   extra_body=extra)
    assert error.param == param and says in error.body["message"], error.body
    assert error.body["message"].startswith(param), error.body


# ---- 64-bit seeds --------------------------------------------------------------------------

def _sampled(client, server, seed: int, **kwargs) -> list[str]:
    response = client.completions.create(model=server.model, prompt="def main():",
                                         temperature=1.0, max_tokens=16, seed=seed, **kwargs)
    return [c.text for c in response.choices]


def test_seeds_take_64_bits(client, server):
    for seed in (2**63 + 5, 2**64 - 1, -2**63, -1):
        first = _sampled(client, server, seed, n=2)
        assert first == _sampled(client, server, seed, n=2), seed  # reproducible
        assert first[0] != first[1], seed  # each completion its own draw
    chat = [client.chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=1.0, max_tokens=16,
        seed=2**62 + 1).choices[0].message.content for _ in range(2)]
    assert chat[0] == chat[1]
    for seed in (2**64, -2**63 - 1):
        error = _error(_sampled, client, server, seed)
        assert error.param == "seed" and "[-2**63, 2**64)" in error.body["message"]


def test_fold_seed_keeps_31_bit_seeds_and_hashes_the_rest():
    assert [fold_seed(5, i) for i in range(3)] == [5, 6, 7]  # the draws they always had
    assert fold_seed(2**31 - 1, 1) == 0
    folded = {fold_seed(seed, i) for seed in (5 + 2**31, 5 + 2**32, 2**64 - 1, -1, -2**63)
              for i in range(4)}
    assert len(folded) == 20 and all(0 <= s < 2**31 for s in folded)
    assert 5 not in folded


def test_seeds_apart_by_2_to_the_31_draw_apart(client, server):
    assert _sampled(client, server, 5) != _sampled(client, server, 5 + 2**31)
    assert _sampled(client, server, 5 + 2**31) != _sampled(client, server, 5 + 2**32)


# ---- malformed chat messages -----------------------------------------------------------

def test_a_tool_message_names_the_call_it_answers(client, server):
    call = {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "set_count", "arguments": '{"value": 3}'}}]}
    answered = [*MESSAGES, call, {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    response = client.chat.completions.create(model=server.model, messages=answered,
                                              max_tokens=4)
    assert response.choices[0].finish_reason == "length"
    anonymous = [*MESSAGES, call, {"role": "tool", "content": "ok"}]
    error = _error(client.chat.completions.create, model=server.model, messages=anonymous,
                   max_tokens=4)
    assert error.param == "messages.2" and "tool_call_id" in error.body["message"], error.body


def _new_log(server, before: int) -> str:
    server.get("/health")  # the server has answered: what it logged is on its way
    time.sleep(0.5)
    return "".join(server.log[before:])


def _deep(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def test_deeply_nested_arguments_are_a_400_without_a_traceback(client, server):
    before = len(server.log)
    param = "messages.1.tool_calls.0.function.arguments"
    for arguments in ("[" * 100_000, json.dumps(_deep(MAX_NESTING + 1))):
        messages = [*MESSAGES, {"role": "assistant", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": arguments}}]}]
        error = _error(client.chat.completions.create, model=server.model,
                       messages=messages, max_tokens=4)
        assert error.param == param and "nested more than" in error.body["message"]
    fine = [*MESSAGES, {"role": "assistant", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "f", "arguments": json.dumps(_deep(MAX_NESTING - 1))}}]}]
    assert client.chat.completions.create(model=server.model, messages=fine,
                                          max_tokens=4).choices
    assert "Traceback" not in _new_log(server, before)


def test_deeply_nested_bodies_are_400s_without_a_traceback(client, server):
    before = len(server.log)
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": _deep(400)}}
    for choice in ("none", "required"):
        error = _error(client.chat.completions.create, model=server.model, messages=MESSAGES,
                       tools=[deep_tool], tool_choice=choice, max_tokens=4)
        assert error.param == "tools" and "levels deep" in error.body["message"], error.body
    raw = '{"prompt": "x", "max_tokens": 2, "logit_bias": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = server.post("/v1/completions", content=raw,
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "levels deep" in response.text, response.text
    assert "Traceback" not in _new_log(server, before)
