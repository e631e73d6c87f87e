"""Reasoning parsers: gpt-oss's harmony output split into reasoning and content, whole and
streamed in every chunking (boundaries inside markers included), and the ids-to-text step
that keeps a tokenizer's special markers."""

import itertools
import random

import pytest

from jaxinfer.config import REASONING_PARSERS
from jaxinfer.text import reasoning
from jaxinfer.text.reasoning import Split
from jaxinfer.text.tokenizer import Tokenizer

# What gpt-oss writes after the template's `<|start|>assistant` (harmony's example shape)
HARMONY = ("<|channel|>analysis<|message|>User asks 2+2. Simple: 4.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")


def _streamed(text: str, cuts: list[int], name: str = "openai_gptoss") -> list[Split]:
    parser = reasoning.parser(name)
    bounds = [0, *cuts, len(text)]
    return [parser.add(text[a:b]) for a, b in itertools.pairwise(bounds)] + [parser.finish()]


def _joined(splits: list[Split]) -> Split:
    out = Split()
    for s in splits:
        out += s
    return out


def test_harmony_whole_text():
    assert reasoning.split("openai_gptoss", HARMONY) == Split(
        reasoning="User asks 2+2. Simple: 4.", content="2 + 2 = 4.")


def test_harmony_every_chunking_into_three_adds_up_and_leaks_no_marker():
    """Every pair of cut points (inside markers too): the deltas add up to the whole
    text's split, and no delta holds a piece of a marker (the bodies have no '<' or '|')."""
    whole = reasoning.split("openai_gptoss", HARMONY)
    for cuts in itertools.combinations(range(1, len(HARMONY)), 2):
        splits = _streamed(HARMONY, list(cuts))
        assert _joined(splits) == whole, cuts
        assert not any(c in s.reasoning + s.content for s in splits for c in "<|>"), cuts


def test_harmony_character_by_character_and_random_chunkings():
    whole = reasoning.split("openai_gptoss", HARMONY)
    splits = _streamed(HARMONY, list(range(1, len(HARMONY))))
    assert _joined(splits) == whole
    # the reasoning streams before the final channel opens
    first_content = next(i for i, s in enumerate(splits) if s.content)
    assert "".join(s.reasoning for s in splits[:first_content]) == whole.reasoning
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(HARMONY)), rng.randint(1, 12)))
        assert _joined(_streamed(HARMONY, cuts)) == whole


@pytest.mark.parametrize("text, expected", [
    # cut off while thinking (max_tokens): no content yet
    ("<|channel|>analysis<|message|>Still thinking", Split(reasoning="Still thinking")),
    # cut off inside the next header, mid-marker: the header is dropped
    ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|chan",
     Split(reasoning="Done.")),
    # two analysis messages, then a tool call on the commentary channel (reasoning: the
    # server does not parse tool calls) with its content type after <|constrain|>
    ("<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>analysis"
     "<|message|>B<|end|><|start|>assistant to=functions.f<|channel|>commentary "
     "<|constrain|>json<|message|>{\"x\": 1}<|call|>",
     Split(reasoning='A\nB\n{"x": 1}')),
    # a channel named with its recipient after it
    ("<|channel|>final to=user<|message|>Hi", Split(content="Hi")),
    # "<|" that starts no marker is text, even at the very end
    ("<|channel|>final<|message|>a <|b|> c <|", Split(content="a <|b|> c <|")),
    # a model that does not speak harmony: all content
    ("plain answer, x < y", Split(content="plain answer, x < y")),
    ("", Split()),
])
def test_harmony_edge_cases_whole_and_streamed(text, expected):
    assert reasoning.split("openai_gptoss", text) == expected
    for cut in range(1, len(text)):
        assert _joined(_streamed(text, [cut])) == expected, cut


def test_harmony_plain_text_streams_at_once():
    """Text before any marker is content as it comes, holding back only a '<'."""
    parser = reasoning.parser("openai_gptoss")
    assert parser.add("def f(x):") == Split(content="def f(x):")
    assert parser.add(" return x <") == Split(content=" return x ")
    assert parser.add(" 1") == Split(content="< 1")
    assert parser.finish() == Split()


def test_registry_refuses_unknown_names_listing_the_known():
    assert tuple(reasoning.PARSERS) == REASONING_PARSERS  # the flag's choices
    with pytest.raises(ValueError, match="'qwen9' is not a known reasoning parser; the "
                                         "known ones are openai_gptoss"):
        reasoning.parser("qwen9")


def test_marked_detokenizer_keeps_markers_and_skips_other_special_tokens(gpt_oss):
    """Harmony's markers are special tokens: the engine's text drops them, the parser's
    decoder keeps them; other special tokens (<|endoftext|>) stay out."""
    tokenizer = Tokenizer.from_dir(gpt_oss)
    ids = tokenizer.encode(HARMONY + "<|endoftext|>", add_special_tokens=False)
    assert tokenizer.decode(ids) == "analysisUser asks 2+2. Simple: 4.assistantfinal2 + 2 = 4."
    prompt = tokenizer.encode("<|start|>assistant", add_special_tokens=False)
    for size in (1, 2, 5, len(ids)):
        decoder = reasoning.MarkedDetokenizer(tokenizer, prompt, reasoning.HARMONY_MARKERS)
        text = "".join(decoder.add(ids[i:i + size]) for i in range(0, len(ids), size))
        assert text + decoder.flush() == HARMONY, size
