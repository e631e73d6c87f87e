"""EAGLE-1/2 and EAGLE-3 heads: logits equal an independent torch forward of the
published layout (weights read by their published names from the saved file), the
paged path equals the dense one, and `propose` drafts what chaining the dense forward
drafts."""

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
from jaxinfer.engine.runner.inputs import Chunk, build_metadata, sampling_inputs
from jaxinfer.model import draft, eagle, transformer
from jaxinfer.model.attention import init_kv_cache

VOCAB, PAGE_SIZE, PAGES_PER_SEQ, NUM_PAGES = 80, 4, 8, 24
TARGET = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=6,
                     num_heads=4, num_kv_heads=2, head_dim=8)
TOL = 1e-4
EAGLE3_CASES = {
    "default": {"draft_vocab_size": 40},
    "narrow-nbr-own-embed": {"hidden_size": 16, "target_hidden_size": 32, "head_dim": 4,
                             "num_key_value_heads": 1, "norm_before_residual": True,
                             "draft_vocab_size": 50, "rope_theta": 500.0,
                             "eagle_aux_hidden_state_layer_ids": [0, 3, 6]},
}


# ---- an independent torch forward of the published layouts (float64) ----

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.cat([pos[:, None] * inv] * 2, -1)[:, None, :]
    rotated = torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1)
    return x * angles.cos() + rotated * angles.sin()


