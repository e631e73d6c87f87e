"""The on-device sampler against a numpy reference: penalties, min_tokens, filters, keys."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model import sampler

S, V, W, E, K = 8, 64, 16, 2, 4  # rows, vocab, history width, stop ids, logprobs
_sample = jax.jit(sampler.sample, static_argnames="num_logprobs")
_penalize = jax.jit(sampler.penalize)
_DEFAULTS = {  # name -> (dtype, neutral value)
    "temperature": (np.float32, 0.0), "top_k": (np.int32, 0), "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0), "repetition_penalty": (np.float32, 1.0),
    "presence_penalty": (np.float32, 0.0), "frequency_penalty": (np.float32, 0.0),
    "seeds": (np.uint32, 0), "counters": (np.int32, 0), "prompt_lens": (np.int32, 0),
    "history_lens": (np.int32, 0), "ban_stop": (np.bool_, False), "logprobs": (np.int32, 0),
}


def _history(rows: list[tuple[list[int], list[int]]], width: int = W) -> dict:
    """history/prompt_lens/history_lens for (prompt ids, output ids) per row."""
    history = np.full((len(rows), width), -1, np.int32)
    for r, (prompt, output) in enumerate(rows):
        history[r, :len(prompt) + len(output)] = list(prompt) + list(output)
    return {"history": history, "prompt_lens": [len(p) for p, _ in rows],
            "history_lens": [len(p) + len(o) for p, o in rows]}


def _inputs(num_rows: int = S, width: int = W, num_stops: int = E,
            **fields) -> sampler.SamplingInputs:
    """Neutral greedy rows; `fields` override (broadcast to [num_rows] or given whole)."""
    arrays = {name: np.full(num_rows, value, dtype) for name, (dtype, value) in _DEFAULTS.items()}
    arrays["history"] = np.full((num_rows, width), -1, np.int32)
    arrays["history_rows"] = np.arange(num_rows, dtype=np.int32)
    arrays["stop_ids"] = np.full((num_rows, num_stops), -1, np.int32)
    for name, value in fields.items():
        dtype = arrays[name].dtype
        arrays[name] = np.broadcast_to(np.asarray(value, dtype), arrays[name].shape).copy()
    return sampler.SamplingInputs(**arrays)


def _np_penalize(logits: np.ndarray, inp: sampler.SamplingInputs) -> np.ndarray:
    """vLLM's penalties and the min_tokens ban, one row at a time."""
    out = np.array(logits, np.float32)
    for r in range(out.shape[0]):
        hist = inp.history[r, :inp.history_lens[r]]
        prompt, output = hist[:inp.prompt_lens[r]], hist[inp.prompt_lens[r]:]
        counts = np.bincount(output[output >= 0], minlength=out.shape[1])
        present = counts > 0
        present[prompt[prompt >= 0]] = True
        row, rep = out[r], inp.repetition_penalty[r]
        row = np.where(present, np.where(row > 0, row / rep, row * rep), row)
        row = row - inp.frequency_penalty[r] * counts - inp.presence_penalty[r] * (counts > 0)
        if inp.ban_stop[r]:
            stops = inp.stop_ids[r]
            row[stops[stops >= 0]] = -np.inf
        out[r] = row
    return out


def _np_filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                       min_p: float) -> np.ndarray:
    """softmax(logits / T) restricted by top-k, then top-p, then min-p; renormalized."""
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros(len(logits), bool)
    keep[order[:top_k or len(logits)]] = True
    p = np.where(keep, probs, 0) / np.sum(np.where(keep, probs, 0))
    above = np.cumsum(p[order]) - p[order]
    keep[order[above >= top_p]] = False
    keep &= probs >= min_p * probs.max()
    return np.where(keep, probs, 0) / np.sum(np.where(keep, probs, 0))


def _logits(seed: int, shape: tuple[int, int] = (S, V)) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, shape).astype(np.float32)


