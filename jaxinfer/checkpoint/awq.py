"""Activation-aware int4 weights (AWQ): per-input-channel scales and per-group clipping
chosen on calibration text (`calibration_token_ids`, `calibrate`), folded into the
float params before `quantization.quantize_params(params, "int4")` rounds them.
The method, its folds and its cost: docs/quantization.md#int4-calibration-awq.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion, layers, quantization
from jaxinfer.model.attention import project_qkv
from jaxinfer.text import corpus
from jaxinfer.text.tokenizer import Tokenizer

LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")  # a dense layer's, each with its input

log = logging.getLogger(__name__)
ALPHAS = tuple(i / 10 for i in range(11))  # mean|x| exponents tried (0: no scaling)
CLIP_RATIOS = tuple(1 - i / 20 for i in range(10))  # 1.0 down to 0.55
NUM_WINDOWS = 16  # default calibration: windows, one per training file picked
WINDOW_TOKENS = 128
MAX_SEARCH_TOKENS = 512  # rows of x the scale search measures (mean|x| and clip: all)
CHARS_PER_TOKEN = 16  # default calibration: text read per window token, at most
Quantizer = Callable[[np.ndarray], np.ndarray]


def fake_int4(w: np.ndarray) -> np.ndarray:
    """w f32[I, O] rounded through int4 and back, as the engine will hold it (the numpy
    twin of quantization.quantize, bit-exact)."""
    return quantization.dequantize_numpy(*quantization.quantize_numpy(w, "int4"))


def read_calibration_texts(path: str | os.PathLike) -> list[str]:
    """The "text" of every line of a JSONL file; a bad line is a ValueError naming it."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{number}: calibration lines must be "
                                 f'{{"text": "..."}} objects, got {line.strip()[:80]!r}')
            texts.append(record["text"])
    if not texts:
        raise ValueError(f"{path}: no calibration lines")
    return texts


