"""Data for tools/train_heads.py: prompts, the target's own continuations, its features,
and the drafter's unrolled chains that training and the held-out acceptance share.

The heads learn the target's behaviour, so every sequence here is run through the target
once: its features (the residual streams the heads read, `ModelOptions.feature_layers`)
are kept in host memory in bfloat16, and its next-token distribution at each position as
its `TEACHER_TOP` likeliest ids and their probabilities (the soft labels).

Sequences are `prompt_tokens + output_tokens` long and come from the TRAINING files of
the corpus (jaxinfer/text/corpus.py), never the held-out ones:
- self-distillation: prompts ending with a `def` line, as benchmarks/bench_spec.py builds
  its workload, continued by the target through the engine (`jaxinfer.LLM`), greedy and
  sampled;
- plain windows of the training files (the corpus's own text as the prefix).
The held-out prompts are bench_spec's exactly (`def_prompts` on the held-out files).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from jaxinfer import LLM, SamplingParams, checkpoint
from jaxinfer.config import ModelConfig, ModelOptions
from jaxinfer.config.heads import HeadConfig
from jaxinfer.config.model import FINAL_NORMED
from jaxinfer.model import eagle, layers, medusa, transformer
from jaxinfer.model.attention import project_qkv

DEF_LINE = re.compile(r"^[ \t]*def [^\n]*:\n", re.MULTILINE)  # bench_spec.prompts' rule
BENCH_PER_FILE = 2  # bench_spec.PER_FILE
TEACHER_TOP = 32  # the target's likeliest next tokens kept as soft labels per position


@dataclasses.dataclass
class Features:
    """Sequences i32[N, T], the target's features bf16[N, T, len(layers) * D] and its
    next-token distribution at each position as its `TEACHER_TOP` likeliest ids
    i32[N, T, K] and their probabilities f32[N, T, K] (the soft labels)."""

    tokens: np.ndarray
    features: np.ndarray
    layers: tuple[int, ...]
    hidden_size: int
    teacher_ids: np.ndarray
    teacher_probs: np.ndarray

    def columns(self, layers: tuple[int, ...]) -> np.ndarray:
        """Column indices of `layers`' features in `features`, in that order."""
        d = self.hidden_size
        return np.concatenate([np.arange(d) + d * self.layers.index(i) for i in layers])


def load_tokenizer(model_dir: str) -> Tokenizer:
    """The checkpoint's tokenizer.json (the `tokenizers` object: batch encoding)."""
    return Tokenizer.from_file(str(pathlib.Path(model_dir) / "tokenizer.json"))


def load_target(model_dir: str, dtype: str = "bfloat16") -> tuple[ModelConfig, dict]:
    """The target's config and params."""
    cfg = checkpoint.load_config(model_dir)
    return cfg, checkpoint.load_params(model_dir, cfg, dtype)


def def_prompts(tokenizer: Tokenizer, texts: list[str], prompt_tokens: int, count: int,
                per_file: int = BENCH_PER_FILE) -> list[list[int]]:
    """benchmarks/bench_spec.py's `prompts` on `texts`: the `prompt_tokens` tokens ending
    with a `def ...:` line, at most `per_file` per file, files and defs in order."""
    out = []
    for text in texts:
        taken = 0
        for match in DEF_LINE.finditer(text):
            window = text[max(0, match.end() - 8 * prompt_tokens):match.end()]
            ids = tokenizer.encode(window, add_special_tokens=False).ids
            if len(ids) >= prompt_tokens:
                out.append(ids[-prompt_tokens:])
                taken += 1
            if len(out) == count:
                return out
            if taken == per_file:
                break
    raise ValueError(f"the files give only {len(out)} prompts of {prompt_tokens} tokens")


def sampled_def_prompts(tokenizer: Tokenizer, texts: list[str], prompt_tokens: int,
                        count: int, seed: int) -> list[list[int]]:
    """`count` prompts by bench_spec's rule (tokens ending with a `def` line) at defs
    drawn at random from all of `texts`, not the first ones of each file."""
    ends = [(i, m.end()) for i, text in enumerate(texts) for m in DEF_LINE.finditer(text)]
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(ends))
    out: list[list[int]] = []
    for start in range(0, len(order), 4 * count):
        windows = [texts[i][max(0, end - 8 * prompt_tokens):end]
                   for i, end in (ends[j] for j in order[start:start + 4 * count])]
        for ids in tokenizer.encode_batch(windows, add_special_tokens=False):
            if len(ids.ids) >= prompt_tokens:
                out.append(ids.ids[-prompt_tokens:])
            if len(out) == count:
                return out
    raise ValueError(f"the files give only {len(out)} prompts of {prompt_tokens} tokens")


