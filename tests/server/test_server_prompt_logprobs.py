"""Prompt logprobs through the shared server (started with --enable_prompt_logprobs):
vLLM's `prompt_logprobs` on completions (whole, batched, streamed) and chat, and the
legacy `echo` with `logprobs` (lm-eval-harness's loglikelihood request, `max_tokens` 0
or 1); every value equals `LLM.generate(..., SamplingParams(prompt_logprobs=k))`. The
server without the flag is tested in test_overload_shutdown.py (its keyed server)."""

from __future__ import annotations

import json

import pytest
from serving import ENGINE_FLAGS, SCORING, greedy

from jaxinfer import LLM
from jaxinfer.config import DEFAULT_MODEL

PROMPTS = ["import os\n\n\ndef read_lines(path):", "class Config:\n    name ="]
MESSAGES = [{"role": "user", "content": "def main():"}]
TOLERANCE = 1e-5
# A batch's prompts may share steps differently in the server (each is admitted on its
# own) than in LLM.generate: other step shapes, other float32 summation orders.
BATCH_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    """The server's model and engine settings, scoring on, in this process; not warmed
    up: it compiles (or loads from the compilation cache) only the buckets used here."""
    return LLM(DEFAULT_MODEL, **ENGINE_FLAGS, **SCORING, warm_up=False)


def _assert_vllm_json(got: list, expected: list, tolerance: float = TOLERANCE) -> None:
    """The server's `prompt_logprobs` (JSON) equal the engine's (RequestOutput)."""
    assert len(got) == len(expected) and got[0] is None and expected[0] is None
    for entry, want in zip(got[1:], expected[1:], strict=True):
        assert list(entry) == [str(t) for t in want]  # the prompt token first, then the top k
        for token, logprob in want.items():
            item = entry[str(token)]
            assert item["logprob"] == pytest.approx(logprob.logprob, abs=tolerance)
            assert (item["rank"], item["decoded_token"]) == (logprob.rank,
                                                             logprob.decoded_token)


def test_completion_prompt_logprobs_equal_llm_generate(client, server, demo_llm):
    response = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=4,
                                         temperature=0, n=2,
                                         extra_body={"prompt_logprobs": 3})
    (expected,) = demo_llm.generate(PROMPTS[0], greedy(demo_llm, 4, n=2, prompt_logprobs=3))
    for choice in response.choices:  # the n completions share the prompt's
        _assert_vllm_json(choice.model_extra["prompt_logprobs"], expected.prompt_logprobs)
        assert choice.text == expected.text
    batch = client.completions.create(model=server.model, prompt=PROMPTS, max_tokens=2,
                                      temperature=0, extra_body={"prompt_logprobs": 2})
    expected = demo_llm.generate(PROMPTS, greedy(demo_llm, 2, prompt_logprobs=2))
    for choice, want in zip(batch.choices, expected, strict=True):
        _assert_vllm_json(choice.model_extra["prompt_logprobs"], want.prompt_logprobs,
                          BATCH_TOLERANCE)
    plain = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=2)
    assert "prompt_logprobs" not in plain.choices[0].model_extra


def test_echo_max_tokens_0_returns_the_prompt_scored(client, server, demo_llm):
    ids = demo_llm.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    (expected,) = demo_llm.generate(ids, greedy(demo_llm, 1, prompt_logprobs=1))
    for prompt in (PROMPTS[0], ids):  # lm-eval sends token ids
        response = client.completions.create(model=server.model, prompt=prompt, echo=True,
                                             logprobs=1, max_tokens=0, temperature=0)
        (choice,) = response.choices
        assert choice.text == PROMPTS[0] and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert "".join(logprobs.tokens) == PROMPTS[0] and len(logprobs.tokens) == len(ids)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for i in range(1, len(ids)):
            want = expected.prompt_logprobs[i]
            assert logprobs.token_logprobs[i] == pytest.approx(want[ids[i]].logprob,
                                                               abs=TOLERANCE)
            best = min(want.values(), key=lambda lp: lp.rank)
            assert set(logprobs.top_logprobs[i]) == {best.decoded_token,
                                                     want[ids[i]].decoded_token}
        offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]
        assert logprobs.text_offset == offsets
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids),
                                                                                   0)


def test_echo_with_one_token_scores_prompt_then_generation(client, server, demo_llm):
    (expected,) = demo_llm.generate(PROMPTS[1], greedy(demo_llm, 1, prompt_logprobs=2,
                                                       logprobs=2))
    num_prompt = len(expected.prompt_token_ids)
    kwargs = dict(model=server.model, prompt=PROMPTS[1], echo=True, logprobs=2, max_tokens=1,
                  temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.text == PROMPTS[1] + expected.text
    scores = whole.logprobs.token_logprobs
    assert len(scores) == num_prompt + 1 and scores[0] is None
    prompt_scores = [e[t].logprob for t, e in zip(expected.prompt_token_ids[1:],
                                                 expected.prompt_logprobs[1:], strict=True)]
    generated = expected.logprobs[0][expected.token_ids[0]].logprob
    assert scores[1:] == pytest.approx([*prompt_scores, generated], abs=TOLERANCE)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(scores[1:], abs=TOLERANCE)


def test_streamed_prompt_logprobs_come_in_the_first_chunk(server, demo_llm):
    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 2, "stream": True}
    events = [line.removeprefix("data: ") for line in server.post(
        "/v1/completions", json=body).text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and len(chunks) >= 2
    (expected,) = demo_llm.generate(PROMPTS[0], greedy(demo_llm, 3, prompt_logprobs=2))
    _assert_vllm_json(chunks[0]["choices"][0]["prompt_logprobs"], expected.prompt_logprobs)
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text


def test_chat_prompt_logprobs_beside_choices_and_refused_when_streamed(client, server,
                                                                      demo_llm):
    response = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                              max_tokens=3, temperature=0,
                                              extra_body={"prompt_logprobs": 1})
    (expected,) = demo_llm.chat(MESSAGES, greedy(demo_llm, 3, prompt_logprobs=1))
    _assert_vllm_json(response.model_extra["prompt_logprobs"], expected.prompt_logprobs)
    assert response.choices[0].message.content == expected.text
    refused = server.post("/v1/chat/completions", json={
        "messages": MESSAGES, "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
