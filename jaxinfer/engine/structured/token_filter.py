"""vLLM's `bad_words` and `allowed_token_ids` on the host: a request's bad words tokenized
as vLLM tokenizes them, and its allowed ids as one row of the step's token mask
(llguidance's layout). The runner ANDs both into the request's mask row after its
grammar's (runner/token_masks.py). Plain Python: no jax, no numpy.
See docs/sampling.md#sampling-parameters and docs/structured_outputs.md#how-it-works.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxinfer.engine.request import MAX_BAD_WORDS, SamplingParams

# Tokens of a request's bad-word sequences, all together (vLLM's V2 runner's
# VLLM_MAX_BAD_WORDS_TOTAL_TOKENS): each step compares every sequence's prefix.
MAX_BAD_WORD_TOKENS = 1024


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFilter:
    """A request's token filter: immutable, so a prompt's n completions share it; the
    output tokens it is asked about are each completion's own."""

    bad_words: tuple[tuple[int, ...], ...]  # token sequences, none of which may be generated
    # u32 words, bit t % 32 of word t // 32 set where token t is allowed; None: all are
    allowed: array.array | None

    @classmethod
    def build(cls, params: SamplingParams, tokenizer: Any | None,
              vocab_size: int) -> TokenFilter | None:
        """The filter of `params`, None when it asks for none; ValueError naming the
        field. `tokenizer` (jaxinfer's Tokenizer) is needed only for bad_words."""
        if not params.bad_words and params.allowed_token_ids is None:
            return None
        words: tuple[tuple[int, ...], ...] = ()
        if params.bad_words:
            if tokenizer is None:
                raise ValueError("bad_words need a tokenizer (skip_tokenizer_init=True)")
            words = tokenize_bad_words(params.bad_words, tokenizer, vocab_size)
        allowed = (None if params.allowed_token_ids is None
                   else allowed_row(params.allowed_token_ids, vocab_size))
        return cls(words, allowed)

    def banned(self, output_token_ids: Sequence[int]) -> list[int]:
        """The token ids the next token may not be, given the request's output so far
        (vLLM's rule: its prompt does not count): every one-token word's, and the last
        token of each longer word whose other tokens end the output."""
        out = []
        count = len(output_token_ids)
        for word in self.bad_words:
            prefix = len(word) - 1
            if prefix == 0 or (prefix <= count and output_token_ids[-1] == word[-2]
                               and tuple(output_token_ids[count - prefix:]) == word[:-1]):
                out.append(word[-1])
        return out


@dataclasses.dataclass(frozen=True)
class MaskRow:
    """What fills one sampled request's row of the step's mask (`Constraints.rows`):
    its grammar's matcher first, then its token filter given its output so far."""

    matcher: Any | None  # llguidance.LLMatcher
    token_filter: TokenFilter | None
    output_token_ids: Sequence[int]


def tokenize_bad_words(words: Sequence[str], tokenizer: Any,
                       vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad words, without special tokens: each word with its
    leading whitespace stripped, and again after one space, the spaced form kept when
    its first token differs and its length agrees (a word that starts the text and one
    in the middle of it are usually different tokens)."""
    sequences: list[tuple[int, ...]] = []
    for word in dict.fromkeys(words):
        plain = _encode(tokenizer, word.lstrip())
        if not plain:
            raise ValueError(f"bad_words entry {word!r} must tokenize to at least one token")
        sequences.append(plain)
        spaced = _encode(tokenizer, " " + word.lstrip())
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words make {len(sequences)} token sequences; at most "
                         f"{MAX_BAD_WORDS}")
    total = sum(map(len, sequences))
    if total > MAX_BAD_WORD_TOKENS:
        raise ValueError(f"bad_words make {total} tokens; at most {MAX_BAD_WORD_TOKENS}")
    outside = sorted({t for s in sequences for t in s if not 0 <= t < vocab_size})
    if outside:
        raise ValueError(f"bad_words tokenize to ids {outside[:5]} outside the model's "
                         f"vocabulary of {vocab_size}")
    return tuple(sequences)


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    try:
        return tuple(tokenizer.encode(text, add_special_tokens=False))
    except ValueError as e:  # text that is not valid Unicode
        raise ValueError(f"bad_words: {e}") from None


def allowed_row(token_ids: Sequence[int], vocab_size: int) -> array.array:
    """u32[ceil(V / 32)] with the bits of `token_ids` set (llguidance's layout)."""
    row = array.array("I", bytes(4 * -(-vocab_size // 32)))
    assert row.itemsize == 4, "array's 'I' is 32 bits on every platform jax runs on"
    for token in set(token_ids):
        row[token >> 5] |= 1 << (token & 31)
    return row
