"""How the memory plan splits KV bytes between page groups (engine/core/kv_groups.py).

A model with both sliding-window and full-attention layers (Gemma 3, gpt-oss) gives its
sliding layers their own pages: a request holds a full-group page for every page of its
tokens but only about ceil(window / page_size) + 1 sliding pages while decoding. The
planner sizes the groups so that requests at max_model_len run out of both together:
sliding pages = full pages x W / F (W = ceil(window / page_size) + 1, F =
ceil(max_model_len / page_size)) plus slack for one prefill chunk per step, solving
bytes = page_bytes_per_layer x (n_full x P_full + n_sliding x P_sliding).
"""

from __future__ import annotations

from jaxinfer.config import ModelConfig


def sliding_split(cfg: ModelConfig, page_size: int, max_model_len: int
                  ) -> tuple[int, int] | None:
    """(full-attention layers, sliding-window layers) when the hybrid KV cache pays: the
    model has both and a window spans fewer pages than a request at max_model_len; else
    None (one page group: Llama, Mistral, or a window as long as the context)."""
    sliding = len(cfg.sliding_layers())
    if not 0 < sliding < cfg.num_layers:
        return None
    window_pages = -(-cfg.sliding_window // page_size) + 1
    if window_pages >= -(-max_model_len // page_size):
        return None
    return cfg.num_layers - sliding, sliding


def split_pages(kv_cache_bytes: int, full_page_bytes: int, sliding_page_bytes: int, *,
                window_pages: int, context_pages: int, slack: int) -> tuple[int, int]:
    """(full pages, sliding pages), trash pages included, in `kv_cache_bytes`: sliding =
    (full - 1) x window_pages / context_pages (what requests at full context hold while
    decoding) + `slack` (a prefill chunk's extra pages) + 1, whatever the full pages
    leave over going to the sliding group."""
    ratio = window_pages / context_pages
    full = int((kv_cache_bytes - sliding_page_bytes * (slack + 1 - ratio))
               // (full_page_bytes + sliding_page_bytes * ratio))
    full = max(full, 0)
    return full, (kv_cache_bytes - full * full_page_bytes) // sliding_page_bytes


def page_groups(cfg: ModelConfig, kv_cache_bytes: int, per_token: int, draft_per_token: int,
                *, page_size: int, max_model_len: int, max_num_batched_tokens: int,
                hybrid: bool) -> dict[str, int]:
    """MemoryPlan's page fields for `kv_cache_bytes`: one group of pages of every layer
    unless `hybrid` and `sliding_split` says it pays; then bytes = page_bytes_per_layer x
    (n_full x P_full + n_sliding x P_sliding), a draft's K/V riding with the full group
    (its pages are the full group's ids). Requests at max_model_len that fit: by the
    full pages, and by the sliding pages each decoding request holds."""
    page_bytes = page_size * (per_token + draft_per_token)
    context_pages = -(-max_model_len // page_size)
    split = sliding_split(cfg, page_size, max_model_len) if hybrid else None
    if split is None:
        pages = kv_cache_bytes // page_bytes
        return {"page_bytes": page_bytes, "num_pages": pages,
                "kv_cache_bytes": pages * page_bytes,
                "max_concurrent_requests": (pages - 1) // context_pages}
    num_full, num_sliding = split
    per_layer = per_token // cfg.num_layers
    full_bytes = page_size * (per_layer * num_full + draft_per_token)
    sliding_bytes = page_size * per_layer * num_sliding
    window_pages = -(-cfg.sliding_window // page_size) + 1
    full, sliding = split_pages(
        kv_cache_bytes, full_bytes, sliding_bytes, window_pages=window_pages,
        context_pages=context_pages, slack=-(-max_num_batched_tokens // page_size) + 1)
    return {"page_bytes": full_bytes, "num_pages": full,
            "kv_cache_bytes": full * full_bytes + sliding * sliding_bytes,
            "max_concurrent_requests": min((full - 1) // context_pages,
                                           (sliding - 1) // window_pages),
            "num_sliding_pages": sliding, "sliding_page_bytes": sliding_bytes,
            "sliding_window_pages": window_pages,
            "unified_num_pages": kv_cache_bytes // page_bytes}


def one_request_bytes(cfg: ModelConfig, per_token: int, draft_per_token: int, *,
                      page_size: int, max_model_len: int, max_num_batched_tokens: int,
                      hybrid: bool) -> int:
    """KV bytes one request of max_model_len needs, trash pages included: every layer's
    pages for all its tokens in one group; with the hybrid split, the full layers' pages
    for all its tokens and the sliding layers' for a window and a prefill chunk."""
    context_pages = -(-max_model_len // page_size)
    split = sliding_split(cfg, page_size, max_model_len) if hybrid else None
    if split is None:
        return (context_pages + 1) * page_size * (per_token + draft_per_token)
    num_full, num_sliding = split
    per_layer = per_token // cfg.num_layers
    window_pages = -(-cfg.sliding_window // page_size) + 1
    slack = -(-max_num_batched_tokens // page_size) + 1
    full = (context_pages + 1) * page_size * (per_layer * num_full + draft_per_token)
    return full + (window_pages + slack + 1) * page_size * per_layer * num_sliding


def hybrid_summary(plan: object) -> dict[str, object]:
    """A MemoryPlan's page groups, and what its KV bytes hold without the hybrid cache
    (nothing without a sliding group)."""
    if not plan.num_sliding_pages:
        return {}
    pages = plan.unified_num_pages
    full_context = -(-plan.max_model_len // plan.page_size)
    return {"num_sliding_pages": plan.num_sliding_pages,
            "sliding_page_bytes": plan.sliding_page_bytes,
            "kv_tokens_sliding": (plan.num_sliding_pages - 1) * plan.page_size,
            "kv_tokens_without_hybrid": (pages - 1) * plan.page_size,
            "max_concurrent_requests_without_hybrid": (pages - 1) // full_context}
