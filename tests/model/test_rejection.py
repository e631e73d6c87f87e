"""Speculative rejection sampling keeps the target's distribution: a chi-square test over
40,000 two-token samples of a tiny-vocabulary model, the same test failing for wrong
acceptance rules, and greedy verification equal to the argmax.

The "model" is a bigram language model over 12 tokens (next-token logits given the
previous token): the target's table and a draft's, which differs from it, so drafts are
rejected often. Three proposers' kinds of q: a draft model's (EAGLE-1's is the same
kind), EAGLE-3's (zero outside its reduced draft vocabulary, so the residual must supply
those tokens) and Medusa's (the second draft's q does not depend on the first draft).
Each sample drafts two tokens from the draft model as `model/draft.py` draws them (the
draft's stream, the request's settings), verifies them with `rejection.verify` at three
positions (two drafts and the bonus), keeps what the host keeps
(`ScheduledChunk.accepted`: the accepted drafts and the target's token after them) and,
where the first draft was rejected, draws the second token as the next plain step would.
The pair (t0, t1) must follow p(t0) p(t1 | t0), p being the plain sampler's distribution
under the same settings (temperature 1, and with top-p 0.9). Seeds are fixed, so the
test is deterministic.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model import draft, rejection, sampler

VOCAB = 12
SAMPLES = 40_000
CONTEXT = 3  # the token before the two drafted positions
Z_999 = 3.0902  # the standard normal's 0.999 quantile


def _tables():
    rng = np.random.default_rng(0)
    target = rng.normal(size=(VOCAB, VOCAB)).astype(np.float32) * 1.5
    draft_table = target + rng.normal(size=(VOCAB, VOCAB)).astype(np.float32)
    return jnp.asarray(target), jnp.asarray(draft_table)


def _inputs(rows, counters, *, temperature, top_p, seed_offset=0):
    """SamplingInputs of `rows` rows, seeds seed_offset + row index; no penalties."""
    zeros = np.zeros(rows, np.float32)
    return sampler.SamplingInputs(
        temperature=np.full(rows, temperature, np.float32), top_k=np.zeros(rows, np.int32),
        top_p=np.full(rows, top_p, np.float32), min_p=zeros, repetition_penalty=zeros + 1,
        presence_penalty=zeros, frequency_penalty=zeros,
        seeds=(np.arange(rows) + seed_offset).astype(np.uint32),
        counters=np.broadcast_to(counters, rows).astype(np.int32),
        history=np.full((rows, 1), -1, np.int32), history_rows=np.arange(rows, dtype=np.int32),
        prompt_lens=np.zeros(rows, np.int32),
        history_lens=np.zeros(rows, np.int32), ban_stop=np.zeros(rows, bool),
        stop_ids=np.full((rows, 1), -1, np.int32), logprobs=np.zeros(rows, np.int32))


def _draft_logits(draft_table, previous, proposer):
    """The proposer's logits for the next draft after token(s) `previous`: a draft model's
    (and EAGLE-1's) bigram row; EAGLE-3's over a reduced draft vocabulary (its d2t map
    covers half the ids: the rest are -inf, q = 0 there); Medusa's head rows, which do
    not see the draft before them (each head reads the same hidden state)."""
    if proposer == "medusa":
        return jnp.broadcast_to(draft_table[(CONTEXT + 1) % VOCAB], previous.shape + (VOCAB,))
    logits = draft_table[previous]
    if proposer == "eagle3":
        logits = jnp.where(jnp.arange(VOCAB) % 2 == 0, logits, -jnp.inf)
    return logits


@functools.partial(jax.jit, static_argnames=("temperature", "top_p", "proposer"))
def _speculative_pairs(target, draft_table, *, temperature, top_p, proposer="draft_model"):
    """i32[N, 2]: (t0, t1) of N speculative steps, as the engine emits them."""
    n = SAMPLES
    settings = dict(temperature=temperature, top_p=top_p)
    first = _draft_logits(draft_table, jnp.full((n,), CONTEXT), proposer)
    x0, q0 = draft._draw(first, _inputs(n, 0, **settings))
    x1, q1 = draft._draw(_draft_logits(draft_table, x0, proposer), _inputs(n, 1, **settings))
    logits = jnp.stack([jnp.broadcast_to(target[CONTEXT], (n, VOCAB)), target[x0],
                        target[x1]], axis=1).reshape(3 * n, VOCAB)
    proposed = jnp.stack([x0, x1, jnp.full_like(x0, -1)], axis=1).reshape(-1)
    probs = jnp.stack([q0, q1, jnp.zeros_like(q0)], axis=1).reshape(3 * n, VOCAB)
    rows = _inputs(3 * n, np.tile([0, 1, 2], n), **settings)
    rows = jax.tree.map(lambda x: x, rows)
    rows = _per_sample_seeds(rows, n)
    tokens = rejection.verify(logits, rows, proposed, probs, num_logprobs=1).token_ids
    tokens = tokens.reshape(n, 3)
    first_accepted = tokens[:, 0] == x0
    # Where x0 was rejected, t1 comes from the next step: a plain draw after t0.
    later = sampler.sample(target[tokens[:, 0]], _inputs(n, 1, **settings, seed_offset=n),
                           num_logprobs=1).token_ids
    return jnp.stack([tokens[:, 0], jnp.where(first_accepted, tokens[:, 1], later)], axis=1)


def _per_sample_seeds(rows, n):
    """Rows 3i, 3i + 1, 3i + 2 are positions of sample i: they share its seed i."""
    seeds = np.repeat(np.arange(n), 3).astype(np.uint32)
    return sampler.SamplingInputs(**{**vars(rows), "seeds": seeds})


def _expected(target, *, temperature, top_p):
    """f64[V, V]: p(t0) p(t1 | t0) under the plain sampler's filters."""
    inputs = _inputs(VOCAB, 0, temperature=temperature, top_p=top_p)
    p = np.asarray(rejection.probabilities(target, inputs), np.float64)  # p(next | prev)
    return p[CONTEXT][:, None] * p


def _chi_square(observed, expected):
    """(statistic, the 0.999 critical value) of counts against probabilities (flattened
    cells; those expected below 5 pooled into one)."""
    got = np.asarray(observed, np.float64).reshape(-1)
    want = np.asarray(expected, np.float64).reshape(-1) * got.sum()
    small = want < 5
    want = np.append(want[~small], want[small].sum())
    got = np.append(got[~small], got[small].sum())
    statistic = float(((got - want) ** 2 / np.maximum(want, 1e-12)).sum())
    df = len(want) - 1  # Wilson-Hilferty: the chi-square quantile from the normal one
    critical = df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3
    return statistic, critical


def _pair_counts(pairs):
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    return counts


@pytest.mark.parametrize("proposer", ["draft_model", "eagle3", "medusa"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_speculative_tokens_follow_the_target_distribution(top_p, proposer):
    target, draft_table = _tables()
    pairs = np.asarray(_speculative_pairs(target, draft_table, temperature=1.0, top_p=top_p,
                                          proposer=proposer))
    expected = _expected(target, temperature=1.0, top_p=top_p)
    statistic, critical = _chi_square(_pair_counts(pairs), expected)
    assert statistic < critical, (statistic, critical)
    drafted = draft._draw(_draft_logits(draft_table, jnp.full((SAMPLES,), CONTEXT), proposer),
                          _inputs(SAMPLES, 0, temperature=1.0, top_p=top_p))[0]
    assert np.mean(pairs[:, 0] != np.asarray(drafted)) > 0.1  # residual draws happened
    # The plain sampler's own draws pass the same kind of test (the statistic is sound).
    plain = sampler.sample(jnp.broadcast_to(target[CONTEXT], (SAMPLES, VOCAB)),
                           _inputs(SAMPLES, 0, temperature=1.0, top_p=top_p),
                           num_logprobs=1).token_ids
    plain_statistic, plain_critical = _chi_square(
        np.bincount(np.asarray(plain), minlength=VOCAB), expected.sum(axis=1))
    assert plain_statistic < plain_critical, (plain_statistic, plain_critical)


def _residual_is_p(p, q, proposed_ids, plain, u_accept, u_residual):
    """Wrong: a rejected draft is replaced by a draw from p, not from max(0, p - q)."""
    x = jnp.maximum(proposed_ids, 0)
    px = jnp.take_along_axis(p, x[:, None], axis=-1)[:, 0]
    qx = jnp.take_along_axis(q, x[:, None], axis=-1)[:, 0]
    redrawn = sampler.inverse_cdf(p, u_residual)
    return jnp.where(proposed_ids < 0, plain, jnp.where(u_accept * qx < px, x, redrawn))


def _accept_with_p(p, q, proposed_ids, plain, u_accept, u_residual):
    """Wrong: accepted with probability p(x), as if the draft were certain."""
    x = jnp.maximum(proposed_ids, 0)
    px = jnp.take_along_axis(p, x[:, None], axis=-1)[:, 0]
    resampled = sampler.inverse_cdf(jnp.maximum(p - q, 0.0) + 1e-30, u_residual)
    return jnp.where(proposed_ids < 0, plain, jnp.where(u_accept < px, x, resampled))


@pytest.mark.parametrize("proposer", ["draft_model", "eagle3", "medusa"])
@pytest.mark.parametrize("wrong", [_residual_is_p, _accept_with_p])
def test_wrong_acceptance_rules_fail_the_same_test(monkeypatch, wrong, proposer):
    monkeypatch.setattr(rejection, "rejection_tokens", wrong)
    target, draft_table = _tables()
    # Run op by op: a jitted call could reuse the trace made with the right rule.
    pairs = np.asarray(_speculative_pairs.__wrapped__(target, draft_table, temperature=1.0,
                                                      top_p=1.0, proposer=proposer))
    statistic, critical = _chi_square(_pair_counts(pairs),
                                      _expected(target, temperature=1.0, top_p=1.0))
    assert statistic > 2 * critical, (statistic, critical)


def test_greedy_rows_take_the_target_argmax_whatever_is_proposed():
    target, draft_table = _tables()
    logits = jnp.concatenate([target, target])  # 24 rows
    proposed = jnp.concatenate([jnp.argmax(target, -1), jnp.arange(VOCAB)[::-1]])
    probs = jax.nn.softmax(jnp.concatenate([draft_table, draft_table]), axis=-1)
    inputs = _inputs(2 * VOCAB, 0, temperature=0.0, top_p=1.0)
    for q in (probs, None):
        out = rejection.verify(logits, inputs, proposed, q, num_logprobs=2)
        np.testing.assert_array_equal(out.token_ids, np.argmax(np.asarray(logits), -1))
        want = jax.nn.log_softmax(logits)[jnp.arange(2 * VOCAB), out.token_ids]
        np.testing.assert_allclose(out.logprobs, want, rtol=1e-6)
        proposed_lp = jax.nn.log_softmax(logits)[jnp.arange(2 * VOCAB), proposed]
        np.testing.assert_allclose(out.proposed_logprobs, proposed_lp, rtol=1e-6)
