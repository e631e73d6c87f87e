"""The memory plan: what a model and its KV cache need, what fits, how fast it can go.

`plan()` takes a model config, the weight and KV dtypes, the context length and
a budget (bytes for the KV cache, or for weights plus KV) and returns a
`MemoryPlan`: weight bytes, KV bytes per token, the pages that fit (page 0 is
the trash page), concurrent requests at full context, and the decode roofline
(tokens/s bounded by reading every weight once plus each request's KV per step,
at a given memory bandwidth; left out when none is given). The engine sizes its
page pool with it (through loading.py), so the plan and the allocation agree to
the byte. `python -m jaxinfer plan` prints it.
Imports the model's parameter shapes (jax for dtype sizes) and config.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.model.transformer import param_shapes
from jaxinfer.pallas import kv_layout

GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Bytes and counts of one engine configuration (`summary()` adds GB and rates)."""

    weight_bytes: int
    kv_bytes_per_token: int  # K and V of one token over all layers
    page_size: int
    page_bytes: int
    num_pages: int  # in the pool, the trash page included
    kv_cache_bytes: int  # num_pages * page_bytes: what the engine allocates
    max_model_len: int
    pages_per_request: int  # at max_model_len
    max_concurrent_requests: int  # at full context, every one at max_model_len
    max_num_seqs: int
    bandwidth_gb_per_s: float | None  # None: unknown, no roofline

    def decode_roofline(self, batch: int, context: int) -> float | None:
        """Tokens/s bound of a decode step of `batch` requests at `context` tokens each
        (None when the bandwidth is unknown)."""
        if self.bandwidth_gb_per_s is None:
            return None
        step_bytes = self.weight_bytes + batch * context * self.kv_bytes_per_token
        return batch * self.bandwidth_gb_per_s * GB / step_bytes

    def summary(self) -> dict[str, float | int | None]:
        batch = max(1, min(self.max_num_seqs, self.max_concurrent_requests))

        def rate(batch: int) -> float | None:
            value = self.decode_roofline(batch, self.max_model_len)
            return None if value is None else round(value, 1)

        return {
            "weight_bytes": self.weight_bytes, "weight_gb": round(self.weight_bytes / GB, 3),
            "kv_bytes_per_token": self.kv_bytes_per_token, "page_size": self.page_size,
            "page_bytes": self.page_bytes, "num_pages": self.num_pages,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_cache_gb": round(self.kv_cache_bytes / GB, 3),
            "total_gb": round((self.weight_bytes + self.kv_cache_bytes) / GB, 3),
            "kv_tokens": (self.num_pages - 1) * self.page_size,
            "max_model_len": self.max_model_len,
            "max_concurrent_requests_at_full_context": self.max_concurrent_requests,
            "bandwidth_gb_per_s": self.bandwidth_gb_per_s,
            "decode_roofline_tokens_per_s_batch_1": rate(1),
            "decode_roofline_batch": batch,
            "decode_roofline_tokens_per_s": rate(batch),
        }


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of every parameter stored in `dtype` (the loader casts all of them)."""
    leaves = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    return sum(math.prod(shape) for shape in leaves) * jnp.dtype(dtype).itemsize


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    """K and V of one token over all layers, as stored: heads padded to whole 32-bit
    words (`pallas/kv_layout.py`; only 8-bit pages with an odd head count pad)."""
    combined = kv_layout.padded_heads_for(cfg.num_kv_heads, kv_dtype)
    return combined * cfg.head_dim * jnp.dtype(kv_dtype).itemsize * cfg.num_layers


def plan(cfg: ModelConfig, *, dtype: str = "float32", kv_dtype: str | None = None,
         max_model_len: int | None = None, max_num_seqs: int = 32, page_size: int = 16,
         kv_cache_bytes: int | None = None, memory_bytes: int | None = None,
         bandwidth_gb_per_s: float | None = None) -> MemoryPlan:
    """The plan for a KV budget: `kv_cache_bytes` for the cache alone, or `memory_bytes`
    for weights plus cache (exactly one); `bandwidth_gb_per_s` (GB/s) for the decode
    roofline, None leaves it out. Raises ValueError when not even one request
    of `max_model_len` fits, saying how much would."""
    if (kv_cache_bytes is None) == (memory_bytes is None):
        raise ValueError("give exactly one of kv_cache_bytes or memory_bytes")
    kv_dtype = kv_dtype or dtype
    max_model_len = max_model_len or cfg.max_position_embeddings
    weights = weight_bytes(cfg, dtype)
    per_token = kv_bytes_per_token(cfg, kv_dtype)
    page_bytes = page_size * per_token
    pages_per_request = -(-max_model_len // page_size)
    need = (pages_per_request + 1) * page_bytes
    if memory_bytes is not None:
        kv_cache_bytes = memory_bytes - weights
        if kv_cache_bytes < need:
            raise ValueError(
                f"{memory_bytes / GB:.3f} GB holds the {weights / GB:.3f} GB of {dtype} "
                f"weights and {max(kv_cache_bytes, 0) / GB:.3f} GB of KV cache; one request "
                f"of max_model_len={max_model_len} needs {need / GB:.3f} GB of KV "
                f"({pages_per_request} pages of {page_bytes} bytes plus the trash page): "
                f"give at least {(weights + need) / GB:.3f} GB or lower max_model_len")
    num_pages = kv_cache_bytes // page_bytes
    if num_pages - 1 < pages_per_request:
        raise ValueError(
            f"a KV cache of {kv_cache_bytes} bytes holds {num_pages} pages of {page_bytes} "
            f"bytes; one request of max_model_len={max_model_len} needs {pages_per_request} "
            f"plus the trash page: give kv_cache_memory_bytes >= {need} or lower "
            "max_model_len")
    return MemoryPlan(weight_bytes=weights, kv_bytes_per_token=per_token, page_size=page_size,
                      page_bytes=page_bytes, num_pages=num_pages,
                      kv_cache_bytes=num_pages * page_bytes, max_model_len=max_model_len,
                      pages_per_request=pages_per_request,
                      max_concurrent_requests=(num_pages - 1) // pages_per_request,
                      max_num_seqs=max_num_seqs, bandwidth_gb_per_s=bandwidth_gb_per_s)