def test_penalize_matches_numpy_reference():
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(S):
        n_prompt, n_out = rng.integers(0, 8, size=2)
        rows.append((rng.integers(0, 12, n_prompt).tolist(), rng.integers(0, 12, n_out).tolist()))
    hist = _history(rows)
    hist["history"][1, hist["history_lens"][1]:] = 11  # stale ids past history_lens don't count
    inp = _inputs(**hist, repetition_penalty=rng.uniform(0.5, 2, S),
                  presence_penalty=rng.uniform(-1, 1, S), frequency_penalty=rng.uniform(-1, 1, S),
                  ban_stop=rng.integers(0, 2, S).astype(bool),
                  stop_ids=np.stack([rng.integers(0, V, S), np.full(S, -1)], axis=1))
    inp = dataclasses.replace(inp, repetition_penalty=np.where(
        np.arange(S) % 3 == 0, np.float32(1), inp.repetition_penalty))
    logits = _logits(1)
    logits[:, :12] = rng.choice([-3.0, -0.5, 0.0, 0.5, 3.0], (S, 12))  # both signs on seen ids
    np.testing.assert_allclose(_penalize(logits, inp), _np_penalize(logits, inp), rtol=1e-6)


@pytest.mark.parametrize("name", ["repetition_penalty", "presence_penalty", "frequency_penalty"])
def test_penalize_any_single_penalty_takes_count_branch(name):
    logits = _logits(8)
    neutral = _DEFAULTS[name][1]
    inp = _inputs(**_history([([1, 2], [3, 3, 4]) for _ in range(S)]),
                  **{name: [neutral] * (S - 1) + [neutral + 0.5]})
    got = np.asarray(_penalize(logits, inp))
    np.testing.assert_allclose(got, _np_penalize(logits, inp), rtol=1e-6)
    assert not np.array_equal(got[-1], logits[-1])


def test_sample_greedy_penalties_flip_winner():
    logits = np.full((5, V), -5.0, np.float32)
    logits[:, :2] = [[2.0, 1.8], [3.0, 2.5], [3.0, 2.0], [-1.0, -1.2], [3.0, 2.5]]
    inp = _inputs(5, **_history([([0], []), ([], [0]), ([], [0, 0, 0]), ([], [0]), ([0], [])]),
                  repetition_penalty=[1.5, 1, 1, 1.5, 1], presence_penalty=[0, 1, 0.5, 0, 1],
                  frequency_penalty=[0, 0, 0.5, 0, 0])
    ref = np.argmax(_np_penalize(logits, inp), axis=-1)
    np.testing.assert_array_equal(ref, [1, 1, 1, 1, 0])  # presence ignores prompt-only ids
    np.testing.assert_array_equal(_sample(logits, inp, num_logprobs=K).token_ids, ref)


def test_sample_min_tokens_ban_blocks_stop_ids():
    n = 64
    logits = np.zeros((n, V), np.float32)
    logits[:, [3, 5]] = 10.0
    ban = np.arange(n) < n // 2
    inp = _inputs(n, temperature=np.where(np.arange(n) % 4 == 0, 0.0, 1.0),
                  seeds=np.arange(n), ban_stop=ban, stop_ids=[3, 5])
    tokens = np.asarray(_sample(logits, inp, num_logprobs=K).token_ids)
    assert not np.isin(tokens[ban], [3, 5]).any()
    assert np.isin(tokens[~ban], [3, 5]).all()


def test_sample_top_k_one_equals_greedy():
    logits = _logits(2)
    inp = _inputs(temperature=[0.05, 0.3, 0.7, 1, 1.5, 3, 10, 100], top_k=1, seeds=np.arange(S))
    np.testing.assert_array_equal(_sample(logits, inp, num_logprobs=K).token_ids,
                                  np.argmax(logits, axis=-1))


@pytest.mark.parametrize("knob", [{"min_p": 1.0}, {"top_p": 1e-6}])
def test_sample_min_p_one_and_tiny_top_p_equal_greedy(knob):
    logits = _logits(3)
    inp = _inputs(temperature=[0.3, 0.7, 1, 1.5, 3, 10, 100, 1e3], seeds=np.arange(S), **knob)
    np.testing.assert_array_equal(_sample(logits, inp, num_logprobs=K).token_ids,
                                  np.argmax(logits, axis=-1))


