"""8-bit KV cache accuracy on the bundled demo model: held-out loss and the choice of
scales.

Held-out windows of `--window` tokens from the corpus's held-out files
(`jaxinfer.text.corpus.corpus_files()`, never trained on), tokenized with the demo tokenizer,
are scored teacher-forced through a Runner's forward pass (`testing.logits`: one chunk
per window, its K/V written to the cache, quantized for 8-bit KV, then attended) with
kv_cache_dtype float32, int8 and fp8: mean NLL per predicted token and perplexity, and
their relative change against float32.

`--mode=scales` compares scales per token and KV head (what kv_quant.py does) with
scales per page and KV head (at their best: each page's maximum known in advance) on
the float K/V the float run wrote, all layers: relative rms round-trip error of K and V,
and of the causal attention output with each position's own key as its query (the
model's queries are not kept in the cache). Prints one JSON object.

    python benchmarks/kv_quant_accuracy.py [--windows=16] [--window=256] [--mode=loss]
"""

from __future__ import annotations

import json

import jax
import numpy as np
from absl import app, flags

from jaxinfer import testing
from jaxinfer.config import DEFAULT_MODEL, EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner import Chunk
from jaxinfer.pallas import kv_layout, kv_quant
from jaxinfer.text import corpus
from jaxinfer.text.tokenizer import Tokenizer

FLAGS = flags.DEFINE_integer("windows", 16, "held-out windows")
flags.DEFINE_integer("window", 256, "tokens per window")
flags.DEFINE_enum("mode", "loss", ["loss", "scales"], "what to measure")
PAGE_SIZE = 16


def held_out_windows(count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens, one from each of the first held-out files
    long enough (their first tokens)."""
    tokenizer = Tokenizer.from_dir(DEFAULT_MODEL)
    windows = []
    for text in corpus.read_texts(corpus.corpus_files()[1]):
        ids = tokenizer.encode(text)
        if len(ids) >= length:
            windows.append(ids[:length])
        if len(windows) == count:
            break
    return windows


def engine_for(kv_dtype: str, length: int) -> Engine:
    return Engine(DEFAULT_MODEL, EngineConfig(
        kv_cache_dtype=kv_dtype, page_size=PAGE_SIZE, max_model_len=2 * length,
        max_num_seqs=1, max_num_batched_tokens=length, attention_impl="reference",
        compilation_cache_dir=""), warm_up=False)


def window_nll(engine: Engine, window: list[int]) -> np.ndarray:
    """f64[len - 1]: -log p(token i + 1 | tokens <= i) over one window."""
    pages = list(range(1, -(-len(window) // PAGE_SIZE) + 1))
    logits = testing.logits(engine.runner, [Chunk(window, 0, pages)]).astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -logp[np.arange(len(window) - 1), window[1:]]


def loss_report(windows: list[list[int]], length: int) -> dict:
    out = {}
    for kv_dtype in ("float32", "int8", "fp8"):
        engine = engine_for(kv_dtype, length)
        nll = np.concatenate([window_nll(engine, w) for w in windows])
        out[kv_dtype] = {"nll": float(nll.mean()), "ppl": float(np.exp(nll.mean()))}
    for kv_dtype in ("int8", "fp8"):
        base = out["float32"]
        out[kv_dtype]["ppl_change_pct"] = 100 * (out[kv_dtype]["ppl"] / base["ppl"] - 1)
        out[kv_dtype]["nll_change_pct"] = 100 * (out[kv_dtype]["nll"] / base["nll"] - 1)
    return out


def _per_page(x: np.ndarray, dtype) -> np.ndarray:
    """x f32[pages, K, C, H] through 8-bit values with one scale per page and head."""
    amax = np.abs(x).max(axis=(1, 3), keepdims=True)
    scale = np.where(amax > 0, amax / kv_quant.QMAX[np.dtype(dtype)], 1).astype(np.float32)
    y = np.clip(x / scale, -kv_quant.QMAX[np.dtype(dtype)], kv_quant.QMAX[np.dtype(dtype)])
    if np.issubdtype(np.dtype(dtype), np.integer):
        y = np.round(y)
    return y.astype(dtype).astype(np.float32) * scale


def _per_token(x: np.ndarray, dtype) -> np.ndarray:
    values, scale = kv_quant.quantize_numpy(x, dtype)
    return values.astype(np.float32) * scale[..., None]


def _attention(k: np.ndarray, v: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Causal attention f32[T, H] of queries q over k, v f32[T, H]."""
    s = q @ k.T / np.sqrt(k.shape[-1])
    s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _rel(err: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt((err ** 2).mean() / (ref ** 2).mean()))


def scales_report(windows: list[list[int]], length: int) -> dict:
    engine = engine_for("float32", length)
    used = -(-length // PAGE_SIZE)
    caches = []  # per window and layer: f32[pages, K, C, H]
    for window in windows:
        window_nll(engine, window)
        head_dim = engine.model_config.head_dim
        caches += [np.asarray(kv_layout.combined_view(layer, head_dim))[1:used + 1]
                   for layer in jax.device_get(engine.runner.kv_cache)]
    out = {}
    for name, dtype in (("int8", np.dtype("int8")),
                        ("fp8", np.dtype(kv_quant.NAMES["fp8"]))):
        for scheme, quantize in (("per_token", _per_token), ("per_page", _per_page)):
            kv_err, kv_ref, attn_err, attn_ref = [], [], [], []
            for x in caches:
                xq = quantize(x, dtype)
                kv_err.append(xq - x)
                kv_ref.append(x)
                for head in range(0, x.shape[2], 2):  # K at even, V at odd heads
                    k, v = (a[:, :, head:head + 2].reshape(-1, 2, a.shape[-1])
                            for a in (x, xq))
                    want = _attention(k[:, 0], k[:, 1], k[:, 0])
                    got = _attention(v[:, 0], v[:, 1], k[:, 0])
                    attn_err.append(got - want)
                    attn_ref.append(want)
            out[f"{name}_{scheme}"] = {
                "kv_rel_rms_error": _rel(np.concatenate([e.ravel() for e in kv_err]),
                                         np.concatenate([r.ravel() for r in kv_ref])),
                "attention_rel_rms_error": _rel(np.concatenate([e.ravel() for e in attn_err]),
                                                np.concatenate([r.ravel() for r in attn_ref]))}
    return out


def main(argv: list[str]) -> None:
    del argv
    length = flags.FLAGS.window
    windows = held_out_windows(flags.FLAGS.windows, length)
    report = {"model": str(DEFAULT_MODEL), "windows": len(windows), "window_tokens": length,
              "mode": flags.FLAGS.mode}
    if flags.FLAGS.mode == "loss":
        report |= loss_report(windows, length)
    else:
        report |= scales_report(windows, length)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    app.run(main)
