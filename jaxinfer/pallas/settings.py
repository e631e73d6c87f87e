"""The static settings of one ragged paged attention call, in one frozen record that the
entry point (dispatch.py), the reference and both kernels take; docs/kernels.md.

The arrays a call reads (queries, pages, metadata, per-token `kv_scales`, `sinks`) stay
arguments; everything fixed at trace time is here. A model fills in its layer's
scale, window, soft cap and heads; the engine chooses `impl` and `interpret`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

IMPLS = ("auto", "tpu", "gpu", "reference")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSettings:
    """How a call attends (hashable: jit may take it as a static argument)."""

    sm_scale: float = 1.0  # scores are q . k x sm_scale
    sliding_window: int | None = None  # a query at q sees keys > q - sliding_window
    soft_cap: float | None = None  # scores capped to cap x tanh(score / cap) first
    mask_value: float | None = None  # a masked score; None: the implementation's
    k_scale: float | None = None  # 8-bit pages: one scale per cache (or `kv_scales`)
    v_scale: float | None = None
    num_kv_heads: int | None = None  # real heads when 8-bit pages pad an odd count
    max_q_len: int = 0  # a promise that no request has more query tokens; 0: any
    fixed_order: bool = False  # the reference's dots as products summed in one order,
    # whatever the step's shape (batch-invariant mode, docs/rl.md#batch-invariant-mode)
    impl: str = "auto"  # "tpu", "gpu", "reference", or "auto": the backend's kernel
    interpret: bool | Any = False  # a Pallas kernel in interpret mode (TPU: or its
    # InterpretParams, as given)


DEFAULT_SETTINGS = AttentionSettings()  # impl "auto", no window, cap or scales
