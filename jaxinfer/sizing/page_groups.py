"""How the memory plan splits KV bytes between page groups (engine/core/kv_groups.py):
`group_layers` names the groups, `split_pages` counts their pages so that requests at
max_model_len run out of every group together. See docs/kv_cache.md#sizing.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class PageGroupPlan:
    """One page group of a memory plan."""

    kind: str  # engine/core/kv_groups.py's KINDS: "full" or "sliding"
    window: int | None  # its layers' window; None: a group that keeps every page
    num_layers: int
    request_pages: int  # pages a request at max_model_len holds while decoding
    num_pages: int = 0  # the trash page included
    page_bytes: int = 0  # one page of its layers (group 0's: and a draft's)


def group_layers(cfg: ModelConfig, page_size: int, max_model_len: int, hybrid: bool
                 ) -> list[PageGroupPlan]:
    """The page groups of `cfg` (their pages not yet counted): one of every layer, or with
    `hybrid` and layers both full and within one window that spans fewer pages than a
    request at max_model_len, the full layers' then the sliding layers'."""
    context_pages = -(-max_model_len // page_size)
    every = PageGroupPlan("full", None, cfg.num_layers, context_pages)
    sliding = len(cfg.sliding_layers())
    if not hybrid or not 0 < sliding < cfg.num_layers:
        return [every]
    window_pages = -(-cfg.sliding_window // page_size) + 1
    if window_pages >= context_pages:
        return [every]
    return [dataclasses.replace(every, num_layers=cfg.num_layers - sliding),
            PageGroupPlan("sliding", cfg.sliding_window, sliding, window_pages)]


def split_pages(kv_cache_bytes: int, page_bytes: list[int], request_pages: list[int], *,
                slack: int) -> list[int]:
    """Pages per group, trash pages included, in `kv_cache_bytes`: group g > 0 gets
    (group 0's - 1) x request_pages[g] / request_pages[0] (what requests at full context
    hold while decoding) + `slack` (a prefill chunk's extra pages) + 1, the last group
    whatever the others leave over."""
    ratios = [pages / request_pages[0] for pages in request_pages[1:]]
    others = list(zip(page_bytes[1:], ratios, strict=True))
    spare = kv_cache_bytes - sum(b * (slack + 1 - r) for b, r in others)
    counts = [max(int(spare // (page_bytes[0] + sum(b * r for b, r in others))), 0)]
    counts += [int((counts[0] - 1) * r) + slack + 1 for r in ratios[:-1]]
    left = kv_cache_bytes - sum(n * b for n, b in zip(counts, page_bytes, strict=False))
    return counts + [left // page_bytes[-1]]


def page_groups(cfg: ModelConfig, kv_cache_bytes: int, per_token: int, draft_per_token: int,
                *, page_size: int, max_model_len: int, max_num_batched_tokens: int,
                hybrid: bool) -> dict[str, object]:
    """MemoryPlan's page fields for `kv_cache_bytes`: the groups of `group_layers`, each
    page holding its layers' K/V (a draft's riding with group 0: its pages are group 0's
    ids). Requests at max_model_len that fit: the fewest any group's pages hold."""
    groups = group_layers(cfg, page_size, max_model_len, hybrid)
    unified = page_size * (per_token + draft_per_token)
    per_layer = per_token // cfg.num_layers
    if len(groups) == 1:
        page_bytes = [unified]
        counts = [kv_cache_bytes // unified]
    else:
        page_bytes = [page_size * per_layer * g.num_layers for g in groups]
        page_bytes[0] += page_size * draft_per_token
        counts = split_pages(kv_cache_bytes, page_bytes, [g.request_pages for g in groups],
                             slack=-(-max_num_batched_tokens // page_size) + 1)
    groups = tuple(dataclasses.replace(g, num_pages=n, page_bytes=b)
                   for g, n, b in zip(groups, counts, page_bytes, strict=True))
    return {"page_bytes": page_bytes[0], "num_pages": counts[0],
            "kv_cache_bytes": sum(n * b for n, b in zip(counts, page_bytes, strict=True)),
            "max_concurrent_requests": min((g.num_pages - 1) // g.request_pages
                                           for g in groups),
            "page_groups": groups, "unified_num_pages": kv_cache_bytes // unified}


def one_request_bytes(cfg: ModelConfig, per_token: int, draft_per_token: int, *,
                      page_size: int, max_model_len: int, max_num_batched_tokens: int,
                      hybrid: bool) -> int:
    """KV bytes one request of max_model_len needs, trash pages included: in group 0
    pages for all its tokens (every layer's, with one group), in each other group
    the pages it holds while decoding and a prefill chunk's."""
    groups = group_layers(cfg, page_size, max_model_len, hybrid)
    if len(groups) == 1:
        return (groups[0].request_pages + 1) * page_size * (per_token + draft_per_token)
    per_layer = per_token // cfg.num_layers
    slack = -(-max_num_batched_tokens // page_size) + 1
    first, *others = groups
    need = (first.request_pages + 1) * page_size * (per_layer * first.num_layers
                                                    + draft_per_token)
    return need + sum((g.request_pages + slack + 1) * page_size * per_layer * g.num_layers
                      for g in others)


def hybrid_summary(plan: object) -> dict[str, object]:
    """A MemoryPlan's page groups past the first, and what its KV bytes hold with one
    group (nothing when it has one)."""
    if len(plan.page_groups) < 2:
        return {}
    out: dict[str, object] = {}
    for group in plan.page_groups[1:]:
        out |= {f"num_{group.kind}_pages": group.num_pages,
                f"{group.kind}_page_bytes": group.page_bytes,
                f"kv_tokens_{group.kind}": (group.num_pages - 1) * plan.page_size}
    pages = plan.unified_num_pages
    full_context = -(-plan.max_model_len // plan.page_size)
    return out | {"kv_tokens_without_hybrid": (pages - 1) * plan.page_size,
                  "max_concurrent_requests_without_hybrid": (pages - 1) // full_context}
