"""A request's way in, as `Engine` methods: its prompt tokenized and checked, its
sampling parameters checked against the engine, its adapter loaded (`prepare`), before
anything is queued. Plain Python. See docs/sampling.md#the-python-api.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxinfer.engine import checks
from jaxinfer.engine.request import PreparedRequest, SamplingParams
from jaxinfer.text.tokenizer import TooLong


class RequestIntake:
    """Mixed into `Engine` (whose `check_params` knows the runner's limits)."""

    def prompt_token_ids(self, prompt: str | Sequence[int] | None = None,
                         messages: list[dict] | None = None, *,
                         add_generation_prompt: bool = True,
                         truncate: int | None = None, **chat: object) -> list[int]:
        """Token ids of a text prompt, a token-id prompt, or chat messages, `truncate`d to
        their last tokens (vLLM's truncate_prompt_tokens); checked. `chat`: the chat
        template's options (Tokenizer.prompt_ids: tools, continue_final_message,
        template_kwargs)."""
        if self.tokenizer is not None:
            try:  # a prompt to truncate may be long: its length is checked once cut
                ids = self.tokenizer.prompt_ids(prompt, messages,
                                                add_generation_prompt=add_generation_prompt,
                                                max_tokens=None if truncate else
                                                self.max_model_len - 1, **chat)
            except TooLong as e:
                raise ValueError(f"{e}; max_model_len {self.max_model_len} leaves no room "
                                 "to generate") from None
        elif messages is not None or isinstance(prompt, str):
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True): "
                             "give prompts as token ids, not text or chat messages")
        else:
            ids = list(prompt if prompt is not None else [])
        ids = ids[-truncate:] if truncate else ids
        return checks.check_prompt(ids, max_model_len=self.max_model_len,
                                   vocab_size=self.model_config.vocab_size)

    def prepare(self, prompt: str | Sequence[int] | None = None,
                params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                prompt_token_ids: list[int] | None = None,
                lora_request: object = None) -> PreparedRequest:
        """A request checked and its prompt tokenized (`prompt_token_ids`, from
        `prompt_token_ids()`, saves tokenizing it again), the engine unchanged: the faces
        check a whole batch, or prepare off the engine's thread, before adding any. No
        `params`: `default_params` (the checkpoint's generation_config.json values)."""
        params = params if params is not None else self.default_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params is a {type(params).__name__}, not SamplingParams")
        grammar, token_filter = self.check_params(params)
        truncate = params.truncate_prompt_tokens
        ids = prompt_token_ids[-truncate:] if prompt_token_ids and truncate else (
            prompt_token_ids or self.prompt_token_ids(prompt, messages, truncate=truncate))
        if params.max_tokens is None:  # vLLM's: what the context leaves after the prompt
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(ids))
        return PreparedRequest(prompt=prompt, prompt_token_ids=ids, params=params,
                               grammar=grammar, token_filter=token_filter,
                               lora=self.adapter_of(lora_request))
