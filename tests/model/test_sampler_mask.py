"""The structured-outputs token mask in the sampler (`sampler.constrain`): every sampling
method picks an allowed token, logprobs stay the raw ones, all-ones rows are untouched,
and the verify step's rejection sampler honours it too."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer.model import rejection, sampler

R, V = 8, 64  # rows, vocab: 2 mask words
_NEUTRAL = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "seeds": 0, "counters": 0, "prompt_lens": 0, "history_lens": 0,
            "ban_stop": False, "logprobs": 0}
_sample = jax.jit(sampler.sample, static_argnames="num_logprobs")
_verify = jax.jit(rejection.verify, static_argnames="num_logprobs")


def _inputs(num_rows: int, **fields) -> sampler.SamplingInputs:
    """Neutral greedy rows (no history, two stop ids); `fields` override."""
    arrays = {"history": np.full((num_rows, 16), -1, np.int32),
              "history_rows": np.arange(num_rows, dtype=np.int32),
              "stop_ids": np.full((num_rows, 2), -1, np.int32)}
    for name, value in (_NEUTRAL | fields).items():
        default = arrays.get(name, np.asarray(_NEUTRAL.get(name, 0)))
        dtype = {"seeds": np.uint32, "ban_stop": np.bool_}.get(name, default.dtype)
        if name in ("top_k", "counters", "prompt_lens", "history_lens", "logprobs"):
            dtype = np.int32
        elif name not in arrays and dtype == np.float64:
            dtype = np.float32
        shape = arrays[name].shape if name in arrays else (num_rows,)
        arrays[name] = np.broadcast_to(np.asarray(value, dtype), shape).copy()
    return sampler.SamplingInputs(**arrays)


def _mask(allowed: list[list[int] | None]) -> np.ndarray:
    """i32[R, V / 32]: each row's allowed ids (None: all)."""
    bits = np.zeros((len(allowed), V), np.uint8)
    for r, ids in enumerate(allowed):
        bits[r, ids if ids is not None else slice(None)] = 1
    return np.packbits(bits, axis=-1, bitorder="little").view(np.int32)


SETTINGS = {
    "greedy": {},
    "temperature": {"temperature": 1.5},
    "top_k": {"temperature": 1.0, "top_k": 3},
    "top_p": {"temperature": 1.0, "top_p": 0.5},
    "min_p": {"temperature": 1.0, "min_p": 0.2},
    "penalties": {"temperature": 0.7, "repetition_penalty": 1.5, "presence_penalty": 1.0,
                  "history": np.tile(np.arange(16, dtype=np.int32), (R, 1)),
                  "history_lens": 16, "prompt_lens": 4},
}


@pytest.mark.parametrize("name", SETTINGS)
def test_constrain_every_method_samples_allowed_tokens(name):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(R, V)).astype(np.float32) * 3
    allowed = [sorted(rng.choice(V, size=3, replace=False).tolist()) for _ in range(R - 1)]
    allowed.append(None)  # an unconstrained row
    for counter in range(5):
        inputs = _inputs(R, seeds=np.arange(R), counters=counter, logprobs=4,
                         **SETTINGS[name])
        out = _sample(logits, inputs, num_logprobs=4, token_mask=_mask(allowed))
        free = _sample(logits, inputs, num_logprobs=4)
        tokens = np.asarray(out.token_ids)
        for r, ids in enumerate(allowed[:-1]):
            assert tokens[r] in ids
        assert tokens[-1] == np.asarray(free.token_ids)[-1]  # untouched by the others
        raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        np.testing.assert_allclose(np.asarray(out.logprobs), raw[np.arange(R), tokens],
                                   rtol=1e-5, atol=1e-5)  # raw logprobs
        np.testing.assert_allclose(np.asarray(out.top_logprobs),
                                   np.asarray(free.top_logprobs), rtol=1e-6)


def test_constrain_all_ones_mask_changes_nothing():
    logits = np.random.default_rng(1).normal(size=(R, V)).astype(np.float32)
    inputs = _inputs(R, temperature=1.0, seeds=np.arange(R))
    ones = np.full((R, V // 32), -1, np.int32)
    masked = _sample(logits, inputs, num_logprobs=2, token_mask=ones)
    free = _sample(logits, inputs, num_logprobs=2)
    np.testing.assert_array_equal(np.asarray(masked.token_ids), np.asarray(free.token_ids))


def test_constrain_a_banned_only_token_falls_back_to_the_allowed_ones():
    """min_tokens bans EOS (id 0) while the grammar allows only EOS: no NaN, EOS is taken."""
    logits = np.zeros((R, V), np.float32)
    inputs = _inputs(R, temperature=1.0, ban_stop=True, stop_ids=[[0, -1]] * R)
    out = _sample(logits, inputs, num_logprobs=0, token_mask=_mask([[0]] * R))
    assert np.asarray(out.token_ids).tolist() == [0] * R


def test_constrain_verify_rows_sample_allowed_tokens():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(R, V)).astype(np.float32) * 3
    allowed = [[5, 9]] * R
    inputs = _inputs(R, temperature=1.0, seeds=np.arange(R))
    proposed = np.full(R, -1, np.int32)  # a constrained request proposes nothing
    out = _verify(logits, inputs, proposed, None, num_logprobs=0, token_mask=_mask(allowed))
    assert set(np.asarray(out.token_ids).tolist()) <= {5, 9}
