"""`--reasoning_parser=qwen3`: `<think>...</think>` apart from the answer, whole and in
every two-piece chunking, whether the output opens the block or the prompt did (Qwen3's
thinking templates end the generation prompt with `<think>`)."""

import itertools

import pytest

from jaxinfer.text import reasoning
from jaxinfer.text.reasoning import Split

THOUGHT, ANSWER = "The user greets me. Reply briefly.", "\n\nHello! How can I help?"
OPEN_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
CLOSED_PROMPT = OPEN_PROMPT + "\n</think>\n\n"  # enable_thinking=False's empty block
CASES = [
    ("", f"<think>\n{THOUGHT}\n</think>{ANSWER}", Split(f"\n{THOUGHT}\n", ANSWER)),
    (OPEN_PROMPT, f"{THOUGHT}\n</think>{ANSWER}", Split(f"{THOUGHT}\n", ANSWER)),
    (CLOSED_PROMPT, ANSWER, Split("", ANSWER)),
    ("", ANSWER, Split("", ANSWER)),  # no block at all: all content
    (OPEN_PROMPT, THOUGHT, Split(THOUGHT, "")),  # cut by max_tokens inside the block
]


@pytest.mark.parametrize(("prompt", "text", "expected"), CASES)
def test_whole_and_every_two_piece_chunking(prompt, text, expected):
    assert reasoning.split("qwen3", text, prompt) == expected
    for cut in range(1, len(text)):
        parser = reasoning.parser("qwen3", prompt)
        pieces = [parser.add(text[:cut]), parser.add(text[cut:]), parser.finish()]
        joined = Split()
        for piece in pieces:
            joined += piece
            assert "<th" not in piece.content + piece.reasoning.replace("<think>", "")
        assert joined == expected, cut


def test_a_marker_cut_by_the_chunk_waits_for_its_end():
    parser = reasoning.parser("qwen3", OPEN_PROMPT)
    assert parser.add("Hmm.</thi") == Split(reasoning="Hmm.")
    assert parser.add("nk>Hi") == Split(content="Hi")
    assert list(itertools.chain(reasoning.PARSERS)) == ["openai_gptoss", "qwen3"]
