"""The prompt-overlap audit: the prompts of a batch-runner JSONL file replayed through the
engine's own page pool, reporting how much prefill a prefix cache would save. Loads no
weights. See docs/cli.md#audit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from jaxinfer.engine.core.page_pool import ROOT, PagePool
from jaxinfer.text.tokenizer import Tokenizer


def overlap(prompts: Sequence[Sequence[int]], page_size: int = 16) -> dict:
    """Replay token-id prompts through a cache; served tokens per prompt and prefixes."""
    pool = PagePool(sum(len(p) // page_size for p in prompts) + 2, enable_caching=True)
    served = []
    prefixes: dict[int, dict] = {}  # last served page's serial -> its prefix's record
    for number, tokens in enumerate(prompts):
        pages, serials = pool.match(tokens, page_size, (len(tokens) - 1) // page_size)
        pool.share(pages)
        served.append(len(pages) * page_size)
        if serials:
            record = prefixes.setdefault(serials[-1], {
                "tokens": len(pages) * page_size, "prompts_served": 0, "example": number})
            record["prompts_served"] += 1
        parent = serials[-1] if serials else ROOT
        for index in range(len(pages), len(tokens) // page_size):
            (page,) = pool.allocate(1)
            parent = pool.register(page, parent, tokens[index * page_size:
                                                        (index + 1) * page_size])
    total = sum(len(p) for p in prompts)
    return {"prompts": len(prompts), "prompt_tokens": total, "served_tokens": sum(served),
            "projected_prefill_saving": round(sum(served) / max(total, 1), 4),
            "served_per_prompt": served, "shared_prefixes": list(prefixes.values())}


def run(model_dir: str | os.PathLike, input_path: str | os.PathLike, *, page_size: int = 16,
        top: int = 5) -> dict:
    """The audit of a JSONL file of prompts, with the longest shared prefixes as text."""
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts, errors = [], []
    with open(input_path, encoding="utf-8") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                if not isinstance(record, dict):
                    raise ValueError("the line is not a JSON object")
                prompts.append(tokenizer.prompt_ids(record.get("prompt"),
                                                    record.get("messages")))
            except (ValueError, TypeError) as err:
                errors.append({"line": line_no, "error": str(err)})
    result = overlap(prompts, page_size)
    del result["served_per_prompt"]
    shared = result.pop("shared_prefixes")
    longest = sorted(shared, key=lambda r: (-r["tokens"], -r["prompts_served"]))[:top]
    result["longest_shared_prefixes"] = [
        {"tokens": r["tokens"], "prompts_served": r["prompts_served"],
         "text": _preview(tokenizer, prompts[r["example"]][:r["tokens"]])} for r in longest]
    result["page_size"] = page_size
    result["errors"] = errors
    return result


def _preview(tokenizer: Tokenizer, tokens: list[int], width: int = 80) -> str:
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    return text if len(text) <= width else text[:width - 3] + "..."
