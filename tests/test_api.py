"""LLM.generate against transformers' generate, and the API's input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import LLM, SamplingParams

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def llms(hf_model_dirs):
    return {f: LLM(model=d, page_size=8, max_model_len=96, max_num_seqs=4,
                   max_num_batched_tokens=32, compilation_cache_dir="")
            for f, d in hf_model_dirs.items() if f in FAMILIES}


def _hf_generate(model, ids, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=258)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1).numpy() for s in out.logits]
    return tokens, logprobs


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_greedy_matches_transformers(family, llms, hf_models):
    ids = np.random.default_rng(11).integers(0, 256, size=11).tolist()
    (out,) = llms[family].generate([ids], SamplingParams(max_tokens=30, temperature=0.0,
                                                         logprobs=3))
    want, want_logprobs = _hf_generate(hf_models[family], ids, 30)
    assert out.token_ids == want
    assert out.prompt_token_ids == ids
    assert len(out.logprobs) == len(out.token_ids)
    worst = 0.0
    for token, got, ref in zip(out.token_ids, out.logprobs, want_logprobs, strict=True):
        assert token in got and len(got) <= 4
        assert list(got)[0] == token and got[token].rank == 1  # greedy: the top token
        top = np.argsort(-ref)[:3].tolist()
        assert set(got) >= set(top)
        assert [got[t].rank for t in top] == [1, 2, 3]
        assert all(got[t].decoded_token == llms[family].tokenizer.decode(
            [t], skip_special_tokens=False) for t in top)
        worst = max(worst, max(abs(lp.logprob - ref[t]) for t, lp in got.items()))
    print(f"{family}: max logprob diff {worst:.2e}")
    assert worst < 1e-4
    expected = "stop" if len(want) < 30 else "length"
    assert out.finish_reason == expected


def test_generate_text_prompt_uses_tokenizer(llms, hf_model_dirs):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(hf_model_dirs["llama"])
    prompts = ["def f(x):", "héllo wörld"]
    outs = llms["llama"].generate(prompts, SamplingParams(max_tokens=5, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt == prompt
        assert out.prompt_token_ids == hf_tok(prompt)["input_ids"]
        assert out.text == hf_tok.decode(out.token_ids, skip_special_tokens=True)


def test_generate_one_params_per_prompt(llms):
    outs = llms["qwen2"].generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=3),
                                                        SamplingParams(max_tokens=7)])
    assert [len(o.token_ids) for o in outs] == [3, 7]
    assert all(o.finish_reason == "length" for o in outs)


def test_generate_stop_token_ids(llms):
    llm = llms["llama"]
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    (full,) = llm.generate([[1, 2, 3, 4]], greedy)
    stop = full.token_ids[4]
    first = full.token_ids.index(stop)
    (out,) = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=20, temperature=0.0,
                                                         stop_token_ids=[stop]))
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop"


def test_generate_stops_at_max_model_len(llms):
    (out,) = llms["qwen3"].generate([list(range(90))], SamplingParams(max_tokens=50))
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_generate_seeded_sampling_is_reproducible(llms):
    llm = llms["mistral"]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    a, b = llm.generate([[3, 4, 5], [3, 4, 5]], params)
    (c,) = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=20, temperature=1.0,
                                                    top_p=0.9, seed=99))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_generate_top_k_one_is_greedy(llms):
    llm = llms["qwen2"]
    (greedy,) = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=10, temperature=0.0))
    (top1,) = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=10, temperature=2.0,
                                                       top_k=1, seed=5))
    assert top1.token_ids == greedy.token_ids


def test_generate_rejects_too_long_prompt_by_index(llms):
    with pytest.raises(ValueError, match="prompt 1: the prompt has 96 tokens; max_model_len 96"):
        llms["llama"].generate([[1, 2], list(range(96))])


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt 0: the prompt is empty"),
    ([5, 999], r"prompt 0: token ids outside \[0, 260\): \[999\]"),
])
def test_generate_rejects_bad_prompt(llms, prompt, message):
    with pytest.raises(ValueError, match=message):
        llms["llama"].generate([prompt])


def test_generate_rejects_params_count_mismatch(llms):
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llms["llama"].generate([[1], [2]], [SamplingParams()])


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"), ({"logprobs": 21}, "logprobs"),
    ({"seed": 2**64}, "seed"), ({"temperature": float("nan")}, "temperature"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
])
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**kwargs)


def test_llm_rejects_unknown_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=tmp_path / "missing")


def test_llm_rejects_bad_max_model_len(hf_model_dirs):
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds the model's"):
        LLM(model=hf_model_dirs["llama"], max_model_len=4096)


def test_generate_shows_a_progress_bar_unless_told_not_to(llms, capsys):
    llm = llms["llama"]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    llm.generate([[1, 2], [3, 4], [5]], params)  # vLLM's default: shown
    shown = capsys.readouterr().err
    assert "Processed prompts" in shown and "3/3" in shown
    llm.generate([[1, 2], [3, 4], [5]], params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
