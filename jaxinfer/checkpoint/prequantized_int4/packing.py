"""How AWQ and GPTQ pack 4-bit codes into int32 words, and jaxinfer's int4 byte pairs:
numpy only, for any slice of a tensor. See
docs/quantization.md#pre-quantized-awq-and-gptq-checkpoints.
"""

from __future__ import annotations

import numpy as np

PER_WORD = 8  # 4-bit codes in an int32 word
# AutoAWQ's GEMM order: nibble i (bits 4i..4i+3) of a word holds column AWQ_ORDER[i] of
# the word's 8 output columns
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(c) for c in range(PER_WORD))  # 0 4 1 5 2 6 3 7


def nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [..., n] -> uint8 [..., n, 8]: nibble i of each word, lowest first."""
    bits = np.asarray(words).astype(np.uint32, copy=False)  # int32 and uint32 alike
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return ((bits[..., None] >> shifts) & 0xF).astype(np.uint8)


def columns(words: np.ndarray, method: str) -> np.ndarray:
    """Words [rows, n] packing 8 output columns each -> codes uint8 [rows, 8n] in column
    order: AWQ's qweight and qzeros and GPTQ's qzeros (nibbles in order)."""
    codes = nibbles(words)
    if method == "awq":
        codes = codes[..., list(AWQ_NIBBLE_OF_COLUMN)]
    return codes.reshape(codes.shape[0], -1)


def gptq_rows(words: np.ndarray) -> np.ndarray:
    """GPTQ's qweight [n, O], 8 input rows a word (nibble k: row 8r + k) -> uint8 [8n, O]."""
    codes = nibbles(words)  # [n, O, 8]
    return codes.swapaxes(1, 2).reshape(-1, codes.shape[1])


def output_words(start: int, stop: int) -> tuple[slice, slice]:
    """(words covering output columns [start, stop), those columns within their codes)."""
    first = start // PER_WORD
    return (slice(first, -(-stop // PER_WORD)),
            slice(start - first * PER_WORD, stop - first * PER_WORD))


def pack_pairs(codes: np.ndarray) -> np.ndarray:
    """codes uint8 [..., 2n] -> [..., n] bytes: even inputs in the low nibble, as
    model/quantization.py's int4 stores rows 2i and 2i + 1."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