def _batch_with(target: dict, target_logits: np.ndarray, row: int, seed: int) -> tuple:
    """Random other rows (params, logits, penalties) with `target` put at `row`."""
    rng = np.random.default_rng(seed)
    fields = {"temperature": rng.uniform(0, 2, S), "top_k": rng.integers(0, 5, S),
              "top_p": rng.uniform(0.5, 1, S), "min_p": rng.uniform(0, 0.2, S),
              "frequency_penalty": rng.uniform(0, 1, S), "repetition_penalty": rng.uniform(1, 2, S),
              "presence_penalty": rng.uniform(0, 1, S), "seeds": rng.integers(0, 99, S),
              "counters": rng.integers(0, 99, S), "ban_stop": rng.integers(0, 2, S),
              **_history([([1, 2], [3]) for _ in range(S)])}
    for name, value in target.items():
        fields[name] = np.array(fields[name], copy=True)
        fields[name][row] = value
    logits = _logits(seed)
    logits[row] = target_logits
    return logits, _inputs(**fields, stop_ids=[7, -1])


def test_sample_row_independent_of_batch_and_position():
    logits = _logits(4)[0]
    hist = _history([([5, 6, 7], [8, 8])])
    target = {"temperature": 1.5, "top_k": 40, "top_p": 0.95, "min_p": 0.01,
              "repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.2,
              "seeds": 1234,
              "ban_stop": True, **{k: np.asarray(v)[0] for k, v in hist.items()}}
    drawn = []
    for counter in range(8):
        picks = set()
        for row, seed in [(0, 10), (5, 11), (7, 12), (2, 13)]:
            batch_logits, inp = _batch_with(target | {"counters": counter}, logits, row, seed)
            out = _sample(batch_logits, inp, num_logprobs=K)
            picks.add((int(out.token_ids[row]), float(out.logprobs[row])))
        assert len(picks) == 1, (counter, picks)
        drawn.append(picks.pop()[0])
    assert len(set(drawn)) > 2  # the counter moves the key


