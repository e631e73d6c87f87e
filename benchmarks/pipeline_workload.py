"""The batch pipeline benchmark's workload and its checks (benchmarks/bench_pipeline.py).

Each prompt is one shared preamble (a Python module header: a docstring with the
instructions and three short example functions, about 240 tokens) followed by one
document: a slice of a held-out file of the bundled corpus (jaxinfer/text/corpus.py; the
demo models never trained on them), cut at line boundaries, 60-160 tokens. Each request
asks for a number of tokens drawn in [32, 96], greedy, with `ignore_eos` so that every
output has exactly that many tokens. Everything is drawn from one seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

from jaxinfer.text.corpus import corpus_files, read_texts

PREAMBLE = '''"""Document continuation pipeline.

Instructions: every document below is a piece of a Python module from the
standard library. Read it and continue the code in the same style: keep the
indentation, the names and the docstring conventions, and prefer small
functions with clear return values.

Examples of the expected style follow.
"""


def join_words(words, sep=" "):
    """Return the words joined by sep."""
    return sep.join(str(word) for word in words)


def count_lines(path):
    """Return the number of lines of the file at path."""
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def is_private(name):
    """Return True if name starts with an underscore."""
    return name.startswith("_") and not name.startswith("__")


# Document:
'''
DOC_TOKENS = (60, 160)  # tokens of a document, inclusive
OUTPUT_TOKENS = (32, 96)  # tokens generated per document, inclusive
MAX_MODEL_LEN = 512  # the demo pair's context
MAX_TRIES = 200  # draws of a start line per document before giving up


def _documents(texts: Sequence[str], tokenizer: object, preamble_len: int,
               rng: random.Random, count: int) -> list[tuple[str, int]]:
    """`count` distinct documents (text, tokens after the preamble in the whole prompt)."""
    files = [text.splitlines(keepends=True) for text in texts]
    files = [lines for lines in files if len(lines) >= 20]
    seen: set[tuple[int, int]] = set()
    out: list[tuple[str, int]] = []
    for _ in range(count):
        target = rng.randint(*DOC_TOKENS)
        for _ in range(MAX_TRIES):
            which = rng.randrange(len(files))
            lines = files[which]
            start = rng.randrange(len(lines) - 1)
            if (which, start) in seen or not lines[start].strip():
                continue
            doc = _cut(lines, start, target, tokenizer, preamble_len)
            if doc is not None:
                seen.add((which, start))
                out.append(doc)
                break
        else:
            raise ValueError(f"no document of {target} tokens in {MAX_TRIES} draws")
    return out


def _cut(lines: list[str], start: int, target: int, tokenizer: object,
         preamble_len: int) -> tuple[str, int] | None:
    """Lines from `start` until the document reaches `target` tokens (counted inside the
    whole prompt, where the tokenizer may merge across the preamble's end), or None
    when no cut at a line boundary lies in DOC_TOKENS."""
    text, tokens = "", 0
    for line in lines[start:]:
        longer = text + line
        count = len(tokenizer.encode(PREAMBLE + longer, add_special_tokens=False)) - preamble_len
        if count > DOC_TOKENS[1]:
            break
        text, tokens = longer, count
        if tokens >= target:
            break
    return (text, tokens) if DOC_TOKENS[0] <= tokens <= DOC_TOKENS[1] else None


def build(tokenizer: object, num_docs: int, seed: int = 0) -> list[dict]:
    """The batch runner's request records, in input order, with the token counts the
    checks use under `_tokens` (strip them before writing: the runner refuses unknown
    fields)."""
    rng = random.Random(seed)
    preamble_len = len(tokenizer.encode(PREAMBLE, add_special_tokens=False))
    texts = read_texts(corpus_files()[1])
    records = []
    docs = _documents(texts, tokenizer, preamble_len, rng, num_docs)
    for number, (doc, doc_tokens) in enumerate(docs):
        max_tokens = rng.randint(*OUTPUT_TOKENS)
        prompt = PREAMBLE + doc
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        records.append({
            "id": f"doc-{number:05d}", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True,
            "_tokens": {"preamble": preamble_len, "document": doc_tokens,
                        "prompt": prompt_len, "total": prompt_len + max_tokens}})
    return records


def write_jsonl(records: Sequence[dict], path: object) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps({k: v for k, v in record.items() if k != "_tokens"}) + "\n")


def shape(records: Sequence[dict]) -> dict:
    """The workload's token counts: min / mean / max per part."""
    def stats(values: list[int]) -> dict:
        return {"min": min(values), "mean": round(sum(values) / len(values), 1),
                "max": max(values), "sum": sum(values)}
    tokens = [r["_tokens"] for r in records]
    return {"documents": len(records), "preamble_tokens": tokens[0]["preamble"],
            "document_tokens": stats([t["document"] for t in tokens]),
            "prompt_tokens": stats([t["prompt"] for t in tokens]),
            "output_tokens": stats([r["max_tokens"] for r in records]),
            "max_total_tokens": max(t["total"] for t in tokens)}


def read_outputs(path: object) -> dict[str, list[int]]:
    """id -> generated token ids of a batch output file (error records: None)."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for raw in f:
            record = json.loads(raw)
            out[str(record["id"])] = record.get("token_ids")
    return out


def static_batches_in_order(path: object, ids: list[str], size: int) -> bool:
    """Whether the output's finish order falls into input-order batches of `size`: the
    static scheduler admits no request until its whole batch has finished."""
    with open(path, encoding="utf-8") as f:
        finished = [json.loads(raw)["id"] for raw in f]
    return all(set(finished[lo:lo + size]) == set(ids[lo:lo + size])
               for lo in range(0, len(ids), size)) and len(finished) == len(ids)


def differing_ids(base: dict[str, list[int]], other: dict[str, list[int]]) -> list[str]:
    """Ids whose token ids differ (or that one of the two lacks)."""
    return sorted(i for i in base.keys() | other.keys() if base.get(i) != other.get(i)
                  or base.get(i) is None)


def first_differences(base: dict[str, list[int]], other: dict[str, list[int]],
                      ids: list[str]) -> dict[str, dict]:
    """For each of `ids`: the first position where `other`'s tokens leave `base`'s, and
    the output's length (a late single flip of a near tie, or a wrong output)."""
    out = {}
    for key in ids:
        mine, theirs = base.get(key) or [], other.get(key) or []
        same = [a == b for a, b in zip(mine, theirs, strict=False)]
        out[key] = {"position": same.index(False) if False in same else len(same),
                    "length": len(mine)}
    return out


def agreement(base: dict[str, list[int]], other: dict[str, list[int]]) -> dict:
    """How far `other`'s tokens follow `base`'s: `prefix_share`, positions before each
    output's first differing token over all positions (greedy decoding goes its own way
    after one differing token, so later positions say little); `position_share`, positions
    equal at the same index over all positions; `identical_share`, outputs equal whole."""
    positions = prefix = equal = whole = 0
    for key, tokens in base.items():
        theirs = other.get(key) or []
        tokens = tokens or []
        positions += len(tokens)
        same = [a == b for a, b in zip(tokens, theirs, strict=False)]
        equal += sum(same)
        prefix += same.index(False) if False in same else len(same)
        whole += tokens == theirs
    return {"prefix_share": round(prefix / max(positions, 1), 4),
            "position_share": round(equal / max(positions, 1), 4),
            "identical_share": round(whole / max(len(base), 1), 4)}
