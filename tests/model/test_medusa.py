"""Medusa heads: every head's logits equal an independent torch forward of vLLM's
layout (weights read by their published names from the saved file), and `propose`
draws head h at draft position h from the feature of the position before the last
token."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch

from jaxinfer.checkpoint import heads
from jaxinfer.config import ModelConfig
from jaxinfer.engine.runner.inputs import sampling_inputs
from jaxinfer.model import draft, medusa

VOCAB, PAGE_SIZE, NUM_PAGES = 72, 4, 8
TARGET = ModelConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=48, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=12)
CASES = {
    "bias-2-blocks": {"medusa_fc_bias": True, "num_hidden_layers": 2, "num_heads": 4},
    "truncated-shared-head": {"truncated_vocab_size": 30, "original_lm_head": True},
}
HEAD_LOGITS = jax.jit(medusa.head_logits, static_argnames=("cfg", "vocab_size"))
PROPOSE = jax.jit(medusa.propose,
                  static_argnames=("cfg", "page_size", "num_positions", "vocab_size"))


def _torch_logits(path, hf, features):
    """vLLM's Medusa: per head, blocks x + SiLU(W x + b), then its LM head (one shared
    with original_lm_head), scattered through token_map when truncated (float64)."""
    w = {n: t.double() for n, t in
         safetensors.torch.load_file(str(path / "model.safetensors")).items()}
    out = []
    for h in range(hf["num_heads"]):
        x = torch.tensor(features, dtype=torch.float64)
        for j in range(hf["num_hidden_layers"]):
            y = x @ w[f"blocks.{h}.layers.{j}.weight"].T
            y = y + w[f"blocks.{h}.layers.{j}.bias"] if hf.get("medusa_fc_bias") else y
            x = x + torch.nn.functional.silu(y)
        lm = w[f"lm_heads.{0 if hf.get('original_lm_head') else h}.weight"]
        logits = x @ lm.T
        if "token_map" in w:
            full = torch.full((len(x), VOCAB), -torch.inf, dtype=torch.float64)
            full[:, w["token_map"].long()] = logits
            logits = full
        out.append(logits)
    return torch.stack(out, 1).numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_head_logits_match_torch(tmp_path, case):
    head, params = heads.random_head("medusa", TARGET, jax.random.key(1), **CASES[case])
    heads.save_medusa(tmp_path, head, params, TARGET)
    head, params = heads.load_head(tmp_path, TARGET)
    hf = heads.read_hf_config(tmp_path)
    features = np.random.default_rng(0).standard_normal((5, 24)).astype(np.float32)
    ours = np.asarray(HEAD_LOGITS(params, jnp.asarray(features), cfg=head, vocab_size=VOCAB))
    theirs = _torch_logits(tmp_path, hf, features)
    assert ours.shape == (5, head.num_heads, VOCAB)
    assert np.array_equal(np.isinf(ours), np.isinf(theirs))
    finite = np.isfinite(theirs)
    assert np.abs(ours[finite] - theirs[finite]).max() < 1e-4
    one_row = HEAD_LOGITS(params, jnp.asarray(features[:1]), cfg=head, vocab_size=VOCAB - 2)
    assert np.array_equal(one_row, ours[:1, :, :VOCAB - 2])  # a target with fewer ids


def _inputs(positions, num_steps, sampling=None):
    table = np.array([[3, 5], [6, 1]], np.int32)  # slot 0's pages, slot 1's
    return jax.tree.map(jnp.asarray, draft.DraftInputs(
        token_ids=np.array([11, 12, 0], np.int32), positions=np.array(positions, np.int32),
        page_indices=table, num_seqs=np.array([2], np.int32),
        sampling=sampling or sampling_inputs([], num_rows=2, history_width=16,
                                             eos_token_ids=frozenset()),
        num_steps=np.array(num_steps, np.int32))), table


def test_propose_draws_head_h_at_position_h_from_the_previous_positions_feature():
    head, params = heads.random_head("medusa", TARGET, jax.random.key(2), num_heads=3,
                                     medusa_fc_bias=True)
    rng = np.random.default_rng(1)
    store = rng.standard_normal((NUM_PAGES * PAGE_SIZE, 24)).astype(np.float32)
    inputs, table = _inputs([5, 2], 3)
    tokens, probs = PROPOSE(params, jnp.asarray(store), inputs, cfg=head,
                            page_size=PAGE_SIZE, num_positions=4, vocab_size=VOCAB)
    slots = [table[0, 5 // PAGE_SIZE] * PAGE_SIZE + 5 % PAGE_SIZE, table[1, 0] * PAGE_SIZE + 2]
    want = np.asarray(HEAD_LOGITS(params, jnp.asarray(store[slots]), cfg=head,
                                  vocab_size=VOCAB)).argmax(-1)
    assert np.array_equal(tokens[:, :3], want) and not np.asarray(tokens[:, 3]).any()
    assert np.array_equal(probs[:, :3], np.eye(VOCAB)[want]) and not np.asarray(
        probs[:, 3]).any()
    fewer, fewer_probs = PROPOSE(params, jnp.asarray(store), _inputs([5, 2], 1)[0], cfg=head,
                                 page_size=PAGE_SIZE, num_positions=4, vocab_size=VOCAB)
    assert np.array_equal(fewer[:, 0], want[:, 0]) and not np.asarray(fewer[:, 1:]).any()
    assert not np.asarray(fewer_probs[:, 1:]).any()


def test_penalties_see_the_earlier_drafts():
    """A huge repetition penalty on a greedy row: no head re-proposes an earlier draft,
    as each draw has the drafts before it in the history."""
    head, params = heads.random_head("medusa", TARGET, jax.random.key(3), num_heads=4)
    features = np.zeros((NUM_PAGES * PAGE_SIZE, 24), np.float32)
    features[:] = np.random.default_rng(2).standard_normal(24)  # every head, one input
    params = dict(params, blocks_w=jnp.zeros_like(params["blocks_w"]),  # blocks: identity
                  lm_heads=jnp.broadcast_to(params["lm_heads"][:1], params["lm_heads"].shape))
    sampling = sampling_inputs([], num_rows=2, history_width=16, eos_token_ids=frozenset())
    plain, _ = PROPOSE(params, jnp.asarray(features), _inputs([1, 1], 4)[0], cfg=head,
                       page_size=PAGE_SIZE, num_positions=5, vocab_size=VOCAB)
    sampling = dataclasses.replace(sampling, repetition_penalty=np.full(2, 1e6, np.float32))
    penalized, _ = PROPOSE(params, jnp.asarray(features), _inputs([1, 1], 4, sampling)[0],
                           cfg=head, page_size=PAGE_SIZE, num_positions=5, vocab_size=VOCAB)
    assert len(set(np.asarray(plain[0, :4]).tolist())) == 1  # the heads agree without it
    assert len(set(np.asarray(penalized[0, :4]).tolist())) == 4
