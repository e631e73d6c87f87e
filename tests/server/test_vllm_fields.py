"""vLLM's request fields through the real openai client (extra_body) and the Python API,
each with its effect: include_stop_str_in_output, stop_reason, truncate_prompt_tokens,
continue_final_message with chat echo, chat_template_kwargs, reasoning_effort, priority,
max_tokens=None, top_k=-1, logprobs=-1, detokenize, skip_special_tokens,
cumulative_logprob, bad_words, allowed_token_ids. docs/serving.md#parameters."""

from __future__ import annotations

import math

import openai
import pytest
from serving import greedy

from jaxinfer import SamplingParams

PROMPT = "import os\n\n\ndef read_lines(path):"


@pytest.fixture(scope="module")
def reference(demo_llm) -> str:
    """The demo model's greedy continuation of PROMPT."""
    return _text(demo_llm, PROMPT, 24)


def _text(llm, prompt, max_tokens: int) -> str:
    """What the server answers a greedy request: the checkpoint's defaults, temperature 0."""
    return llm.generate([prompt], greedy(llm, max_tokens), use_tqdm=False)[0].outputs[0].text


def _stop_in(reference: str) -> str:
    """A stop string the greedy text reaches after its start."""
    stop = reference[len(reference) // 2:len(reference) // 2 + 3]
    assert stop.strip() and reference.index(stop) > 0
    return stop


@pytest.mark.parametrize("keep", [False, True])
def test_a_stop_string_is_the_stop_reason_and_kept_when_asked(client, server, reference,
                                                              keep):
    stop = _stop_in(reference)
    done = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0.0, stop=[stop],
        extra_body={"include_stop_str_in_output": keep})
    choice = done.choices[0]
    cut = reference[:reference.index(stop)]
    assert choice.text == (cut + stop if keep else cut)
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)


def test_the_python_api_keeps_the_stop_string_too(demo_llm, reference):
    stop = _stop_in(reference)
    params = greedy(demo_llm, 24, stop=(stop,), include_stop_str_in_output=True)
    out = demo_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.text == reference[:reference.index(stop)] + stop and out.stop_reason == stop


def test_truncate_prompt_tokens_keeps_the_last_ones(client, server, demo_llm):
    ids = demo_llm.get_tokenizer().encode(PROMPT)
    done = client.completions.create(model=server.model, prompt=ids, max_tokens=6,
                                     temperature=0.0,
                                     extra_body={"truncate_prompt_tokens": 5})
    assert done.usage.prompt_tokens == 5
    assert done.choices[0].text == _text(demo_llm, ids[-5:], 6)


def test_continue_final_message_with_echo(client, server):
    messages = [{"role": "user", "content": "Write a function."},
                {"role": "assistant", "content": "def add(a, b):"}]
    common = dict(model=server.model, messages=messages, max_tokens=8, temperature=0.0)
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**common, extra_body=extra)
    echoed = client.chat.completions.create(**common, extra_body=extra | {"echo": True})
    assert echoed.choices[0].message.content == (
        "def add(a, b):" + plain.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(**common, extra_body={"continue_final_message": True})


def test_template_options_are_accepted_and_reserved_names_refused(client, server):
    messages = [{"role": "user", "content": "hi"}]
    done = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=2, reasoning_effort="low",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "priority": -1})
    assert done.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.tools: set by"):
        client.chat.completions.create(model=server.model, messages=messages, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tools": []}})


def test_vllms_special_values(client, server, demo_llm):
    assert SamplingParams(top_k=-1).top_k == 0
    done = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4,
                                     temperature=0.0, extra_body={"top_k": -1})
    assert done.choices[0].text == _text(demo_llm, PROMPT, 4)
    with pytest.raises(openai.BadRequestError, match=r"logprobs=-1 must be None or an int in "
                       r"\[0, 20\] \(-1, the whole vocabulary, is more than that\)"):
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, logprobs=-1)


def test_max_tokens_none_runs_to_the_context(demo_llm):
    ids = demo_llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    out = demo_llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == demo_llm.max_model_len - len(ids)
    assert out.finish_reason == "length"


def test_detokenize_off_and_cumulative_logprob(demo_llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    out = demo_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    chosen = [entry[token].logprob for entry, token in zip(out.logprobs, out.token_ids,
                                                            strict=True)]
    assert math.isclose(out.cumulative_logprob, sum(chosen), rel_tol=1e-9)
    bare = demo_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6,
                                                      detokenize=False), use_tqdm=False)
    assert bare[0].outputs[0].text == "" and bare[0].outputs[0].token_ids == out.token_ids
    assert bare[0].outputs[0].cumulative_logprob is None  # no logprobs asked, as vLLM
    with pytest.raises(ValueError, match="stop=.* must be empty when detokenize=False"):
        SamplingParams(detokenize=False, stop=["x"])


def test_skip_special_tokens_off_keeps_them(demo_llm):
    tokenizer = demo_llm.get_tokenizer()
    eos = min(tokenizer.eos_token_ids)
    detok = demo_llm.engine.tokenizer.detokenizer
    shown = detok([], skip_special_tokens=False)
    assert shown.add([eos]) + shown.flush() == tokenizer.decode([eos], skip_special_tokens=False)
    params = greedy(demo_llm, 4, skip_special_tokens=False)
    assert demo_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text == (
        _text(demo_llm, PROMPT, 4))  # no special token generated: the same text


def test_bad_words_through_the_client_match_the_python_api(client, server, demo_llm):
    plain = demo_llm.generate([PROMPT], greedy(demo_llm, 12), use_tqdm=False)[0].outputs[0]
    tokenizer = demo_llm.get_tokenizer()
    word = tokenizer.decode(plain.token_ids[2:3])
    banned = {*tokenizer.encode(word.lstrip(), add_special_tokens=False),
              *tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)}
    want = demo_llm.generate([PROMPT], greedy(demo_llm, 12, bad_words=(word,)),
                             use_tqdm=False)[0].outputs[0]
    assert not banned & set(want.token_ids) and want.text != plain.text
    done = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12,
                                     temperature=0.0, extra_body={"bad_words": [word]})
    assert done.choices[0].text == want.text
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                  extra_body={"bad_words": ["ok", ""]})
    assert error.value.body["param"] == "bad_words"


def test_allowed_token_ids_through_the_client(client, server, demo_llm):
    tokenizer = demo_llm.get_tokenizer()
    allowed = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "xy"]
    assert [tokenizer.decode([t]) for t in allowed] == ["x", "y"]
    done = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0.0, extra_body={"allowed_token_ids": allowed})
    choice = done.choices[0]
    assert set(choice.message.content) <= {"x", "y"} and len(choice.message.content) == 6
    assert choice.finish_reason == "length"  # EOS is not allowed either
    vocab = demo_llm.engine.model_config.vocab_size
    for ids in ([], [1, vocab]):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2,
                                      extra_body={"allowed_token_ids": ids})
        assert error.value.body["param"] == "allowed_token_ids"
