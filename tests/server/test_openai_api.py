"""The server through the official `openai` client: completions and chat, whole and
streamed, n > 1, stop strings, seeds, logprobs, usage, models, metrics; outputs equal
`LLM.generate` / `LLM.chat` with the same parameters."""

from __future__ import annotations

import pytest
from serving import greedy, metric_values

PROMPT = "import os\n\n\ndef read_lines(path):"
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "def main():"}]


def test_completion_greedy_equals_llm_generate(client, server, demo_llm):
    response = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24,
                                         temperature=0)
    expected = demo_llm.generate(PROMPT, greedy(demo_llm, 24))[0]
    (choice,) = response.choices
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 24
    assert response.object == "text_completion" and response.model == server.model


@pytest.mark.parametrize("temperature", [1e-6, 1e-10, 1e-20, 1e-37, 1e-45])
def test_completion_at_a_tiny_temperature_is_greedy(client, server, demo_llm, temperature):
    """Below 1e-5 a request is greedy (the sampler once drew <|endoftext|> from 1e-10 to
    1e-37 and stopped after a few tokens)."""
    response = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24,
                                         temperature=temperature, seed=3)
    expected = demo_llm.generate(PROMPT, greedy(demo_llm, 24))[0]
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason) == (expected.text, "length")


def test_completion_stream_equals_whole(client, server):
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=30, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_equals_llm_chat(client, server, demo_llm):
    response = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                              max_tokens=20, temperature=0)
    expected = demo_llm.chat(MESSAGES, greedy(demo_llm, 20))[0]
    message = response.choices[0].message
    assert (message.role, message.content) == ("assistant", expected.text)
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    stream = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                            max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].object == "chat.completion.chunk"


def test_llm_chat_uses_the_chat_template(demo_llm):
    text = demo_llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = demo_llm.tokenizer.encode(text, add_special_tokens=False)
    params = greedy(demo_llm, 12)
    assert demo_llm.chat(MESSAGES, params)[0].token_ids == \
        demo_llm.generate(ids, params)[0].token_ids
    with pytest.raises(ValueError, match="conversation 1: .*empty list of messages"):
        demo_llm.chat([MESSAGES, []], params)


def test_max_completion_tokens_and_context_fill(client, server, demo_llm):
    response = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                              max_completion_tokens=7, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 7
    unbounded = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert unbounded.usage.total_tokens == demo_llm.max_model_len  # fills the context
    assert unbounded.choices[0].finish_reason == "length"


def test_n_with_seed_is_reproducible(client, server):
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=16, temperature=1.0,
                  n=3, seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # the n samples differ
    other = client.completions.create(**kwargs | {"seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]
    streamed = client.completions.create(**kwargs, stream=True)
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in first.choices]


def test_batch_and_token_id_prompts(client, server, demo_llm):
    ids = demo_llm.tokenizer.encode("class Foo:")
    response = client.completions.create(model=server.model, prompt=[PROMPT, "class Foo:"],
                                         max_tokens=10, temperature=0, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=10,
                                       temperature=0)
    assert by_ids.choices[0].text == response.choices[2].text == response.choices[3].text
    expected = demo_llm.generate([PROMPT, ids], greedy(demo_llm, 10))
    assert [response.choices[0].text, by_ids.choices[0].text] == [o.text for o in expected]


def test_stop_string_ends_the_text(client, server, demo_llm):
    full = demo_llm.generate(PROMPT, greedy(demo_llm, 40))[0].text
    stop = full[10:14]
    before = full[:full.index(stop)]
    for stream in (False, True):
        response = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=40,
                                             temperature=0, stop=[stop, "@@@"], stream=stream)
        chunks = list(response) if stream else [response]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == before
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completion_logprobs(client, server, demo_llm):
    response = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12,
                                         temperature=0, logprobs=3)
    expected = demo_llm.generate(PROMPT, greedy(demo_llm, 12, logprobs=3))[0]
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset[0] == 0 and len(logprobs.tokens) == 12
    for token_id, chosen, top, entry in zip(expected.token_ids, logprobs.token_logprobs,
                                            logprobs.top_logprobs, expected.logprobs,
                                            strict=True):
        assert chosen == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert 3 <= len(top) <= 4  # the top 3, plus the chosen token when not among them


def test_chat_logprobs(client, server):
    response = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                              max_tokens=8, temperature=0, logprobs=True,
                                              top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert "".join(t.token for t in content) == response.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.bytes == list(token.token.encode())
        assert token.logprob <= token.top_logprobs[0].logprob + 1e-6


def test_prefix_cache_shows_in_usage(client, server):
    long_prompt = PROMPT + " " + "x = 1\n" * 60
    first = client.completions.create(model=server.model, prompt=long_prompt, max_tokens=2)
    second = client.completions.create(model=server.model, prompt=long_prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 64


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert server.get("/health").json() == {"status": "ok"}


def test_unknown_model_is_404(client, server):
    import openai

    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert caught.value.body["param"] == "model"


def test_metrics_count_the_work_done(client, server):
    before = metric_values(server)
    prompts = [PROMPT, "def f(x):", "class A:"]
    responses = [client.completions.create(model=server.model, prompt=p, max_tokens=5 + i,
                                           temperature=0, n=2, extra_body={"ignore_eos": True})
                 for i, p in enumerate(prompts)]
    after = metric_values(server)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    # vLLM counts a prompt once per completion (n x prompt length)
    assert delta["jaxinfer:prompt_tokens_total"] == sum(2 * r.usage.prompt_tokens
                                                       for r in responses)
    assert delta["jaxinfer:generation_tokens_total"] == sum(r.usage.completion_tokens
                                                           for r in responses) == 2 * 18
    assert delta["jaxinfer:request_success_total{finished_reason=length}"] == 6
    assert delta["jaxinfer:time_to_first_token_seconds_count"] == 6
    assert delta["jaxinfer:e2e_request_latency_seconds_count"] == 6
    assert delta["jaxinfer:inter_token_latency_seconds_count"] == 2 * 18 - 6
    assert after["jaxinfer:compilations_after_warmup_total"] == 0
    assert after["jaxinfer:num_requests_running"] == after["jaxinfer:kv_cache_pages_in_use"] == 0