def test_sample_draw_same_whether_or_not_batch_sorts():
    n = 64
    logits = _logits(9, (n, V))
    fields = {"temperature": np.linspace(0.2, 3, n), "min_p": [0.0, 0.05] * (n // 2),
              "seeds": np.arange(n), "counters": 3, "presence_penalty": 0.5,
              **_history([([1], [2, 3]) for _ in range(n)])}
    plain = _sample(logits, _inputs(n, **fields), num_logprobs=K)  # no row needs the sort
    sorting = _sample(logits, _inputs(n, **fields, top_p=[1.0] * (n - 1) + [0.5]),
                      num_logprobs=K)
    np.testing.assert_array_equal(plain.token_ids[:-1], sorting.token_ids[:-1])
    assert len(set(np.asarray(plain.token_ids).tolist())) > 10


CONFIGS = [  # temperature, top_k, top_p, min_p, presence_penalty
    (1.0, 0, 1.0, 0.0, 0.0), (0.7, 3, 1.0, 0.0, 0.0), (1.3, 0, 0.8, 0.0, 0.0),
    (1.0, 0, 1.0, 0.3, 0.0), (1.5, 4, 0.9, 0.1, 0.0), (1.0, 0, 1.0, 0.0, 2.0),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_sample_distribution_matches_filtered_softmax(config):
    temperature, top_k, top_p, min_p, presence = config
    draws = 4000
    logits = np.array([[1.0, 2.0, 0.5, -1.0, 1.5, 0.0]], np.float32)
    inp = _inputs(1, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                  presence_penalty=presence, counters=7, **_history([([], [1])]))
    draw = jax.jit(jax.vmap(lambda seed: sampler.sample(
        logits, dataclasses.replace(inp, seeds=seed[None]), num_logprobs=0).token_ids[0]))
    tokens = np.asarray(draw(jnp.arange(draws, dtype=jnp.uint32)))
    freq = np.bincount(tokens, minlength=logits.shape[1]) / draws
    expected = _np_filtered_probs(_np_penalize(logits, inp)[0], temperature, top_k, top_p, min_p)
    assert np.all(freq[expected == 0] == 0), (freq, expected)
    assert np.max(np.abs(freq - expected)) < 0.03, (freq, expected)


def _output(rows: int, k: int = K, seed: int = 5) -> sampler.SampleOutput:
    """A SampleOutput with awkward float values (infinities, -0.0, a subnormal)."""
    rng = np.random.default_rng(seed)
    logprobs = rng.normal(size=rows).astype(np.float32)
    logprobs[:4] = [-np.inf, -0.0, -1e-40, 0.0]
    proposed = rng.normal(size=rows).astype(np.float32)
    proposed[::3] = -np.inf
    top = rng.normal(size=(rows, k)).astype(np.float32)
    top[0, :1] = -np.inf
    return sampler.SampleOutput(np.arange(rows, dtype=np.int32) * 1000 + 7, logprobs,
                                np.arange(rows * k, dtype=np.int32).reshape(rows, k) * 4099,
                                top, proposed)


def _assert_bit_equal(got: sampler.SampleOutput, want: sampler.SampleOutput) -> None:
    for field in dataclasses.fields(sampler.SampleOutput):
        g, w = np.asarray(getattr(got, field.name)), np.asarray(getattr(want, field.name))
        assert g.dtype == w.dtype and g.shape == w.shape, field.name
        np.testing.assert_array_equal(g.view(np.int32), w.view(np.int32))  # bit-exact


def test_pack_unpack_round_trip():
    out = _output(S)
    packed = np.asarray(jax.jit(sampler.pack)(out))
    assert packed.shape == (S, 3 + 2 * K) and packed.dtype == np.int32
    _assert_bit_equal(sampler.unpack(packed, K), out)
    assert sampler.unpack(np.asarray(sampler.pack(dataclasses.replace(
        out, top_ids=out.top_ids[:, :0], top_logprobs=out.top_logprobs[:, :0]))),
        0).top_ids.shape == (S, 0)
    with pytest.raises(ValueError, match="packed.shape"):
        sampler.unpack(packed, K - 1)
    with pytest.raises(ValueError, match="packed.shape"):
        sampler.unpack(packed[0], K)


def test_pack_unpack_round_trip_per_position():
    """The step's i32[S, Q, 3 + 2k]: R = S * Q rows reshaped, unpacked to [S, Q] fields."""
    num_positions = 2
    out = _output(S * num_positions, seed=9)
    packed = np.asarray(sampler.pack(out)).reshape(S, num_positions, -1)
    back = sampler.unpack(packed, K)
    assert back.token_ids.shape == (S, num_positions)
    assert back.top_ids.shape == (S, num_positions, K)
    assert back.token_ids[3, 1] == out.token_ids[3 * num_positions + 1]
    want = jax.tree.map(lambda x: np.reshape(x, (S, num_positions) + x.shape[1:]), out)
    _assert_bit_equal(back, want)


def test_sample_proposed_logprobs_are_raw_log_softmax():
    logits = _logits(10)
    proposed = np.array([3, -1, 0, V - 1, 17, -1, 40, 2], np.int32)
    inp = _inputs(temperature=[0, 1, 0.5, 0, 2, 0, 1, 0], seeds=np.arange(S),
                  presence_penalty=1.5, **_history([([1, 2], [3, 3]) for _ in range(S)]))
    out = _sample(logits, inp, num_logprobs=K, proposed_ids=proposed)
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    has = proposed >= 0
    np.testing.assert_allclose(np.asarray(out.proposed_logprobs)[has],
                               raw[np.arange(S), proposed][has], rtol=1e-6)
    assert np.isneginf(np.asarray(out.proposed_logprobs)[~has]).all()
    plain = _sample(logits, inp, num_logprobs=K)  # no proposals: the same tokens, all -inf
    np.testing.assert_array_equal(plain.token_ids, out.token_ids)
    assert np.isneginf(np.asarray(plain.proposed_logprobs)).all()


def test_sample_logprobs_are_raw_log_softmax():
    logits = _logits(6)
    inp = _inputs(temperature=[0, 0.5, 1, 2, 0, 1, 1, 0.1], top_k=[0, 5, 0, 0, 0, 3, 0, 0],
                  logprobs=[0, 1, 0, 0, 0, 0, 0, 0],
                  seeds=np.arange(S), repetition_penalty=1.7, presence_penalty=0.8,
                  frequency_penalty=0.3, ban_stop=True, stop_ids=[0, 1],
                  **_history([([2, 3, 4], [5, 5, 6]) for _ in range(S)]))
    out = _sample(logits, inp, num_logprobs=K)
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    tokens = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(S), tokens], rtol=1e-6)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-raw, axis=-1)[:, :K])
    np.testing.assert_allclose(out.top_logprobs, np.sort(raw, axis=-1)[:, ::-1][:, :K],
                               rtol=1e-6)


