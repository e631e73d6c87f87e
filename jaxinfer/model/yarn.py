"""YaRN RoPE frequencies (gpt-oss), as transformers' `_compute_yarn_parameters`, in
float32 like transformers so the tables agree with its to float32 rounding.
See docs/moe.md#gpt-oss.
"""

from __future__ import annotations

import math

import numpy as np


def inv_freq(head_dim: int, theta: float, scaling: object) -> np.ndarray:
    """f32[H/2] for a `config.rope.YarnScaling`."""
    dim, base = head_dim, theta
    old_len = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(scaling.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1)
    keep = np.float32(1.0) - ramp  # the share of the original frequency
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
