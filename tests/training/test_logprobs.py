"""sequence_logprobs (jaxinfer/training): the engine's sampled-token logprobs, padding,
gradients, refusals. docs/rl.md#logprobs-that-match-the-trainers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.model import quantization
from jaxinfer.training import llm_sequence_logprobs, sampled_sequences, sequence_logprobs


@pytest.fixture(scope="module")
def llm(hf_model_dirs):
    return LLM(model=hf_model_dirs["llama"], page_size=8, max_model_len=96, max_num_seqs=4,
               max_num_batched_tokens=32, compilation_cache_dir="")


def sampled(llm, prompts):
    return sampled_sequences(llm.generate(prompts, SamplingParams(
        max_tokens=12, temperature=1.0, seed=3, logprobs=0)))


@pytest.mark.parametrize("batch", [1, 4])
def test_engine_logprobs_match(llm, batch):
    prompts = ["hello there", "a longer prompt than that one", "x", "abc abc abc"][:batch]
    seqs, engine, starts = sampled(llm, prompts)
    ours = llm_sequence_logprobs(llm, seqs)
    for e, o, s in zip(engine, ours, starts, strict=True):
        # Equal to float32 rounding: the paged step and the dense forward reduce in
        # different orders (docs/rl.md#logprobs-that-match-the-trainers).
        np.testing.assert_allclose(o[s:], e, rtol=0, atol=2e-5)


def params_cfg(llm):
    return llm.llm_engine.runner.params, llm.llm_engine.model_config


def test_padded_batch_equals_rows_alone(llm):
    params, cfg = params_cfg(llm)
    rows = [[5, 9, 12, 40, 7], [3, 8], [100, 101, 102]]
    ids = jnp.asarray([r + [0] * (5 - len(r)) for r in rows], jnp.int32)
    batch = np.asarray(sequence_logprobs(params, ids, cfg=cfg,
                                         lengths=jnp.asarray([5, 2, 3])))
    for i, r in enumerate(rows):
        alone = np.asarray(sequence_logprobs(params, jnp.asarray([r]), cfg=cfg))[0]
        np.testing.assert_allclose(batch[i, :len(r)], alone, rtol=0, atol=1e-6)
        assert np.all(batch[i, len(r) - 1:] == 0)


def test_gradient_matches_finite_difference(llm):
    params, cfg = params_cfg(llm)
    params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    ids = jnp.asarray([[5, 9, 12, 40, 7, 3]], jnp.int32)

    def loss(scale):
        scaled = dict(params, final_norm=params["final_norm"] * scale)
        return sequence_logprobs(scaled, ids, cfg=cfg).sum()

    loss = jax.jit(loss)
    grad = float(jax.grad(loss)(1.0))
    eps = 1e-2
    finite = (float(loss(1.0 + eps)) - float(loss(1.0 - eps))) / (2 * eps)
    assert np.isfinite(grad) and grad != 0
    assert abs(grad - finite) < 1e-2 * max(1.0, abs(finite))
    full = jax.grad(lambda p: sequence_logprobs(p, ids, cfg=cfg).sum())(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(full))


def test_refusals(llm):
    params, cfg = params_cfg(llm)
    with pytest.raises(ValueError, match="vocab|token ids"):
        sequence_logprobs(params, jnp.asarray([[1, cfg.vocab_size]]), cfg=cfg)
    with pytest.raises(ValueError, match="B, T"):
        sequence_logprobs(params, jnp.asarray([1, 2]), cfg=cfg)
    layer = dict(params["layers"][0])
    name = next(k for k, v in layer.items() if getattr(v, "ndim", 0) == 2)
    layer[name] = quantization.quantize(layer[name].astype(jnp.float32), "int8")
    quantized = dict(params, layers=[layer, *params["layers"][1:]])
    with pytest.raises(ValueError, match="quantized"):
        sequence_logprobs(quantized, jnp.asarray([[1, 2]]), cfg=cfg)
