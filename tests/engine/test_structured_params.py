"""StructuredOutputsParams and response_format (engine/structured/params.py): one constraint per
request, errors naming the field, and a spec that keeps what changes the output."""

from __future__ import annotations

import pytest

from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.structured import StructuredOutputsParams, from_response_format


def test_a_json_schema_keeps_its_property_order():
    """The output writes properties in the schema's order (as OpenAI's and vLLM's), so
    two orders are two constraints."""
    first = StructuredOutputsParams(json={"properties": {"name": {}, "age": {}}})
    swapped = StructuredOutputsParams(json='{"properties": {"age": {}, "name": {}}}')
    assert first.spec() == ("json", '{"properties":{"name":{},"age":{}}}')
    assert first.spec() != swapped.spec()
    assert StructuredOutputsParams(json=dict(first.json)).spec() == first.spec()


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a+", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "structured_outputs.json is not JSON"),
    ({"json": [1, 2]}, "must be a JSON schema"),
    ({"choice": "ab"}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"grammar": ""}, "structured_outputs.grammar must be a non-empty string"),
])
def test_bad_constraints_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_a_dict_and_refuse_unknown_fields():
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert params.structured_outputs.spec() == ("choice", '["yes", "no"]')
    with pytest.raises(ValueError, match="unknown field.*jsn"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_response_format_maps_onto_a_constraint():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).kind == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    made = from_response_format({"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert made.json == schema
    with pytest.raises(ValueError, match="response_format.json_schema must be an object"):
        from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ValueError, match="response_format.type='yaml'"):
        from_response_format({"type": "yaml"})