class TorchHead:
    """A head read from model.safetensors by published names; `step` runs new rows at
    `pos` attending to every row run before (a KV cache of plain tensors)."""

    def __init__(self, path, hf, method):
        self.w = {n: t.double() for n, t in
                  safetensors.torch.load_file(str(path / "model.safetensors")).items()}
        self.hf, self.method = hf, method
        self.prefix = "midlayer." if method == "eagle3" else "layers.0."
        self.keys = self.values = self.positions = None

    def _attend(self, x, pos):
        p, hf = self.prefix + "self_attn.", self.hf
        heads, groups = hf["num_attention_heads"], hf["num_key_value_heads"]
        dim = hf.get("head_dim") or hf["hidden_size"] // heads
        theta = hf.get("rope_theta", 10000.0)
        q = _rope((x @ self.w[p + "q_proj.weight"].T).view(len(pos), heads, dim), pos, theta)
        k = _rope((x @ self.w[p + "k_proj.weight"].T).view(len(pos), groups, dim), pos, theta)
        v = (x @ self.w[p + "v_proj.weight"].T).view(len(pos), groups, dim)
        if self.keys is not None:
            k, v = torch.cat([self.keys, k]), torch.cat([self.values, v])
            pos_all = torch.cat([self.positions, pos])
        else:
            pos_all = pos
        self.keys, self.values, self.positions = k, v, pos_all
        k, v = (t.repeat_interleave(heads // groups, dim=1) for t in (k, v))
        scores = torch.einsum("tnh,snh->nts", q, k) * dim ** -0.5
        scores = scores.masked_fill(pos_all[None, None, :] > pos[None, :, None], -torch.inf)
        out = torch.einsum("nts,snh->tnh", scores.softmax(-1), v).reshape(len(pos), -1)
        return out @ self.w[p + "o_proj.weight"].T

    def _mlp(self, x):
        p = self.prefix + "mlp."
        gate = torch.nn.functional.silu(x @ self.w[p + "gate_proj.weight"].T)
        return (gate * (x @ self.w[p + "up_proj.weight"].T)) @ self.w[p + "down_proj.weight"].T

    def step(self, embeds, features, pos, from_target):
        """(hidden the next step feeds, the hidden the logits read)."""
        w, eps, p = self.w, self.hf["rms_norm_eps"], self.prefix
        if self.method == "eagle":  # fc(concat(embed, feature)); no input norm on layer 0
            x = torch.cat([embeds, features], -1) @ w["fc.weight"].T
            x = x + w["fc.bias"] if "fc.bias" in w else x
            residual = x
        else:
            h = features @ w["fc.weight"].T if from_target else features
            normed = _rms(h, w[p + "hidden_norm.weight"], eps)
            residual = normed if self.hf.get("norm_before_residual") else h
            x = torch.cat([_rms(embeds, w[p + "input_layernorm.weight"], eps), normed], -1)
        residual = self._attend(x, pos) + residual
        out = self._mlp(_rms(residual, w[p + "post_attention_layernorm.weight"], eps)) + residual
        return out, (out if self.method == "eagle" else _rms(out, w["norm.weight"], eps))

    def logits(self, hidden, target_head):
        if self.method == "eagle":
            return hidden @ target_head
        draft = hidden @ self.w["lm_head.weight"].T
        ids = torch.arange(draft.shape[-1]) + self.w["d2t"].long()
        out = torch.full((len(hidden), VOCAB), -torch.inf, dtype=torch.float64)
        out[:, ids] = draft
        return out


# ---- helpers ----

PROPOSE = jax.jit(eagle.propose,
                  static_argnames=("cfg", "page_size", "num_positions", "vocab_size"))
FORWARD = jax.jit(eagle.forward, static_argnames=("cfg", "from_target", "max_q_len"))
LOGITS = jax.jit(eagle.logits, static_argnames=("cfg", "vocab_size"))
DENSE = jax.jit(eagle.forward_dense, static_argnames=("cfg", "from_target"))
PREFILL = jax.jit(eagle.prefill, static_argnames=("cfg",))


def _target(tie=False):
    cfg = ModelConfig(**{**TARGET.__dict__, "tie_word_embeddings": tie})
    params = transformer.init_params(cfg, jax.random.key(11), std=0.3)
    shared = {"embed": params["embed"]}
    if not tie:
        shared["lm_head"] = params["lm_head"]
    return cfg, shared


def _saved_head(tmp_path, method, target, **config):
    head, params = heads.random_head(method, target, jax.random.key(3), **config)
    heads.save_head(tmp_path, head, params, target)
    loaded_head, loaded = heads.load_head(tmp_path, target, method=method)
    hf = heads.read_hf_config(tmp_path)
    return loaded_head, loaded, TorchHead(tmp_path, hf, method)


def _md(length, start=0, pages=(5, 2, 11, 7)):
    token_ids, md = build_metadata([Chunk([0] * length, start, list(pages))],
                                   page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ,
                                   num_tokens=length + 3, num_slots=2, all_logits=True)
    return jax.tree.map(jnp.asarray, md)


def _t(x):
    return torch.tensor(np.asarray(x, np.float64))


def _close(ours, theirs):
    ours, theirs = np.asarray(ours), theirs.numpy()
    assert np.array_equal(np.isinf(ours), np.isinf(theirs))
    finite = np.isfinite(theirs)
    assert np.abs(ours[finite] - theirs[finite]).max() < TOL


def _shared_head(shared):
    head = shared.get("lm_head", jnp.asarray(shared["embed"]).T)
    return _t(head)


# ---- parity with the torch forward ----

def _check_two_steps(head, params, shared, ref, tokens, features):
    """A catch-up over len(tokens) positions, then a drafting step fed the last
    position's hidden, each against the torch forward."""
    n = len(tokens)
    kv = init_kv_cache(head.layer, num_pages=NUM_PAGES, page_size=PAGE_SIZE)[0]
    md = _md(n)
    ids = jnp.zeros(n + 3, jnp.int32).at[:n].set(tokens)
    feats = jnp.zeros((n + 3, features.shape[-1])).at[:n].set(features)
    kv, hidden = FORWARD(params, shared, kv, ids, feats, md, cfg=head, from_target=True)
    ours = LOGITS(params, shared, hidden[:n], cfg=head, vocab_size=VOCAB)
    embed = _t(params.get("embed", shared["embed"]))
    pos = torch.arange(n, dtype=torch.float64)
    ref_hidden, ref_out = ref.step(embed[tokens], _t(features), pos, True)
    _close(ours, ref.logits(ref_out, _shared_head(shared)))
    dense = DENSE(params, shared, jnp.asarray(tokens)[None], features[None],
                                cfg=head)
    assert np.abs(np.asarray(dense[0]) - np.asarray(hidden[:n])).max() < TOL
    nxt = int(np.argmax(ours[-1]))
    md = _md(1, start=n)
    ids = jnp.zeros(4, jnp.int32).at[0].set(nxt)
    feats = jnp.zeros((4, head.hidden_size)).at[0].set(hidden[n - 1])
    kv, hidden2 = FORWARD(params, shared, kv, ids, feats, md, cfg=head,
                                from_target=False)
    ours2 = LOGITS(params, shared, hidden2[:1], cfg=head, vocab_size=VOCAB)
    _, ref_out2 = ref.step(embed[[nxt]], ref_hidden[-1:], torch.tensor([float(n)]), False)
    _close(ours2, ref.logits(ref_out2, _shared_head(shared)))


@pytest.mark.parametrize("case", list(EAGLE3_CASES))
def test_eagle3_matches_torch(tmp_path, case):
    target, shared = _target()
    head, params, ref = _saved_head(tmp_path, "eagle3", target, **EAGLE3_CASES[case])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, 11)
    features = jnp.asarray(rng.standard_normal((11, head.feature_size)), jnp.float32)
    _check_two_steps(head, params, shared, ref, tokens, features)


@pytest.mark.parametrize("tie", [False, True])
def test_eagle_matches_torch(tmp_path, tie):
    target, shared = _target(tie)
    head, params, ref = _saved_head(tmp_path, "eagle", target, bias=not tie)
    assert ("fc_bias" in params) == (not tie)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, 9)
    features = jnp.asarray(rng.standard_normal((9, 32)), jnp.float32)
    _check_two_steps(head, params, shared, ref, tokens, features)


