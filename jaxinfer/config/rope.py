"""RoPE frequency scaling: `RopeScaling` (Llama 3's, linear) and `YarnScaling`, read from
an HF `config.json`'s `rope_parameters` or legacy `rope_theta` / `rope_scaling` keys.

Any family may use any of these rope types; the families' readers (config/families/)
call `rope_from_hf`. The frequencies themselves are computed in model/layers.py and
model/yarn.py; docs/architecture.md#model-families.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ROPE_TYPES = ("default", "llama3", "linear")  # and "yarn": YarnScaling


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Frequency scaling of RoPE: Llama-3's (`rope_type = "llama3"`, the factors below) or
    linear position interpolation (`"linear"`: every frequency divided by `factor`)."""

    rope_type: str = "llama3"
    factor: float
    low_freq_factor: float | None = None  # llama3 only, as the two below
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(f"{self.rope_type=} must be one of {ROPE_TYPES[1:]}")
        if self.factor <= 0:
            raise ValueError(f"{self.factor=} must be > 0")
        if self.rope_type == "llama3":
            self._check_llama3()

    def _check_llama3(self) -> None:
        names = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"llama3 rope scaling lacks {missing}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"{self.high_freq_factor=} must be > {self.low_freq_factor=}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"{self.original_max_position_embeddings=} must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN RoPE (`rope_type = "yarn"`), as transformers' `_compute_yarn_parameters`:
    inverse frequencies blended between the original and the `factor`-interpolated ones
    by a linear ramp over the dimensions whose rotations within the original context
    fall between `beta_slow` and `beta_fast`, and cos/sin scaled by `attention_factor`
    (None: 0.1 * ln(factor) + 1, or the mscale ratio when both mscales are given)."""

    rope_type: str = "yarn"
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # transformers' default when config.json leaves it out
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type != "yarn":
            raise ValueError(f"{self.rope_type=} must be 'yarn'")
        if not self.factor > 0:
            raise ValueError(f"yarn {self.factor=} must be > 0")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"yarn {self.original_max_position_embeddings=} must be > 0")

    def cos_sin_scale(self) -> float:
        """The factor on cos and sin (transformers' `attention_scaling`)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)


def scaling_of(fields: dict[str, Any]) -> RopeScaling | YarnScaling:
    """The scaling a preset's `rope_scaling` table describes (its own field names)."""
    return (YarnScaling if fields.get("rope_type") == "yarn" else RopeScaling)(**fields)


def rope_from_hf(hf: dict[str, Any], default_theta: float = 10000.0
                 ) -> tuple[float, RopeScaling | YarnScaling | None]:
    """(theta, scaling) of a config.json: `rope_parameters` (transformers >= 5) or
    `rope_theta` / `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    params = {**legacy, **params}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "yarn":
        return float(theta), yarn_from_hf(params)
    if kind not in ROPE_TYPES:
        raise ValueError(f"config.json rope_type={kind!r} is not supported; use one of "
                         f"{ROPE_TYPES}")
    if kind == "default":
        return float(theta), None
    names = [f.name for f in dataclasses.fields(RopeScaling) if f.name != "rope_type"]
    if kind == "linear":
        names = ["factor"]
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"config.json {kind} rope scaling lacks {missing}")
    return float(theta), RopeScaling(rope_type=kind, **{n: params[n] for n in names})


def yarn_from_hf(params: dict[str, Any]) -> YarnScaling:
    """YarnScaling of a config.json's merged rope parameters; errors name the field."""
    missing = [n for n in ("factor", "original_max_position_embeddings") if n not in params]
    if missing:
        raise ValueError(f"config.json yarn rope scaling lacks {missing}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json partial_rotary_factor is not supported with yarn")
    names = [f.name for f in dataclasses.fields(YarnScaling) if f.name != "rope_type"]
    given = {n: params[n] for n in names if params.get(n) is not None}
    # transformers: `beta_fast or 32`, `beta_slow or 1` (a 0 means the default too)
    for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        given[name] = float(given.get(name) or default)
    return YarnScaling(**given)


def rope_to_hf(theta: float, scaling: RopeScaling | YarnScaling | None) -> dict[str, Any]:
    """The `rope_parameters` dict `rope_from_hf` reads back to (theta, scaling)."""
    rope: dict[str, Any] = {"rope_theta": theta, "rope_type": "default"}
    if scaling is not None:
        rope |= {k: v for k, v in dataclasses.asdict(scaling).items() if v is not None}
    return rope
