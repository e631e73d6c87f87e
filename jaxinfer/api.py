"""The public Python API: `LLM(model=...)` and `LLM.generate(prompts, params)`.

In this first version requests are generated one after another through the
paged model (prompt in one step, then one token per step); the
continuous-batching engine replaces the inside later, not the signature.
Imports checkpoint, tokenizer, engine.runner and engine.request.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from jaxinfer import checkpoint
from jaxinfer.engine.request import RequestOutput, SamplingParams
from jaxinfer.engine.runner import Chunk, Runner, resolve_kv_dtype
from jaxinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL = pathlib.Path(__file__).resolve().parent.parent / "checkpoints" / "demo"
Prompt = str | Sequence[int]


class LLM:
    """A model, its tokenizer and the device state to generate with them."""

    def __init__(self, model: str | os.PathLike = DEFAULT_MODEL, *, dtype: str = "float32",
                 max_model_len: int | None = None, page_size: int = 16,
                 kv_cache_dtype: str = "auto", seed: int = 0) -> None:
        self.model_dir = pathlib.Path(model)
        self.config = checkpoint.load_config(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        limit = self.config.max_position_embeddings
        self.max_model_len = limit if max_model_len is None else max_model_len
        if not 0 < self.max_model_len <= limit:
            raise ValueError(f"max_model_len={max_model_len} must be in [1, {limit}] "
                             f"(the model's max_position_embeddings)")
        if page_size <= 0:
            raise ValueError(f"{page_size=} must be > 0")
        params = checkpoint.load_params(self.model_dir, self.config, dtype)
        pages_per_seq = -(-self.max_model_len // page_size)
        self.runner = Runner(self.config, params, num_pages=1 + pages_per_seq,
                             page_size=page_size, max_model_len=self.max_model_len,
                             kv_dtype=resolve_kv_dtype(kv_cache_dtype, dtype))
        self._free_pages = list(range(1, 1 + pages_per_seq))  # page 0 is the trash page
        self._rng = np.random.default_rng(seed)
        self._next_id = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every request is checked first."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        token_lists = [self._prompt_ids(i, p) for i, p in enumerate(prompt_list)]
        return [self._generate_one(prompt, ids, sp)
                for prompt, ids, sp in zip(prompt_list, token_lists, params, strict=True)]

    def _prompt_ids(self, index: int, prompt: Prompt) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        bad = [t for t in ids if not isinstance(t, int | np.integer)
               or not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token ids outside [0, "
                             f"{self.config.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; max_model_len "
                             f"{self.max_model_len} leaves no room to generate")
        return [int(t) for t in ids]

    def _generate_one(self, prompt: Prompt, ids: list[int],
                      sp: SamplingParams) -> RequestOutput:
        out = RequestOutput(request_id=str(self._next_id),
                            prompt=prompt if isinstance(prompt, str) else None,
                            prompt_token_ids=ids,
                            logprobs=[] if sp.logprobs is not None else None)
        self._next_id += 1
        seed = sp.seed if sp.seed is not None else int(self._rng.integers(2**31))
        budget = min(len(ids) + sp.max_tokens, self.max_model_len)
        pages = self._free_pages[:-(-budget // self.runner.page_size)]
        chunk = Chunk(ids, 0, pages)
        while out.finish_reason is None:
            sample = self.runner.execute([chunk], [sp], [len(out.token_ids)], [seed])
            token = int(sample.token_ids[0])
            out.token_ids.append(token)
            if out.logprobs is not None:
                top = dict(zip(sample.top_ids[0, :sp.logprobs].tolist(),
                               sample.top_logprobs[0, :sp.logprobs].tolist(), strict=True))
                out.logprobs.append(top | {token: float(sample.logprobs[0])})
            out.finish_reason = self._finish_reason(sp, token, len(ids), len(out.token_ids))
            chunk = Chunk([token], len(ids) + len(out.token_ids) - 1, pages)
        out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return out

    def _finish_reason(self, sp: SamplingParams, token: int, num_prompt: int,
                       num_generated: int) -> str | None:
        if token in sp.stop_token_ids:
            return "stop"
        if not sp.ignore_eos and token in self.tokenizer.eos_token_ids:
            return "stop"
        if num_generated >= sp.max_tokens or num_prompt + num_generated >= self.max_model_len:
            return "length"
        return None


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int | np.integer) for t in prompts):
        return [prompts]
    for i, p in enumerate(prompts):
        if not isinstance(p, str | list | tuple | np.ndarray):
            raise TypeError(f"prompt {i} is a {type(p).__name__}; expected str or token ids")
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None,
                    count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] is a {type(p).__name__}, "
                            "not SamplingParams")
    return params
