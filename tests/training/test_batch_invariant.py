"""batch_invariant=True: the engine's sampled-token logprobs equal sequence_logprobs'
bitwise, and a request's tokens do not depend on its batch. docs/rl.md#batch-invariant-mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, testing
from jaxinfer.training import llm_sequence_logprobs, sampled_sequences, sequence_logprobs

PROMPTS = ["hello there", "a longer prompt than that one, past one chunk of tokens", "x",
           "abc abc abc"]


def engine(model_dir, dtype="float32", **kw):
    # 16 tokens a step: the longer prompts are prefilled in chunks beside decodes
    return LLM(model=model_dir, dtype=dtype, page_size=8, max_model_len=96,
               max_num_seqs=4, max_num_batched_tokens=16, batch_invariant=True,
               compilation_cache_dir="", **kw)


def sampled(llm, prompts):
    return sampled_sequences(llm.generate(prompts, SamplingParams(
        max_tokens=12, temperature=1.0, seed=3, logprobs=0)))


@pytest.mark.parametrize(("family", "dtype"), [("llama", "float32"), ("llama", "bfloat16"),
                                               ("gemma2", "float32")])
def test_engine_logprobs_equal_bitwise(hf_model_dirs, family, dtype):
    llm = engine(hf_model_dirs[family], dtype)
    for batch in (1, 4):
        seqs, got, starts = sampled(llm, PROMPTS[:batch])
        ours = llm_sequence_logprobs(llm, seqs)
        for e, o, s in zip(got, ours, starts, strict=True):
            np.testing.assert_array_equal(np.asarray(o[s:], np.float32),
                                          np.asarray(e, np.float32))


def test_request_alone_equals_request_in_batch(hf_model_dirs):
    llm = engine(hf_model_dirs["llama"])
    alone = sampled(llm, PROMPTS[1:2])
    batched = sampled(llm, PROMPTS)
    assert batched[0][1] == alone[0][0]  # the same tokens
    assert batched[1][1] == alone[1][0]  # the same logprobs, to the bit


def test_gradient_flows(hf_model_dirs):
    llm = engine(hf_model_dirs["llama"])
    params, cfg = llm.llm_engine.runner.params, llm.llm_engine.model_config
    ids = jnp.asarray([[5, 9, 12, 40, 7, 3]], jnp.int32)
    grads = jax.grad(lambda p: sequence_logprobs(p, ids, cfg=cfg,
                                                 batch_invariant=True).sum())(params)
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert any(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_refusals(hf_model_dirs):
    with pytest.raises(ValueError, match="batch_invariant"):
        engine(hf_model_dirs[testing.MOE_FAMILIES[0]])
    with pytest.raises(ValueError, match="batch_invariant.*tensor_parallel_size=2"):
        engine(hf_model_dirs["llama"], tensor_parallel_size=2)
