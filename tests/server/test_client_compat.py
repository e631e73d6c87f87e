"""What real clients send and expect, through the official `openai` client on the shared
server: vLLM's continuous usage in streams, OpenAI's logit_bias, OpenAI's fields accepted
and ignored (named in a header), the access log, `model_name` on every metric, the
models list's `created`, and `content: null` refused where OpenAI refuses it."""

from __future__ import annotations

import time

import openai
import pytest
from serving import greedy, metric_values, start_server

PROMPT = "import os\n\n\ndef read_lines(path):"
MESSAGES = [{"role": "user", "content": "def main():"}]
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_put_usage_in_every_chunk(client, server, chat):
    kwargs = dict(model=server.model, max_tokens=12, temperature=0, stream=True,
                  extra_body={"stream_options": CONTINUOUS})
    if chat:
        chunks = list(client.chat.completions.create(messages=MESSAGES, **kwargs))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **kwargs))
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    prompt = usages[-1].prompt_tokens
    assert all(u.prompt_tokens == prompt and u.total_tokens == prompt + u.completion_tokens
               for u in usages)
    completion = [u.completion_tokens for u in usages]
    assert completion == sorted(completion) and completion[-1] == 12  # so far, then all
    assert chunks[-1].choices == []  # the last chunk: usage alone, as with include_usage
    assert completion[-2] == 12  # the last token's chunk already counts it


def test_include_usage_alone_leaves_other_chunks_null(client, server):
    chunks = list(client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]


def test_logit_bias_forces_and_bans_tokens(client, server, demo_llm):
    tokenizer = demo_llm.tokenizer
    plain = demo_llm.generate(PROMPT, greedy(demo_llm, 8))[0]
    forced = tokenizer.encode(" banana")[0]
    response = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8,
                                         temperature=0, logit_bias={str(forced): 100},
                                         logprobs=1)
    (choice,) = response.choices
    assert choice.text == tokenizer.decode([forced] * 8)
    assert max(choice.logprobs.token_logprobs) < -0.01  # the raw model's, not the biased
    banned = plain.token_ids[0]
    chat = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                          max_tokens=4, temperature=0.7, seed=1,
                                          logit_bias={str(forced): 100, str(banned): -100})
    assert chat.choices[0].message.content == tokenizer.decode([forced] * 4)
    assert client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=8, temperature=0,
        logit_bias={str(banned): -100}).choices[0].text != plain.text


@pytest.mark.parametrize(("bias", "message"), [
    ({str(t): 1 for t in range(301)}, "logit_bias has 301 entries; at most 300"),
    ({"999999": 1}, "logit_bias keys [999999] must be token ids below"),
    ({"-3": 1}, "logit_bias key '-3' must be a token id"),
    ({"5": 101}, "must be a number in [-100, 100]"),
])
def test_logit_bias_out_of_range_is_a_400_naming_it(client, server, bias, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                  logit_bias=bias)
    assert caught.value.body["param"] == "logit_bias"
    assert message in caught.value.body["message"]


def test_platform_fields_are_accepted_ignored_and_named(client, server, demo_llm):
    extra = {"store": True, "metadata": {"team": "a"}, "service_tier": "auto",
             "prompt_cache_key": "k1", "safety_identifier": "u-1",
             "prediction": {"type": "content", "content": "x"}}
    raw = client.chat.completions.with_raw_response.create(
        model=server.model, messages=MESSAGES, max_tokens=6, temperature=0, user="me",
        extra_body=extra)
    names = raw.headers["x-jaxinfer-ignored-fields"].split(",")
    assert sorted(names) == sorted([*extra, "user"])
    expected = demo_llm.chat(MESSAGES, greedy(demo_llm, 6))[0].text
    assert raw.parse().choices[0].message.content == expected
    assert any("accepted and ignored" in line and "store" in line for line in server.log)
    plain = client.completions.with_raw_response.create(
        model=server.model, prompt=PROMPT, max_tokens=2, user="me")
    assert plain.headers["x-jaxinfer-ignored-fields"] == "user"
    assert "x-jaxinfer-ignored-fields" not in client.completions.with_raw_response.create(
        model=server.model, prompt=PROMPT, max_tokens=2).headers


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/chat/completions", "store", "yes"),  # ignored, but still type-checked
    ("/v1/completions", "store", True),  # not one of the legacy completions API's fields
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),  # would change it
    ("/v1/chat/completions", "verbosity", "low"),
])
def test_fields_that_would_matter_are_still_refused(server, path, field, value):
    body = {"model": server.model, "max_tokens": 2, field: value}
    body |= {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    response = server.post(path, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_null_content_is_refused_but_for_assistant_turns(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}]
    response = server.post("/v1/chat/completions",
                           json={"model": server.model, "messages": messages, "max_tokens": 2})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[1].content"
    turns = [MESSAGES[0], {"role": "assistant", "content": None}, MESSAGES[0]]
    response = server.post("/v1/chat/completions",
                           json={"model": server.model, "messages": turns, "max_tokens": 2})
    assert response.status_code == 200


def test_models_created_is_the_start_time(client):
    (model,) = client.models.list().data
    assert time.time() - 3600 < model.created <= time.time()


def test_every_metric_carries_the_model_name(server):
    values = metric_values(server)  # raises unless every sample has model_name=<served>
    assert "jaxinfer:prompt_tokens_total" in values
    assert f'model_name="{server.model}"' in server.get("/metrics").text


def test_access_log_line_per_request(server):
    server.post("/v1/chat/completions", json={"model": server.model, "messages": [
        {"role": "user", "content": None}]})
    deadline = time.monotonic() + 10
    wanted = '"POST /v1/chat/completions HTTP/1.1" 400'
    while not any(wanted in line for line in server.log) and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(line for line in server.log if wanted in line)
    assert "127.0.0.1:" in line


def test_disable_uvicorn_access_log_turns_it_off():
    quiet = start_server("--disable_uvicorn_access_log")
    try:
        assert quiet.get("/health").status_code == 200
        quiet.post("/v1/completions", json={"model": quiet.model, "prompt": "x",
                                            "max_tokens": 1})
    finally:
        assert quiet.stop() == 0
    assert not any('HTTP/1.1" 200' in line for line in quiet.log)
