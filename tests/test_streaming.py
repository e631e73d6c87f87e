"""Streaming with the demo model: deltas add up to the final text; stop strings are
cut and never leak, even when a stop string spans several tokens."""

from __future__ import annotations

import pathlib

import pytest

from jaxinfer import LLM, SamplingParams

DEMO = pathlib.Path(__file__).resolve().parent.parent / "checkpoints" / "demo"
PROMPT = "class Stack:\n    def push(self, item):"


@pytest.fixture(scope="module")
def llm():
    return LLM(DEMO, max_num_seqs=4, max_num_batched_tokens=32)


def _stream(llm, prompts, params):
    texts = {}
    for out in llm.generate_stream(prompts, params):
        for completion in out.outputs:
            key = (out.request_id, completion.index)
            texts[key] = texts.get(key, "") + completion.delta_text
    return texts


def test_stream_deltas_add_up_to_generate_text(llm):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    (final,) = llm.generate(PROMPT, params)
    (streamed,) = _stream(llm, [PROMPT], params).values()
    assert streamed == final.text and len(final.text) > 20


def test_stop_string_cut_and_held_back_while_streaming(llm):
    (full,) = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0))
    text = full.text
    stop = text[12:20]  # spans several tokens of the greedy continuation
    assert len(stop) == 8 and text.find(stop) == 12
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop, "@@never@@"])
    (out,) = llm.generate(PROMPT, params)
    assert out.text == text[:12]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    deltas = []
    for step in llm.generate_stream(PROMPT, params):
        deltas.append(step.outputs[0].delta_text)
    assert "".join(deltas) == text[:12]
    assert not any(stop[:3] in d for d in deltas)


def test_stream_several_prompts_and_n(llm):
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2)
    texts = _stream(llm, ["import sys\n", "def main():"], params)
    assert len(texts) == 4
    finals = llm.generate(["import sys\n", "def main():"], params)
    assert sorted(texts.values()) == sorted(o.text for f in finals for o in f.outputs)
