"""logit_bias on the device: a large bias forces a token, -100 removes the greedy one, for
greedy and sampled rows alike; logprobs stay the raw model's; a slot's next request
does not inherit its bias; no compilation after warm-up."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.request import MAX_LOGIT_BIAS

SMALL = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
             compilation_cache_dir="")
PROMPT = [5, 17, 42, 9, 77, 3]
VOCAB = 260  # the tiny test models'


@pytest.fixture(scope="module")
def llm(hf_model_dirs):
    return LLM(hf_model_dirs["llama"], strict_compile=True, **SMALL)


def _one(llm, **params):
    return llm.generate([PROMPT], [SamplingParams(max_tokens=6, **params)])[0]


def test_logit_bias_forces_a_token_and_logprobs_stay_raw(llm):
    plain = _one(llm, temperature=0.0, logprobs=5)
    forced_id = next(t for t in range(200, 256) if t not in plain.token_ids)
    forced = _one(llm, temperature=0.0, logprobs=5, logit_bias={forced_id: 100})
    assert forced.token_ids == [forced_id] * 6
    # The first step sees the same prompt: the same raw distribution, the bias unseen.
    first = {t: lp.logprob for t, lp in forced.logprobs[0].items()}
    raw = {t: lp.logprob for t, lp in plain.logprobs[0].items()}
    assert first[forced_id] < max(raw.values()) - 1e-3  # not the biased ~0
    for token, value in raw.items():
        assert first[token] == pytest.approx(value, abs=1e-5)
    sampled = _one(llm, temperature=0.8, top_p=0.9, top_k=20, seed=3,
                   logit_bias={forced_id: 100})
    assert sampled.token_ids == [forced_id] * 6


def test_logit_bias_minus_100_removes_the_greedy_choice(llm):
    plain = _one(llm, temperature=0.0)
    banned = plain.token_ids[0]
    out = _one(llm, temperature=0.0, logit_bias={banned: -100})
    assert banned not in out.token_ids
    # A pair on every token (more than one admission call carries): the same effect.
    many = {**{t: -0.5 for t in range(VOCAB)}, banned: -100}
    assert banned not in _one(llm, temperature=0.0, logit_bias=many).token_ids


def test_logit_bias_is_not_inherited_by_the_next_request_in_a_slot(llm):
    plain = _one(llm, temperature=0.0)
    biased = {t: 100.0 if t == 250 else -3.0 for t in range(200, 256)}
    prompts = [PROMPT, PROMPT[::-1], PROMPT[:3]]
    params = [SamplingParams(max_tokens=6, temperature=0.0, logit_bias=biased),
              SamplingParams(max_tokens=6, temperature=0.0),
              SamplingParams(max_tokens=6, temperature=0.0, logit_bias={250: 100})]
    mixed = llm.generate(prompts, params)
    assert mixed[0].token_ids == [250] * 6 == mixed[2].token_ids
    alone = llm.generate([PROMPT[::-1]], [SamplingParams(max_tokens=6, temperature=0.0)])
    assert mixed[1].token_ids == alone[0].token_ids
    assert _one(llm, temperature=0.0).token_ids == plain.token_ids  # slot 0 reused, clean
    assert llm.metrics()["compiles_after_warmup"] == 0


def test_logit_bias_outside_the_vocab_or_too_many_is_refused(llm):
    with pytest.raises(ValueError, match="logit_bias keys \\[260\\] must be token ids below 260"):
        _one(llm, logit_bias={VOCAB: 1})
    with pytest.raises(ValueError, match=f"logit_bias has {MAX_LOGIT_BIAS + 1} entries"):
        SamplingParams(logit_bias={t: 1 for t in range(MAX_LOGIT_BIAS + 1)})
