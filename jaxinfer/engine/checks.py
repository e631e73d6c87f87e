"""A request's checks against the engine it is sent to: its prompt's token ids and the
limits of its sampling parameters beyond SamplingParams' own. Plain Python; each error
names the field, so the faces turn it into a 400 (docs/sampling.md#sampling-parameters).
"""

from __future__ import annotations

from collections.abc import Collection

from jaxinfer.config import EngineConfig
from jaxinfer.engine.request import SamplingParams, token_id


def check_prompt(ids: list, *, max_model_len: int, vocab_size: int) -> list[int]:
    """The prompt's token ids as ints; ValueError if empty, too long or out of vocab."""
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= max_model_len:  # before looking at each id: bounded work
        raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len "
                         f"{max_model_len} leaves no room to generate")
    tokens = [token_id(t) for t in ids]
    bad = [t for t, i in zip(ids, tokens, strict=True) if i is None or not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids outside [0, {vocab_size}): {bad[:5]}")
    return tokens


def check_params(params: SamplingParams, *, config: EngineConfig, has_tokenizer: bool,
                 vocab_size: int, eos_token_ids: Collection[int], stop_width: int) -> None:
    """Engine-level limits of sampling parameters (beyond SamplingParams' own);
    `stop_width`: the stop ids a device row holds (runner.STOP_WIDTH)."""
    if params.prompt_logprobs is not None and not config.enable_prompt_logprobs:
        raise ValueError(f"prompt_logprobs={params.prompt_logprobs} needs an engine made "
                         "with enable_prompt_logprobs=True (LLM(..., "
                         "enable_prompt_logprobs=True), --enable_prompt_logprobs)")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True): "
                         "use stop_token_ids")
    if params.bad_words and not has_tokenizer:
        raise ValueError("bad_words need a tokenizer (skip_tokenizer_init=True): use "
                         "allowed_token_ids or logit_bias")
    if params.structured_outputs is not None and not has_tokenizer:
        raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init=True)")
    for name in ("top_k", "max_tokens", "min_tokens"):  # the device reads them as int32
        if (getattr(params, name) or 0) >= 2**31:
            raise ValueError(f"{name}={getattr(params, name)} must be < 2**31")
    outside = [t for t in params.stop_token_ids if t >= vocab_size]
    if outside:
        raise ValueError(f"stop_token_ids={outside[:5]} must be token ids below {vocab_size}")
    outside = sorted(t for t in params.logit_bias or () if t >= vocab_size)
    if outside:
        raise ValueError(f"logit_bias keys {outside[:5]} must be token ids below {vocab_size}")
    outside = sorted({t for t in params.allowed_token_ids or () if t >= vocab_size})
    if outside:
        raise ValueError(f"allowed_token_ids={outside[:5]} must be token ids below "
                         f"{vocab_size}")
    stops = len(params.stop_token_ids) + len(eos_token_ids)
    if params.min_tokens and stops > stop_width:
        raise ValueError(f"min_tokens with {stops} stop ids: at most {stop_width} "
                         "(stop_token_ids plus EOS ids)")