def default_calibration_texts(num_files: int = NUM_WINDOWS) -> list[str]:
    """`num_files` training files of the bundled corpus, evenly spaced in sorted order
    (never a held-out file)."""
    train, _ = corpus.corpus_files()
    stride = max(1, len(train) // num_files)
    return corpus.read_texts(train[::stride][:num_files])


def calibration_token_ids(tokenizer: Tokenizer, path: str | os.PathLike | None, *,
                          max_len: int, num_windows: int = NUM_WINDOWS,
                          window: int = WINDOW_TOKENS) -> np.ndarray:
    """Calibration windows i32[B, T]: the texts of `path` (default: the bundled corpus's
    training files, one window each) tokenized and cut into up to `num_windows` windows
    of min(window, max_len) tokens; too little text gives one shorter window."""
    window = min(window, max_len)
    if path is None:  # one window from the start of each file long enough
        texts = [text[:window * CHARS_PER_TOKEN]
                 for text in default_calibration_texts(num_windows)]
        ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        windows = [x[:window] for x in ids if len(x) >= window]
        if windows:
            return np.asarray(windows, np.int32)
    else:
        texts = read_calibration_texts(path)
    stream = [i for text in texts for i in tokenizer.encode(text, add_special_tokens=False)]
    if len(stream) < 2:
        raise ValueError(f"calibration_data={str(path)!r} gives {len(stream)} tokens; "
                         "at least 2 are needed")
    count = min(num_windows, max(1, len(stream) // window))
    window = min(window, len(stream))
    return np.asarray(stream[:count * window], np.int32).reshape(count, window)


def calibrate(params: dict, cfg: ModelConfig, token_ids: np.ndarray,
              quantizer: Quantizer = fake_int4) -> dict:
    """Float params with AWQ scales folded in and weights clipped (docs/quantization.md),
    ready for `quantization.quantize_params(..., "int4")`; host numpy arrays."""
    check_supported(cfg)
    started = time.perf_counter()
    params = jax.device_get(params)
    x = layers.embed(jnp.asarray(params["embed"]), jnp.asarray(token_ids))
    new_layers = []
    for layer in params["layers"]:
        inputs, x = layer_inputs(layer, x, cfg=cfg)
        new_layers.append(calibrate_layer(layer, inputs, cfg, quantizer))
    log.info("AWQ calibration on %d tokens: %.1f s", token_ids.size,
             time.perf_counter() - started)
    return params | {"layers": new_layers}


def check_supported(cfg: ModelConfig) -> None:
    """ValueError unless cfg's layers are the Llama block that `layer_inputs` runs and
    `_fold` folds into: plain RMSNorm weights (a (1 + w) norm cannot take 1/s), SwiGLU,
    no norms after the blocks, no soft caps or scaled embeddings (Gemma has all)."""
    plain = ModelConfig(vocab_size=1, hidden_size=1, intermediate_size=1, num_layers=1,
                        num_heads=1, num_kv_heads=1, head_dim=2)
    fields = ("hidden_act", "norm_weight_offset", "post_norms", "scale_embeddings",
              "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
              "rope_local_theta")
    other = [f"{f}={getattr(cfg, f)!r}" for f in fields
             if getattr(cfg, f) != getattr(plain, f)]
    if other:
        raise ValueError(f"quantization='int4' (AWQ) is not supported for "
                         f"{cfg.architecture}: its calibration runs the Llama block, and "
                         f"this model has {', '.join(other)}; use int8, w8a8 or fp8")


@functools.partial(jax.jit, static_argnames="cfg")
def layer_inputs(layer: dict, x: jax.Array, *, cfg: ModelConfig
                  ) -> tuple[dict[str, jax.Array], jax.Array]:
    """The four linears' inputs f32[B * T, I] in one float layer, and its output."""
    batch, tokens, _ = x.shape
    h = layers.rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    rope = layers.rope_tables(jnp.arange(tokens, dtype=jnp.int32), layers.rope_inv_freq(cfg))
    q, k, v = project_qkv(layer, h, cfg, rope)
    window = None if cfg.sliding_window is None else (cfg.sliding_window - 1, 0)
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window)
    attn = attn.reshape(batch, tokens, -1)
    x = x + layers.linear(attn, layer["wo"])
    m = layers.rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    f = layer["w_down"].shape[0]
    block = fusion.mlp_block(f)
    gate_up = layers.linear(m, layer["w_gate_up"]).reshape(batch, tokens, f // block, 2, block)
    hidden = (jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]).reshape(batch, tokens, f)
    x = x + layers.linear(hidden, layer["w_down"])
    inputs = {"wqkv": h, "wo": attn, "w_gate_up": m, "w_down": hidden}
    return {k: v.reshape(batch * tokens, -1) for k, v in inputs.items()}, x


def calibrate_layer(layer: dict, inputs: dict[str, jax.Array], cfg: ModelConfig,
                    quantizer: Quantizer = fake_int4) -> dict:
    """One layer's float params (numpy) with scales folded and weights clipped."""
    layer = dict(layer)
    scales, rows = {}, {}
    for name, x in inputs.items():
        mean_abs = np.asarray(jnp.mean(jnp.abs(x), axis=0))
        if name == "wo":  # one value per (KV head, head dim): docs/quantization.md
            g = cfg.num_kv_heads
            tied = mean_abs.reshape(g, -1, cfg.head_dim).mean(axis=1, keepdims=True)
            mean_abs = np.broadcast_to(tied, (g, cfg.num_heads // g, cfg.head_dim)).ravel()
        rows[name] = np.asarray(_search_rows(x))
        w = np.asarray(layer[name], np.float32)
        scales[name] = search_scale(rows[name], w, mean_abs, quantizer)
    _fold(layer, scales, cfg)
    for name in inputs:
        clipped = search_clip(np.asarray(inputs[name]) / scales[name],
                              np.asarray(layer[name], np.float32), quantizer)
        layer[name] = clipped.astype(layer[name].dtype)
    return layer


def _search_rows(x: jax.Array) -> jax.Array:
    """At most MAX_SEARCH_TOKENS rows of x, evenly spaced."""
    stride = -(-x.shape[0] // MAX_SEARCH_TOKENS)
    return x[::stride]


def _fold(layer: dict, s: dict[str, np.ndarray], cfg: ModelConfig) -> None:
    """Scale each linear's rows by s and its feeding op's output by 1/s (in place)."""
    dtype = layer["wqkv"].dtype
    f32 = {k: np.array(v, np.float32) for k, v in layer.items()}  # copies
    for name in LINEARS:
        f32[name] = f32[name] * s[name][:, None]
    f32["attn_norm"] = f32["attn_norm"] / s["wqkv"]
    f32["mlp_norm"] = f32["mlp_norm"] / s["w_gate_up"]
    g, h = cfg.num_kv_heads, cfg.head_dim
    per_v = s["wo"].reshape(g, -1, h)[:, 0]  # [G, H]: tied across each KV head's queries
    for key in ("wqkv", "bqkv"):
        if key in f32:
            grouped = f32[key].reshape(*f32[key].shape[:-1], g, -1, h)
            grouped[..., -1, :] /= per_v  # v is last in each KV head's group
    f = f32["w_down"].shape[0]
    block = fusion.mlp_block(f)
    pairs = f32["w_gate_up"].reshape(-1, f // block, 2, block)
    pairs[:, :, 1] /= s["w_down"].reshape(f // block, block)  # the up columns
    layer.update({k: v.astype(layer[k].dtype if k in layer else dtype) for k, v in f32.items()})


def search_scale(x: np.ndarray, w: np.ndarray, mean_abs: np.ndarray,
                 quantizer: Quantizer = fake_int4) -> np.ndarray:
    """The per-input-channel scales s f32[I] (ALPHAS' best) for x f32[n, I] @ w [I, O]."""
    exact = x @ w
    base = np.maximum(mean_abs, np.float32(1e-6))
    best, best_error = np.ones_like(base), np.inf
    for alpha in ALPHAS:
        s = base ** np.float32(alpha)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        error = np.mean(((x / s) @ quantizer(w * s[:, None]) - exact) ** 2)
        if error < best_error:
            best, best_error = s, error
    return best


def search_clip(x: np.ndarray, w: np.ndarray, quantizer: Quantizer = fake_int4
                ) -> np.ndarray:
    """w f32[I, O] with each group and column clipped to the CLIP_RATIOS range that
    minimises its part of the error of x f32[n, I] @ w: for group rows x_g and weight
    error e, |x_g e|^2 = e^T (x_g^T x_g) e, so each group's Gram matrix is built once."""
    rows, columns = w.shape
    group = quantization.int4_group(rows)
    groups = w.reshape(rows // group, group, columns)
    xg = x.reshape(x.shape[0], rows // group, group)
    gram = _grams(xg)
    low, high = groups.min(axis=1, keepdims=True), groups.max(axis=1, keepdims=True)
    best = np.ones_like(low)
    best_error = np.full(low.shape, np.inf, np.float32)
    for ratio in CLIP_RATIOS:
        clipped = np.clip(groups, ratio * low, ratio * high)
        diff = groups - quantizer(clipped.reshape(rows, columns)).reshape(groups.shape)
        error = np.asarray(_group_errors(gram, diff))  # [groups, 1, O]
        better = error < best_error
        best = np.where(better, np.float32(ratio), best)
        best_error = np.where(better, error, best_error)
    return np.clip(groups, best * low, best * high).reshape(rows, columns)


@jax.jit
def _grams(xg: jax.Array) -> jax.Array:
    """Each group's Gram matrix x_g^T x_g: f32[n, groups, g] -> f32[groups, g, g]."""
    return jnp.einsum("ngi,ngj->gij", xg, xg, precision="highest")


@jax.jit
def _group_errors(gram: jax.Array, diff: jax.Array) -> jax.Array:
    """e^T G e per group and column: f32[groups, g, g], f32[groups, g, O] -> [groups, 1, O]
    (a batched dot under jit: numpy's einsum and batched matmul were 10-40x slower)."""
    return jnp.sum(diff * jnp.matmul(gram, diff, precision="highest"), axis=1, keepdims=True)


def calibrate_checkpoint(params: dict, cfg: ModelConfig, model_dir: str | os.PathLike,
                         calibration_data: str | os.PathLike | None) -> dict:
    """`calibrate` on windows tokenized by the checkpoint's own tokenizer."""
    root = pathlib.Path(model_dir)
    if cfg.moe is not None:
        raise ValueError(f"quantization='int4' is not supported for mixture-of-experts "
                         f"models ({cfg.architecture}): use int8, w8a8 or fp8")
    check_supported(cfg)
    if not (root / "tokenizer.json").is_file():
        raise ValueError(f"quantization='int4' calibrates on text: {root} has no "
                         "tokenizer.json to tokenize it")
    token_ids = calibration_token_ids(Tokenizer.from_dir(root), calibration_data,
                                      max_len=cfg.max_position_embeddings)
    return calibrate(params, cfg, token_ids)