# ---- the paged path drafts what the dense path drafts ----

def _store_and_inputs(feats, lengths, pages, last_tokens, num_steps, sampling=None):
    """The feature store (each position's feature at its KV slot) and DraftInputs."""
    store = np.zeros((NUM_PAGES * PAGE_SIZE, feats.shape[-1]), np.float32)
    table = np.zeros((2, PAGES_PER_SEQ), np.int32)
    for s, (n, slot_pages) in enumerate(zip(lengths, pages, strict=True)):
        table[s, :len(slot_pages)] = slot_pages
        for p in range(n):
            store[slot_pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE] = feats[s, p]
    inputs = draft.DraftInputs(
        token_ids=np.array([*last_tokens, 0, 0], np.int32),
        positions=np.array([n - 1 for n in lengths], np.int32), page_indices=table,
        num_seqs=np.array([2], np.int32),
        sampling=sampling or sampling_inputs([], num_rows=2, history_width=32,
                                             eos_token_ids=frozenset()),
        num_steps=np.array(num_steps, np.int32))
    return jnp.asarray(store), jax.tree.map(jnp.asarray, inputs)


def _dense_chain(head, params, shared, tokens, feats, k, forced=None):
    """(drafts, f32[k, V] logits of each) by re-running forward_dense over the growing
    sequence: target features (through fc for eagle3), then the head's own hidden
    states; each draft is the argmax, or `forced[i]` when given."""
    if head.method == "eagle3":
        feats = feats @ params["fc"]
    tokens, feats, drafts, all_logits = list(tokens), jnp.asarray(feats), [], []
    for i in range(k):
        hidden = DENSE(params, shared, jnp.asarray(tokens)[None], feats[None], cfg=head,
                       from_target=False)[0]
        logits = LOGITS(params, shared, hidden[-1:], cfg=head, vocab_size=VOCAB)[0]
        drafts.append(int(np.argmax(logits)) if forced is None else int(forced[i]))
        all_logits.append(logits)
        tokens.append(drafts[-1])
        feats = jnp.concatenate([feats, hidden[-1:]])
    return drafts, np.stack(all_logits)


def _prefilled(head, params, shared, seqs, feats, lengths, pages, k, sampling=None, first=1):
    """The head's KV after catching up over x_1 .. x_{n-first} of each slot (position p
    holds x_{p+1} with the target's feature at p), the store, and the proposal's
    arguments: its ragged first step over the last `first` positions (x_{n-first+1} ..
    x_n), then DraftInputs of x_n."""
    kv = init_kv_cache(head.layer, num_pages=NUM_PAGES, page_size=PAGE_SIZE)[0]
    store, inputs = _store_and_inputs(feats, lengths, pages,
                                      [seqs[s, n] for s, n in enumerate(lengths)], k,
                                      sampling)
    chunks = [Chunk(seqs[s, 1:n + 1 - first].tolist(), 0, list(pages[s]))
              for s, n in enumerate(lengths)]
    ids, md = build_metadata(chunks, page_size=PAGE_SIZE, pages_per_seq=PAGES_PER_SEQ,
                             num_tokens=20, num_slots=2, all_logits=True)
    kv = PREFILL(params, shared, kv, store, jnp.asarray(ids),
                 jax.tree.map(jnp.asarray, md), cfg=head)
    chunks = [Chunk(seqs[s, n + 1 - first:n + 1].tolist(), n - first, list(pages[s]), 1)
              for s, n in enumerate(lengths)]
    first_ids, first_md = build_metadata(chunks, page_size=PAGE_SIZE,
                                         pages_per_seq=PAGES_PER_SEQ, num_tokens=10,
                                         num_slots=2)
    return kv, store, (jnp.asarray(first_ids), jax.tree.map(jnp.asarray, first_md), inputs)


