"""Tool-call parsers on the formats their models write (Hermes/Qwen, Llama 3 JSON,
Mistral's two forms, gpt-oss's harmony), whole and streamed: every way of cutting the
text into two or three pieces, cuts inside markers and inside JSON included, gives the
whole text's calls and content, and no piece of a marker ever reaches the content."""

import itertools
import json

import pytest

from jaxinfer.config import TOOL_CALL_PARSERS
from jaxinfer.text import tool_parsers
from jaxinfer.text.tool_parsers import ToolCall, ToolSplit

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
TIME = ToolCall("get_time", json.dumps({"tz": "Europe/Paris"}))

# (parser, what the model writes, content, calls): the models' own formats
CASES = [
    ("hermes", 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": '
     '"get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me look that up.\n", [WEATHER, TIME]),
    ("hermes", "Paris is sunny today.", "Paris is sunny today.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}', "", [WEATHER]),  # the closing tag never came (EOS first)
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"unit": "celsius"}}; {"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
     "", [WEATHER, TIME]),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     '"celsius"}}', "", [WEATHER]),
    ("llama3_json", 'The answer is {"a": 1}.', 'The answer is {"a": 1}.', []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
     "Sure.", [WEATHER, TIME]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
     '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "Europe/Paris"}', "",
     [WEATHER, TIME]),
    ("openai", '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant'
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
     '{"city": "Paris", "unit": "celsius"}<|call|>',
     "<|channel|>analysis<|message|>Need the weather.<|end|>", [WEATHER]),
    ("openai", '<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>'
     'final<|message|>Hi!<|return|>',
     "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hi!<|return|>", []),
]


def _pieces(name: str, text: str, cuts: tuple[int, ...]) -> list[ToolSplit]:
    parser = tool_parsers.parser(name)
    bounds = [0, *cuts, len(text)]
    return [parser.add(text[a:b]) for a, b in itertools.pairwise(bounds)] + [parser.finish()]


def _joined(splits: list[ToolSplit]) -> ToolSplit:
    out = ToolSplit()
    for split in splits:
        out += split
    return out


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_text(name, text, content, calls):
    assert tool_parsers.split(name, text) == ToolSplit(content, calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_every_cut_into_two_or_three_pieces_adds_up(name, text, content, calls):
    markers = tool_parsers.parser(name).markers
    step = max(1, len(text) // 40)  # three pieces: every 40th pair of cuts, to stay quick
    cuts = [(i,) for i in range(1, len(text))] + list(
        itertools.combinations(range(1, len(text), step), 2))
    for cut in cuts:
        splits = _pieces(name, text, cut)
        assert _joined(splits) == ToolSplit(content, calls), cut
        if name != "openai":  # openai passes harmony's markers on, whole, by design
            for split in splits:
                for marker in markers:
                    assert all(marker[:k] not in split.content or marker[:k] in content
                               for k in range(2, len(marker) + 1)), (cut, split)


def test_a_call_is_reported_in_the_piece_that_completes_it():
    parser = tool_parsers.parser("hermes")
    assert parser.add('<tool_call>{"name": "get_time", "arguments": {"tz": ') == ToolSplit()
    assert parser.add('"Europe/Paris"}}</tool_') == ToolSplit()
    assert parser.add("call>") == ToolSplit(calls=[TIME])


def test_constrained_list_streams_each_call_once_whole():
    parser = tool_parsers.ConstrainedCalls()
    text = json.dumps([{"name": "get_weather", "parameters": json.loads(WEATHER.arguments)},
                       {"name": "get_time", "parameters": {"tz": "Europe/Paris"}}])
    seen = [call for char in text for call in parser.add(char).calls]
    assert seen == [WEATHER, TIME]


@pytest.mark.parametrize("name, text", [("hermes", "<tool_call>" + "[" * 5000 + "</tool_call>"),
                                        ("mistral", "[TOOL_CALLS]" + "[" * 5000)])
def test_text_nested_past_the_json_decoders_limit_is_no_call(name, text):
    """Once a RecursionError out of the parser: the request failed mid-stream."""
    assert tool_parsers.split(name, text).calls == []


def test_registry_names_are_the_flag_choices():
    assert tuple(tool_parsers.PARSERS) == TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match="known ones are hermes"):
        tool_parsers.parser("qwen9")
