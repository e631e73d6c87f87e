"""`PoolingParams` (vLLM's): what one pooling request asks beyond the model's defaults,
checked against the model's pooler (config/pooling.py). See docs/pooling.md#parameters.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config.pooling import PoolerConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolingParams:
    """`dimensions`: a Matryoshka size to cut the embedding to (the model must declare
    it); `normalize`: unit-length embeddings (None: the model's default); `activation`:
    sigmoid (one label) or softmax over a classifier's logits (None: on, as vLLM);
    `truncate_prompt_tokens`: cut longer inputs to that many tokens (-1: to
    max_model_len) instead of refusing them."""

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def check(self, pooler: PoolerConfig, hidden_size: int, max_model_len: int) -> None:
        """Raise ValueError naming the field unless the model can honour these."""
        if self.dimensions is not None:
            if not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool):
                raise ValueError(f"dimensions={self.dimensions!r} must be an int")
            if pooler.dimensions is None:
                raise ValueError("dimensions: this model does not support Matryoshka "
                                 "embeddings (its config.json declares no "
                                 "matryoshka_dimensions)")
            if self.dimensions not in pooler.dimensions or self.dimensions > hidden_size:
                raise ValueError(f"dimensions={self.dimensions} is not one of the model's "
                                 f"Matryoshka sizes {_sizes(pooler.dimensions)}")
        cut = self.truncate_prompt_tokens
        if cut is not None and (isinstance(cut, bool) or not isinstance(cut, int)
                                or cut == 0 or cut < -1 or cut > max_model_len):
            raise ValueError(f"truncate_prompt_tokens={cut!r} must be -1 or in [1, "
                             f"max_model_len={max_model_len}]")

    def max_length(self, max_model_len: int) -> int | None:
        """The length inputs are cut to, or None (longer inputs are refused)."""
        if self.truncate_prompt_tokens is None:
            return None
        return max_model_len if self.truncate_prompt_tokens == -1 else (
            self.truncate_prompt_tokens)


def _sizes(dimensions: tuple[int, ...]) -> str:
    if len(dimensions) > 8 and dimensions == tuple(range(1, len(dimensions) + 1)):
        return f"1..{len(dimensions)}"
    return str(list(dimensions))