@pytest.mark.parametrize(("method", "first"), [("eagle3", 1), ("eagle3", 4), ("eagle", 3)])
def test_prefill_then_propose_equals_chained_dense(method, first):
    """Drafts after a catch-up call and a ragged first step over `first` positions equal
    the dense chain's over the whole sequence."""
    target, shared = _target()
    head, params = heads.random_head(method, target, jax.random.key(5), draft_vocab_size=40)
    rng = np.random.default_rng(2)
    lengths, pages, k = (10, 6), ((9, 3, 14), (4, 12, 1)), 3
    seqs = rng.integers(0, VOCAB, (2, 11))  # x_0 .. x_10 per slot
    feats = rng.standard_normal((2, 10, head.feature_size)).astype(np.float32)
    kv, store, (first_ids, first_md, inputs) = _prefilled(head, params, shared, seqs, feats,
                                                          lengths, pages, k, first=first)
    _, tokens, probs = PROPOSE(params, shared, kv, store, first_ids, first_md, inputs,
                               cfg=head, page_size=PAGE_SIZE, num_positions=5,
                               vocab_size=VOCAB)
    for s, n in enumerate(lengths):
        want, _ = _dense_chain(head, params, shared, seqs[s, 1:n + 1], feats[s, :n], k)
        assert tokens[s, :k].tolist() == want
        assert np.array_equal(probs[s, np.arange(k), want], np.ones(k))
    assert not np.asarray(tokens[:, k:]).any() and not np.asarray(probs[:, k:]).any()
    one = dataclasses.replace(inputs, num_steps=jnp.array(1, jnp.int32))
    _, fewer, fewer_probs = PROPOSE(params, shared, kv, store, first_ids, first_md, one,
                                    cfg=head, page_size=PAGE_SIZE, num_positions=5,
                                    vocab_size=VOCAB)
    assert np.array_equal(fewer[:, 0], tokens[:, 0]) and not np.asarray(fewer[:, 1:]).any()
    assert not np.asarray(fewer_probs[:, 1:]).any()


def test_random_rows_draw_from_the_heads_distribution():
    """A temperature-1 row's q at each draft is the softmax of the head's logits after
    the drafts drawn before it (zero outside the draft vocabulary), and its tokens are
    ones q allows; the greedy row beside it stays one-hot."""
    target, shared = _target()
    head, params = heads.random_head("eagle3", target, jax.random.key(6), draft_vocab_size=30)
    rng = np.random.default_rng(3)
    seqs = rng.integers(0, VOCAB, (2, 6))
    feats = rng.standard_normal((2, 5, head.feature_size)).astype(np.float32)
    sampling = sampling_inputs([], num_rows=2, history_width=32, eos_token_ids=frozenset())
    sampling = dataclasses.replace(sampling, temperature=np.array([1.0, 0.0], np.float32))
    k = 3
    kv, store, args = _prefilled(head, params, shared, seqs, feats, (5, 5), ((1, 2), (3, 4)),
                                 k, sampling)
    _, tokens, probs = PROPOSE(params, shared, kv, store, *args, cfg=head,
                               page_size=PAGE_SIZE, num_positions=4, vocab_size=VOCAB)
    drafted = np.asarray(tokens[0, :k])
    _, logits = _dense_chain(head, params, shared, seqs[0, 1:6], feats[0], k, drafted)
    q = np.asarray(probs[0, :k])
    assert np.abs(q - np.asarray(jax.nn.softmax(logits))).max() < 1e-5
    assert (q[np.arange(k), drafted] > 0).all()
    allowed = np.zeros(VOCAB, bool)
    allowed[np.arange(30) + np.asarray(params["d2t"])] = True
    assert not q[:, ~allowed].any() and (q[:, allowed] > 0).all()
    assert np.array_equal(probs[1, :k], np.eye(VOCAB)[np.asarray(tokens[1, :k])])