def corpus_windows(tokenizer: Tokenizer, texts: list[str], length: int, count: int,
                   seed: int) -> np.ndarray:
    """i32[count, length]: windows of `texts` starting at random line starts (files drawn
    in proportion to their length)."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray([len(t) for t in texts], np.float64)
    out: list[list[int]] = []
    while len(out) < count:
        picks = rng.choice(len(texts), size=2 * count, p=sizes / sizes.sum())
        windows = []
        for i in picks:
            text = texts[i]
            start = text.rfind("\n", 0, int(rng.integers(0, len(text)))) + 1
            windows.append(text[start:start + 8 * length])
        for enc in tokenizer.encode_batch(windows, add_special_tokens=False):
            if len(enc.ids) >= length and len(out) < count:
                out.append(enc.ids[:length])
    return np.asarray(out, np.int32)


def make_llm(model_dir: str, batch: int = 64) -> LLM:
    """The target served by the engine in bfloat16, as bench_spec runs it."""
    return LLM(model_dir, max_num_seqs=batch, max_num_batched_tokens=max(512, 4 * batch),
               dtype="bfloat16", warm_up=False)


def continue_prompts(llm: LLM, prompts: list[list[int]], output_tokens: int,
                     temperature: float, seed: int) -> np.ndarray:
    """i32[N, prompt + output]: each prompt and the target's continuation by the engine,
    greedy or sampled (`seed + i` per prompt), `ignore_eos` as bench_spec."""
    if not prompts:
        return np.zeros((0, output_tokens), np.int32)
    params = [SamplingParams(max_tokens=output_tokens, temperature=temperature,
                             ignore_eos=True, seed=seed + i if temperature else None)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return np.asarray([list(p) + list(o.token_ids)
                       for p, o in zip(prompts, outs, strict=True)], np.int32)


def extract(cfg: ModelConfig, params: dict, tokens: np.ndarray,
            feature_layers: tuple[int, ...], batch: int = 16) -> Features:
    """The target's features at `feature_layers` and top-`TEACHER_TOP` distribution at
    every position of every sequence (bfloat16 weights, as the engine serves it), on
    the host."""
    options = ModelOptions(feature_layers=tuple(feature_layers))

    def run(p: dict, x: jax.Array) -> tuple[jax.Array, ...]:
        logits, features = transformer.forward_dense(p, x, cfg=cfg, options=options,
                                                      with_features=True)
        probs, ids = jax.lax.top_k(jax.nn.softmax(logits), TEACHER_TOP)
        return features.astype(jnp.bfloat16), ids, probs

    fn = jax.jit(run)
    n, t = tokens.shape
    out = (np.empty((n, t, options.feature_size(cfg)), jnp.bfloat16),
           np.empty((n, t, TEACHER_TOP), np.int32), np.empty((n, t, TEACHER_TOP), np.float32))
    pad = (-n) % batch
    padded = np.concatenate([tokens, np.zeros((pad, t), np.int32)]) if pad else tokens
    for start in range(0, n, batch):
        for array, chunk in zip(out, fn(params, padded[start:start + batch]), strict=True):
            array[start:start + batch] = np.asarray(chunk)[:min(batch, n - start)]
    return Features(tokens, out[0], options.feature_layers, cfg.hidden_size, *out[1:])


def target_logits(shared: dict, final_normed: jax.Array) -> jax.Array:
    """The target's logits f32[..., V] from its final-normed hidden state (what its LM
    head reads: FINAL_NORMED among the features), in bfloat16 as the engine serves it;
    `shared`: {"embed": [V, D]} and "lm_head" [D, V] when the target has one."""
    x = final_normed.astype(jnp.bfloat16)
    if "lm_head" in shared:
        return jnp.matmul(x, shared["lm_head"].astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)
    table = shared["embed"].astype(jnp.bfloat16)
    return jnp.einsum("...d,vd->...v", x, table, preferred_element_type=jnp.float32)


def union_layers(*groups: tuple[int, ...]) -> tuple[int, ...]:
    """Every feature layer the heads read, FINAL_NORMED (the soft labels' source) last."""
    layers = sorted({i for g in groups for i in g if i != FINAL_NORMED})
    return (*layers, FINAL_NORMED)


# --- the drafter's chains (training-time test and held-out acceptance) ----------------

def shift(x: jax.Array, by: int) -> jax.Array:
    """x[:, t - by] at row t (zeros above): along the time axis 1."""
    if by == 0:
        return x
    return jnp.pad(x, ((0, 0), (by, 0)) + ((0, 0),) * (x.ndim - 2))[:, :x.shape[1]]


def chain_attention(q: jax.Array, keys: list, values: list, scale: float) -> jax.Array:
    """Attention of step j = len(keys) at every row t: the prefix keys of step 1 at
    s <= t - j + 1 (the target's features) and, for steps i = 2..j, the chain's own key
    at row t - (j - i). q f32[B, T, N, H]; keys/values f32[B, T, G, H] -> f32[B, T, N*H]."""
    b, t, n, h = q.shape
    g, j = keys[0].shape[2], len(keys)
    qg = q.reshape(b, t, g, n // g, h)
    prefix = jnp.einsum("btgrh,bsgh->btgrs", qg, keys[0]) * scale
    allowed = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None] - (j - 1)
    prefix = jnp.where(allowed[None, :, None, None, :], prefix, -jnp.inf)
    own = [jnp.einsum("btgrh,btgh->btgr", qg, shift(k, j - i))[..., None] * scale
           for i, k in enumerate(keys[1:], start=2)]
    probs = jax.nn.softmax(jnp.concatenate([prefix, *own], -1), -1)
    out = jnp.einsum("btgrs,bsgh->btgrh", probs[..., :t], values[0])
    for i, v in enumerate(values[1:], start=2):
        out = out + probs[..., t + i - 2, None] * shift(v, j - i)[:, :, :, None, :]
    return out.reshape(b, t, n * h)


def unrolled_hiddens(params: dict, shared: dict, tokens: jax.Array, features: jax.Array,
                     *, cfg: HeadConfig, steps: int) -> list[jax.Array]:
    """The drafter's hidden f32[B, T, D] of each drafting step j = 1..steps at every row
    t: row t of step j is the j-th draft of the chain that starts from the target's
    feature at t - j + 1, fed tokens[t] (the token at t + 1, teacher-forced) and
    predicting the token at t + 2. Step 1 is `eagle.forward_dense`."""
    layer, lcfg = params["layer"], cfg.layer
    rope = layers.rope_tables(jnp.arange(tokens.shape[1]), layers.rope_inv_freq(lcfg),
                              layers.rope_scale(lcfg))
    keys, values, hiddens = [], [], []
    for j in range(steps):
        inputs = features if j == 0 else shift(hiddens[-1], 1)
        x, residual = eagle._layer_input(params, shared, tokens, inputs, cfg, j == 0)
        q, k, v = project_qkv(layer, x, lcfg, rope)
        keys.append(k)
        values.append(v)
        attn = chain_attention(q, keys, values, lcfg.attention_scale())
        attn = layers.linear(attn, layer["wo"])
        hiddens.append(eagle._finish(layer, attn, residual, cfg))
    return hiddens


def chain_drafts(head: HeadConfig, params: dict, shared: dict, tokens: jax.Array,
                 feats: jax.Array, final: jax.Array, *, k: int, temperature: float
                 ) -> tuple[jax.Array, jax.Array]:
    """Per chain c (the drafts made after the token at c + 1, from the target's feature
    at c) and step j < k: the greedy draft (a target id) and sum_x min(p, q) at
    `temperature`, p the target's distribution there, q the head's; i32/f32[B, T-1, k]."""
    b, t = tokens.shape[0], tokens.shape[1] - 1
    vocab = head.vocab_size
    if head.method == "medusa":
        d = final.shape[-1]
        rows = medusa.head_logits(params, final[:, :-1].reshape(-1, d), cfg=head,
                                  vocab_size=vocab).reshape(b, t, head.num_heads, vocab)
        students = [rows[:, :, j] for j in range(k)]
    else:
        hiddens = unrolled_hiddens(params, shared, tokens[:, 1:], feats[:, :-1], cfg=head,
                                   steps=k)
        students = [shift_up(eagle.logits(params, shared, h.reshape(b * t, -1), cfg=head,
                                          vocab_size=vocab).reshape(b, t, vocab), j)
                    for j, h in enumerate(hiddens)]
    teacher = target_logits(shared, final)
    drafts, alphas = [], []
    for j, student in enumerate(students):
        p = jax.nn.softmax(shift_up(teacher[:, 1:], j) / temperature)
        q = jax.nn.softmax(student / temperature)
        drafts.append(jnp.argmax(student, -1))
        alphas.append(jnp.sum(jnp.minimum(p, q), -1))
    return jnp.stack(drafts, -1), jnp.stack(alphas, -1)


def shift_up(x: jax.Array, by: int) -> jax.Array:
    """x[:, t + by] at row t (zeros past the end)."""
    return jnp.pad(x[:, by:], ((0, 0), (0, by)) + ((0, 0),) * (x.ndim - 2))


def simulate(tokens: np.ndarray, drafts: np.ndarray, alphas: np.ndarray | None,
             start: int, k: int, seed: int) -> dict:
    """Speculative decoding over each sequence's continuation from position `start` (its
    first generated token): a verify step after the token at p drafts min(k, left)
    tokens, the chain of row c = p - 1; greedy (alphas None) accepts drafts equal to
    the sequence's tokens until the first mismatch, sampled accepts draft j with
    probability alphas[c, j] until the first rejection; then p += accepted + 1."""
    rng = np.random.default_rng(seed)
    drafted = accepted = verify_steps = 0
    for n in range(len(tokens)):
        p, end = start, tokens.shape[1] - 1
        while p < end:
            count, c, a = min(k, end - p), p - 1, 0
            while a < count:
                ok = (drafts[n, c, a] == tokens[n, p + 1 + a] if alphas is None
                      else rng.random() < alphas[n, c, a])
                if not ok:
                    break
                a += 1
            drafted, accepted, verify_steps = drafted + count, accepted + a, verify_steps + 1
            p += a + 1
    return {"acceptance_rate": round(accepted / max(drafted, 1), 4),
            "mean_acceptance_length": round(1 + accepted / max(verify_steps, 1), 3),
            "verify_steps": verify_steps}
