"""The compiled step at Q = 2 sampled positions per request on a tiny model, against
log-softmax of the logits the forward pass gives for the same tokens."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxinfer import checkpoint, testing
from jaxinfer.engine.request import MAX_LOGPROBS, Request, SamplingParams
from jaxinfer.engine.runner import Chunk, Runner, build_metadata, sampling_inputs
from jaxinfer.engine.runner.inputs import proposed_ids
from jaxinfer.model import sampler
from jaxinfer.model import step as model_step

PAGE_SIZE, MAX_LEN, Q = 4, 32, 2


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def test_step_samples_and_scores_proposals_at_two_positions(hf_model_dirs):
    cfg = checkpoint.load_config(hf_model_dirs["llama"])
    runner = Runner(cfg, checkpoint.load_params(hf_model_dirs["llama"], cfg), num_pages=16,
                    page_size=PAGE_SIZE, max_model_len=MAX_LEN)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (6, 3, 5)]
    requests = [Request(request_id=str(i), prompt_token_ids=p, arrival=i, seed=i,
                        params=SamplingParams(temperature=0.0, logprobs=3))
                for i, p in enumerate(prompts)]
    # Slot 0 verifies its last prompt token (sampled at positions 4 and 5), slot 1 samples
    # once, slot 2 is a prefill chunk that samples nothing; slot 3 is padding.
    chunks = [Chunk(prompts[0], 0, [1, 2], num_samples=2), Chunk(prompts[1], 0, [3]),
              Chunk(prompts[2], 0, [4, 5], num_samples=0)]
    token_ids, md = build_metadata(chunks, page_size=PAGE_SIZE, pages_per_seq=MAX_LEN // 4,
                                   num_tokens=16, num_slots=4, num_positions=Q)
    rows = testing.sample_rows(requests, chunks, num_positions=Q)
    inputs = model_step.StepInputs(
        token_ids=token_ids, md=md,
        sampling=sampling_inputs(rows, num_rows=4 * Q, history_width=MAX_LEN,
                                 eos_token_ids=frozenset()),
        proposed_ids=proposed_ids(chunks, num_slots=4, num_positions=Q))
    assert inputs.proposed_ids.tolist() == [[prompts[0][5], -1]] + [[-1, -1]] * 3
    step = functools.partial(model_step.step, cfg=cfg, num_logprobs=MAX_LOGPROBS)
    _, packed = jax.jit(step)(runner.params, runner.kv_cache, inputs)
    assert packed.shape == (4, Q, 3 + 2 * MAX_LOGPROBS) and packed.dtype == np.int32
    out = sampler.unpack(np.asarray(packed), MAX_LOGPROBS)

    # f[14, V]: every token's next-token logprobs
    raw = _log_softmax(testing.logits(runner, chunks))
    sampled = [(0, 0, 4), (0, 1, 5), (1, 0, 8)]  # (slot, position, token row in the batch)
    for slot, q, row in sampled:
        assert out.token_ids[slot, q] == raw[row].argmax()  # greedy
        np.testing.assert_allclose(out.logprobs[slot, q], raw[row].max(), rtol=1e-5)
        np.testing.assert_array_equal(out.top_ids[slot, q, :3], np.argsort(-raw[row])[:3])
        np.testing.assert_allclose(out.top_logprobs[slot, q, :3], np.sort(raw[row])[::-1][:3],
                                   rtol=1e-5)
    # The proposal at position 4 is the prompt's token 5: its logprob under the target.
    np.testing.assert_allclose(out.proposed_logprobs[0, 0], raw[4, prompts[0][5]], rtol=1e-5)
    assert out.proposed_logprobs[0, 0] < 0
    assert np.isneginf(out.proposed_logprobs[0, 1]) and np.isneginf(out.proposed_logprobs[1:]).all()
