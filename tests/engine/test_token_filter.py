"""vLLM's bad_words and allowed_token_ids (engine/structured/token_filter.py) on the
bundled demo model: bad words tokenized as vLLM tokenizes them; greedy runs never emit a
banned word, one token or two (whose first token may still appear); allowed_token_ids
keeps every token in its set; both hold beside a regex or a choice; bad values are
ValueErrors naming the field; nothing compiles after warm-up."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, StructuredOutputsParams
from jaxinfer.config import DEFAULT_MODEL
from jaxinfer.engine.runner.token_masks import TokenMasks
from jaxinfer.engine.structured.token_filter import (
    MaskRow,
    TokenFilter,
    allowed_row,
    tokenize_bad_words,
)

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, seed=0,
              strict_compile=True)
PROMPT = "import os\n"  # greedy: "from test.support import os_helper\nfrom test..."


@pytest.fixture(scope="module")
def llm():
    return LLM(str(DEFAULT_MODEL), **CONFIG)


@pytest.fixture(scope="module")
def plain(llm) -> list[int]:
    return _greedy(llm).token_ids


def _greedy(llm, prompt: str = PROMPT, max_tokens: int = 16, **params):
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                 **params), use_tqdm=False)[0].outputs[0]


def _encode(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def _has_run(tokens: list[int], run: list[int]) -> bool:
    return any(tokens[i:i + len(run)] == run for i in range(len(tokens)))


def test_bad_words_are_tokenized_as_vllm_does(llm):
    tokenizer, vocab = llm.get_tokenizer(), llm.engine.model_config.vocab_size
    # "import" and " import" are different single tokens: both banned.
    assert tokenize_bad_words([" import"], tokenizer, vocab) == (
        tuple(_encode(llm, "import")), tuple(_encode(llm, " import")))
    # " hello world" has one token more than "hello world": the spaced form is dropped.
    assert len(_encode(llm, " hello world")) != len(_encode(llm, "hello world"))
    assert tokenize_bad_words(["hello world"], tokenizer, vocab) == (
        tuple(_encode(llm, "hello world")),)
    assert tokenize_bad_words(["import", "import"], tokenizer, vocab) == (
        tokenize_bad_words(["import"], tokenizer, vocab))  # repeated words count once


def test_a_one_token_bad_word_never_appears(llm, plain):
    word = llm.get_tokenizer().decode([plain[4]])  # " import"
    banned = {*_encode(llm, word.lstrip()), *_encode(llm, " " + word.lstrip())}
    assert plain[4] in banned
    out = _greedy(llm, bad_words=[word])
    assert not banned & set(out.token_ids)
    assert out.token_ids[:4] == plain[:4]  # the same until the banned token's turn
    assert llm.metrics()["compiles_after_warmup"] == 0


def test_a_two_token_bad_word_never_appears_but_its_first_token_may(llm, plain):
    word = llm.get_tokenizer().decode(plain[4:6])  # " import os"
    runs = [_encode(llm, word.lstrip()), _encode(llm, " " + word.lstrip())]
    assert all(len(run) == 2 for run in runs) and _has_run(plain, runs[1])
    out = _greedy(llm, bad_words=[word])
    assert not any(_has_run(out.token_ids, run) for run in runs), out.text
    assert runs[1][0] in out.token_ids  # " import" alone is still fine
    assert out.token_ids[:5] == plain[:5]


def test_allowed_token_ids_keep_every_token_in_the_set(llm, plain):
    allowed = sorted(set(plain[:3]) | set(_encode(llm, " x y z")))
    out = _greedy(llm, allowed_token_ids=allowed)
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 16
    assert out.finish_reason == "length"  # EOS is not listed: masked too, as vLLM
    sampled = llm.generate([PROMPT] * 2, SamplingParams(
        temperature=1.0, seed=7, n=2, max_tokens=12, allowed_token_ids=allowed),
        use_tqdm=False)
    assert all(set(o.token_ids) <= set(allowed) for r in sampled for o in r.outputs)
    eos = min(llm.engine.eos_token_ids)
    ended = _greedy(llm, allowed_token_ids=[eos])
    assert ended.token_ids == [eos] and ended.finish_reason == "stop"


def test_a_filter_beside_a_regex_keeps_both(llm):
    regex = r"[a-z]{2,8}( [a-z]{2,8}){3}"
    constrained = dict(structured_outputs=StructuredOutputsParams(regex=regex))
    free = _greedy(llm, "The answer is", 32, **constrained)
    assert re.fullmatch(regex, free.text), free.text
    banned = free.token_ids[1]
    word = llm.get_tokenizer().decode([banned])
    out = _greedy(llm, "The answer is", 32, bad_words=[word], **constrained)
    assert re.fullmatch(regex, out.text) and banned not in out.token_ids, out.text
    assert out.token_ids[0] == free.token_ids[0]


def test_allowed_token_ids_beside_a_choice_narrow_it(llm):
    choices = ["yes", "no", "later"]
    # "y" is not among them: "yes" cannot be spelled (a filter that would leave the
    # grammar nothing yields to it, docs/sampling.md)
    allowed = sorted({*_encode(llm, "no"), *_encode(llm, "later")})
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=8,
                            allowed_token_ids=allowed,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    outputs = llm.generate(["The answer is", "Say yes:"], params, use_tqdm=False)
    texts = [o.text for r in outputs for o in r.outputs]
    assert set(texts) <= {"no", "later"}, texts


def test_unfiltered_requests_beside_filtered_ones_are_unchanged(llm, plain):
    params = [SamplingParams(temperature=0.0, max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=16, bad_words=["support"]),
              SamplingParams(temperature=0.0, max_tokens=16, allowed_token_ids=[5, 6])]
    outputs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == plain
    assert set(outputs[2].outputs[0].token_ids) <= {5, 6}


@pytest.mark.slow  # its own engine with verify buckets: ~40 s of warm-up
def test_filtered_requests_never_speculate_in_verify_steps(plain):
    """n-gram speculation on: a free greedy request verifies drafts while one with
    bad_words, in the same verify steps, samples one position under its mask."""
    from jaxinfer.config import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=False)
    llm = LLM(str(DEFAULT_MODEL), **CONFIG | dict(max_num_seqs=2), speculative_config=spec)
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    word = llm.get_tokenizer().decode(plain[4:6])  # " import os", as above
    runs = [_encode(llm, word.lstrip()), _encode(llm, " " + word.lstrip())]
    outputs = llm.generate(["# a b c\n" * 6, PROMPT], [
        free, SamplingParams(max_tokens=16, temperature=0.0, bad_words=[word])],
        use_tqdm=False)
    assert len(outputs[0].token_ids) == 40
    assert not any(_has_run(outputs[1].token_ids, run) for run in runs)
    metrics = llm.metrics()
    assert metrics["spec_verify_steps"] > 0 and metrics["spec_draft_tokens"] > 0
    assert metrics["spec_skipped_structured_outputs"] > 0
    assert metrics["compiles_after_warmup"] == 0


@pytest.mark.parametrize("params, message", [
    (dict(bad_words=[""]), "bad_words entries [''] must be non-empty strings"),
    (dict(bad_words=5), "bad_words must be a list"),
    (dict(bad_words=["w"] * 129), "bad_words has 129 words; at most 128"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be None or a non-empty list"),
    (dict(allowed_token_ids=[3, -1]), r"allowed_token_ids entries \[-1\] must be token ids"),
    (dict(allowed_token_ids=[True]), r"allowed_token_ids entries \[True\]"),
])
def test_bad_values_are_refused_naming_the_field(params, message):
    with pytest.raises(ValueError, match=message if "\\" in message else re.escape(message)):
        SamplingParams(**params)


@pytest.mark.parametrize("params, message", [
    (dict(allowed_token_ids=[1, 4096]), r"allowed_token_ids=\[4096\] must be token ids "
     "below 4096"),
    (dict(bad_words=["  "]), "bad_words entry '  ' must tokenize to at least one token"),
    (dict(bad_words=[f"w{i}" for i in range(100)]),
     r"bad_words make \d+ token sequences; at most 128"),
])
def test_engine_limits_are_refused_naming_the_field(llm, params, message):
    with pytest.raises(ValueError, match=message):
        _greedy(llm, **params)


def test_the_mask_row_ands_the_grammar_allowed_ids_and_bans():
    masks = TokenMasks(70, None)
    both = TokenFilter(((5,), (3, 4)), allowed_row([1, 3, 4, 5, 69], 70))
    mask, nbytes = masks.build([(0, MaskRow(None, both, [9])),
                                (2, MaskRow(None, both, [3])),
                                (1, MaskRow(None, TokenFilter(((31,),), None), []))], 3)
    assert nbytes == mask.nbytes and mask.shape == (3, 3)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(3, -1)[:, :70]
    assert np.flatnonzero(bits[0]).tolist() == [1, 3, 4, 69]
    assert np.flatnonzero(bits[2]).tolist() == [1, 3, 69]  # 4 follows 3: banned
    assert np.flatnonzero(~bits[1].astype(bool)).tolist() == [31]
    # A ban that would leave nothing yields to allowed_token_ids.
    only = TokenFilter(((1,),), allowed_row([1], 70))
    mask, _ = masks.build([(0, MaskRow(None, only, []))], 1)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:70]
    assert np.flatnonzero(bits).tolist() == [1]