def test_penalize_no_penalty_branch_equals_neutral_penalty_branch():
    logits = _logits(7)
    fields = {"temperature": [0, 1, 0.5, 0, 2, 1, 0, 0.8], "seeds": np.arange(S),
              "top_p": 0.9, **_history([([1, 2, 3], [4, 4]) for _ in range(S)])}
    neutral = _inputs(**fields)
    branch = jax.jit(sampler._apply_penalties)(logits, neutral)
    np.testing.assert_array_equal(branch, logits)
    np.testing.assert_array_equal(_penalize(logits, neutral), logits)  # the cond's skip branch
    # The last row's penalty forces the count branch; the other rows must not change.
    penalized = _inputs(**fields, frequency_penalty=[0] * (S - 1) + [0.5])
    skip, count = (_sample(logits, inp, num_logprobs=K) for inp in (neutral, penalized))
    for name in ("token_ids", "logprobs", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(skip, name)[:-1], getattr(count, name)[:-1])


def test_sample_skips_top_logprobs_when_no_row_asks():
    logits = _logits(8)
    out = _sample(logits, _inputs(), num_logprobs=K)
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_array_equal(out.token_ids, raw.argmax(axis=-1))
    np.testing.assert_allclose(out.logprobs, raw.max(axis=-1), rtol=1e-6)
    assert (np.asarray(out.top_ids) == -1).all()
    assert np.isneginf(np.asarray(out.top_logprobs)).all()


def test_first_argmax_matches_argmax_with_ties():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, size=(64, 257)).astype(np.float32)  # many ties
    x[5] = -np.inf
    x[6, 100] = np.inf
    np.testing.assert_array_equal(np.asarray(sampler.first_argmax(jnp.asarray(x))),
                                  x.argmax(axis=-1))


# Every positive temperature the API accepts, down past float32's smallest normal
# (1.2e-38) to its smallest subnormal; the device sees them as float32.
TINY_TEMPERATURES = [1e-4, 1e-5, 1e-8, 1e-9, 1e-10, 1e-15, 1e-20, 1e-30, 1e-37, 1e-38,
                     1e-40, 1e-45]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("filters", [{}, {"top_k": 50, "top_p": 0.9, "min_p": 0.05}])
def test_sample_tiny_temperatures_pick_the_top_token(dtype, filters):
    """A vocab-sized row with one clear maximum: every tiny temperature samples it, with
    or without filters, from float32 and bfloat16 logits (the row's dtype in a model of
    that dtype). A softmax of logits / T that rounds its maximum apart from the scaled
    row's maximum leaves no weight at all, and the draw fell to id 0."""
    n, vocab = len(TINY_TEMPERATURES), 4096
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=(n, vocab)) * 3).astype(np.float32)
    top = rng.integers(1, vocab, size=n)
    logits[np.arange(n), top] = logits.max(axis=-1) + 1.0  # one clear maximum per row
    logits = jnp.asarray(logits).astype(dtype)
    inp = _inputs(n, temperature=TINY_TEMPERATURES, seeds=np.arange(n), counters=3,
                  **filters)
    out = _sample(logits, inp, num_logprobs=K)
    np.testing.assert_array_equal(np.asarray(out.token_ids), top)
    weights = np.asarray(jax.jit(sampler.filtered_weights)(logits.astype(jnp.float32), inp))
    assert np.isfinite(weights).all()
    np.testing.assert_array_equal(weights.argmax(axis=-1), top)
    assert (weights[np.arange(n), top] > 0).all()
