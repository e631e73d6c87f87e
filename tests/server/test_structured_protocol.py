"""Structured outputs and tool calling in request bodies, without a server:
`response_format` / `structured_outputs` to the request's constraint, `tools` /
`tool_choice` to the constraint vLLM builds, and every malformed one a 400 whose `param`
names the field."""

from __future__ import annotations

import jsonschema
import pytest

from jaxinfer.config import ServerConfig
from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.structured import StructuredOutputsParams
from jaxinfer.server import protocol, tools
from jaxinfer.server.protocol import APIError, ChatRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
AUTO = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def _params(model, **body) -> SamplingParams:
    return protocol.sampling_params(protocol.validate(model, body), SamplingParams())


def _refused(model, **body) -> APIError:
    with pytest.raises(APIError) as error:
        body = protocol.validate(model, body)
        params = protocol.sampling_params(body, SamplingParams())
        if model is ChatRequest:
            tools.plan(body, AUTO, params)
    assert error.value.status == 400
    return error.value


@pytest.mark.parametrize("model,extra", [(CompletionRequest, {"prompt": "x"}),
                                         (ChatRequest, {"messages": MESSAGES})])
def test_both_endpoints_take_both_forms(model, extra):
    by_openai = _params(model, **extra, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}})
    by_vllm = _params(model, **extra, structured_outputs={"json": SCHEMA})
    assert by_openai.structured_outputs == by_vllm.structured_outputs
    assert by_openai.structured_outputs.spec() == ("json", by_vllm.structured_outputs.spec()[1])
    assert _params(model, **extra, response_format={"type": "text"}).structured_outputs is None
    assert _params(model, **extra, response_format={"type": "json_object"}
                   ).structured_outputs == StructuredOutputsParams(json_object=True)
    for kind, value in [("regex", r"\d+"), ("choice", ["yes", "no"]), ("grammar", "a")]:
        constraint = _params(model, **extra, structured_outputs={kind: value}).structured_outputs
        assert constraint.kind == kind


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "text", "extra": 1}}, "response_format.extra"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": 5}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"lark": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
])
def test_malformed_constraints_name_their_field(body, param):
    assert _refused(CompletionRequest, prompt="x", **body).param == param


def test_tool_choice_required_is_vllms_schema():
    body = protocol.validate(ChatRequest, {"messages": MESSAGES, "tools": [WEATHER, TIME],
                                           "tool_choice": "required",
                                           "parallel_tool_calls": False})
    params, plan = tools.plan(body, ServerConfig(), SamplingParams())
    assert plan.required and plan.tools[0] == WEATHER
    schema = params.structured_outputs.json
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}],
                [{"name": "get_time", "parameters": {}}] * 2,
                [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_function_constrains_its_arguments():
    body = protocol.validate(ChatRequest, {"messages": MESSAGES, "tools": [WEATHER, TIME],
                                           "tool_choice": {"type": "function",
                                                           "function": {"name": "get_weather"}}})
    params, plan = tools.plan(body, ServerConfig(), SamplingParams())
    assert plan.named == "get_weather"
    assert params.structured_outputs.json == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER]}, "tool_choice"),  # auto without --enable_auto_tool_choice
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_tool_requests_refused_name_the_field(body, param):
    with pytest.raises(APIError) as error:
        parsed = protocol.validate(ChatRequest, {"messages": MESSAGES, **body})
        tools.plan(parsed, ServerConfig(), protocol.sampling_params(parsed, SamplingParams()))
    assert (error.value.status, error.value.param) == (400, param)


def test_auto_needs_the_flag_and_reads_with_the_parser():
    body = protocol.validate(ChatRequest, {"messages": MESSAGES, "tools": [WEATHER]})
    params, plan = tools.plan(body, AUTO, SamplingParams())
    assert (plan.parser, params.structured_outputs) == ("hermes", None)
    none = protocol.validate(ChatRequest, {"messages": MESSAGES, "tools": [WEATHER],
                                           "tool_choice": "none"})
    assert not tools.plan(none, ServerConfig(), SamplingParams())[1].reads_calls


def test_tool_messages_reach_the_template_as_transformers_passes_them():
    body = protocol.validate(ChatRequest, {"messages": [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assistant, tool = (m.plain() for m in body.messages[1:])
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
