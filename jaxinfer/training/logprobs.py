"""Per-token logprobs of whole sequences from params, on the engine's dense forward
(model/transformer.py `forward_dense`, no paging), for a trainer's loss. The logprob is
the engine's raw one: logits - logsumexp(logits) in float32, before temperature or
penalties. See docs/rl.md#logprobs-that-match-the-trainers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig, ModelOptions
from jaxinfer.model import invariance, transformer
from jaxinfer.model.quantization import QuantizedWeight


def sequence_logprobs(params: dict, token_ids: jax.Array, *, cfg: ModelConfig,
                      lengths: jax.Array | None = None, batch_invariant: bool = False
                      ) -> jax.Array:
    """f32[B, T]: out[b, t] is the logprob of token_ids[b, t + 1] given token_ids[b, :t + 1]
    (the last column, and every column at or past lengths[b] - 1, is 0).

    `token_ids` i32[B, T], right-padded; `lengths` i32[B] the real tokens of each row
    (None: all T). Attention is causal, so the padding after a row never reaches its
    real tokens. Pure over the params pytree: jax.jit and jax.grad apply.
    `batch_invariant`: rounded as an engine with `batch_invariant=True` rounds, so equal
    to its logprobs bitwise on CPU (docs/rl.md#batch-invariant-mode)."""
    check_params(params)
    token_ids = jnp.asarray(token_ids)
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids must be i32[B, T], got shape {token_ids.shape}")
    check_ids(token_ids, cfg)
    batch, steps = token_ids.shape
    lengths = (jnp.full((batch,), steps, jnp.int32) if lengths is None
               else jnp.asarray(lengths, jnp.int32))
    logits = transformer.forward_dense(params, token_ids, cfg=cfg,  # f32[B, T, V]
                                       options=ModelOptions(batch_invariant=batch_invariant))
    return _token_logprobs(logits, token_ids, lengths, batch_invariant)


def _token_logprobs(logits: jax.Array, token_ids: jax.Array, lengths: jax.Array,
                    batch_invariant: bool = False) -> jax.Array:
    """The engine's sampler arithmetic (model/sampler.py `describe`): logits of the next
    token minus logsumexp of the float32 row, masked to each row's real next tokens."""
    logits = logits[:, :-1].astype(jnp.float32)
    log_total = (invariance.logsumexp(logits) if batch_invariant
                 else jax.nn.logsumexp(logits, axis=-1))
    nxt = token_ids[:, 1:]
    chosen = jnp.take_along_axis(logits, nxt[..., None], axis=-1)[..., 0]
    steps = token_ids.shape[1]
    valid = jnp.arange(steps - 1)[None, :] < (lengths[:, None] - 1)
    out = jnp.where(valid, chosen - log_total, 0.0)
    return jnp.pad(out, ((0, 0), (0, 1)))


def check_params(params: dict) -> None:
    """Refuse quantized params by name: their forward is not the float one a trainer
    differentiates (dequantize, or serve the float checkpoint the trainer holds)."""
    leaves = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0]
    for path, leaf in leaves:
        if isinstance(leaf, QuantizedWeight):
            raise ValueError(
                f"sequence_logprobs takes float params; {jax.tree_util.keystr(path)} is a "
                "quantized weight (serve the float checkpoint the trainer holds)")


def check_ids(token_ids: jax.Array, cfg: ModelConfig) -> None:
    """Token ids outside [0, vocab) are an error where they are concrete; under jit they
    cannot be read, and the forward's gather clamps them."""
    if isinstance(token_ids, jax.core.Tracer):
        return
    ids = np.asarray(token_ids)  # a concrete array: read on the host, no traced op
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}); got [{low}, {high}]")


@functools.partial(jax.jit, static_argnames=("cfg", "batch_invariant"))
def _jitted(params: dict, token_ids: jax.Array, lengths: jax.Array, cfg: ModelConfig,
            batch_invariant: bool) -> jax.Array:
    return sequence_logprobs(params, token_ids, cfg=cfg, lengths=lengths,
                             batch_invariant=batch_invariant)


def llm_sequence_logprobs(llm: object, sequences: list[list[int]]) -> list[list[float]]:
    """Logprobs of each sequence's tokens after the first, on the params an `LLM` serves
    (llm.llm_engine.runner.params, its model config), batch-invariant where the
    engine is: for comparing with what it sampled. Rows are right-padded into one
    batch."""
    params = llm.llm_engine.runner.params
    cfg = llm.llm_engine.model_config
    check_params(params)
    steps = max(len(s) for s in sequences)
    ids = jnp.asarray([list(s) + [0] * (steps - len(s)) for s in sequences], jnp.int32)
    check_ids(ids, cfg)
    lengths = jnp.asarray([len(s) for s in sequences], jnp.int32)
    out = jax.device_get(_jitted(params, ids, lengths, cfg,
                                 llm.llm_engine.config.batch_invariant))
    return [out[i, :len(s) - 1].tolist() for i, s in enumerate(sequences)]


def sampled_sequences(outputs: list) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """From `LLM.generate` outputs sampled with `logprobs=0`, each first completion's
    (prompt + completion ids, the engine's logprob of each sampled token, the column of
    `sequence_logprobs` that scores the first sampled token)."""
    sequences, engine, starts = [], [], []
    for out in outputs:
        c = out.outputs[0]
        sequences.append(list(out.prompt_token_ids) + list(c.token_ids))
        engine.append([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)])
        starts.append(len(out.prompt_token_ids) - 1)
    return sequences, engine, starts
