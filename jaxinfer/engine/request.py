"""SamplingParams, the Request state, and the outputs. Plain Python, no jax.

Invalid sampling values are refused when `SamplingParams` is built, with the
field named, so a bad request never reaches the device. A `Request` is one
completion being generated: `n` > 1 in SamplingParams fans out into n of them.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import operator

from jaxinfer.engine.structured import StructuredOutputsParams

MAX_LOGPROBS = 20  # top-k logprobs the device step computes when some row asks
MAX_LOGIT_BIAS = 300  # logit_bias pairs per request (OpenAI's limit); a slot holds as many
MAX_BAD_WORDS = 128  # bad_words token sequences per request (vLLM's VLLM_MAX_NUM_BAD_WORDS)
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS; vLLM also raises those
# in (0, 0.01) to 0.01, jaxinfer samples them as given). The device's softmax is finite
# at any temperature; below 1e-5 its draw is the argmax but for exact ties, and float32
# holds temperatures under 1.2e-38 differently on each backend (flushed or subnormal).
GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's names and meanings)."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the context (max_model_len), as vLLM
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1 (vLLM's): off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # top-k logprobs per token, the chosen one always added; -1: the whole vocabulary
    # (vLLM's), refused beyond MAX_LOGPROBS as vLLM's default max_logprobs refuses it
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k per prompt token; the prompt token always added
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # one output constraint (engine/structured/params.py); None: unconstrained
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> a number in [-100, 100] added to its logit before sampling (OpenAI's)
    logit_bias: dict[int, float] | None = None
    # vLLM's token filters, applied with the host's token mask (engine/structured/
    # token_filter.py): words never generated, and the only token ids that may be
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's output options (docs/sampling.md#sampling-parameters)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # vLLM's slow-tokenizer option; fast tokenizers (tokenizer.json) decode special
    # tokens without added spaces either way, as vLLM's fast path does
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens

    def __post_init__(self) -> None:
        object.__setattr__(self, "structured_outputs",
                           StructuredOutputsParams.parse(self.structured_outputs))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "bad_words", _bad_words(self.bad_words))
        object.__setattr__(self, "allowed_token_ids", _allowed_ids(self.allowed_token_ids))
        for name, ok, rule in _checks(self):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} must be {rule}")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below GREEDY_TEMPERATURE: the argmax, no draw."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_token_mask(self) -> bool:
        """Whether the host fills this request's token mask each step (structured
        outputs, bad_words, allowed_token_ids): it never speculates, and a step that
        samples it waits for its last token (docs/structured_outputs.md#how-it-works)."""
        return (self.structured_outputs is not None or bool(self.bad_words)
                or self.allowed_token_ids is not None)

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


def fold_seed(seed: int, index: int) -> int:
    """The device seed, in [0, 2**31), of completion `index` of a request seeded `seed` (a
    64-bit seed, signed or not, as OpenAI and vLLM take). A seed in [0, 2**31) keeps the
    draws it always had, `(seed + index) % 2**31`; any other is hashed with the index, so
    seeds that differ by 2**31 draw apart (the modulo alone made them one)."""
    if 0 <= seed < 2**31:
        return (seed + index) % 2**31
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


def _checks(p: SamplingParams) -> list[tuple[str, bool, str]]:
    return [
        ("n", _is_int(p.n) and p.n >= 1, "an int >= 1"),
        ("max_tokens", p.max_tokens is None or (_is_int(p.max_tokens) and p.max_tokens >= 1),
         "None (up to the context) or an int >= 1"),
        ("min_tokens", _is_int(p.min_tokens) and 0 <= p.min_tokens <= (
            p.max_tokens if p.max_tokens is not None else 2**31), "an int in [0, max_tokens]"),
        ("temperature", _is_real(p.temperature) and p.temperature >= 0, "a finite number >= 0"),
        ("top_k", _is_int(p.top_k) and p.top_k >= 0, "an int >= 0 (0 or -1 disables it)"),
        ("top_p", _is_real(p.top_p) and 0 < p.top_p <= 1, "in (0, 1]"),
        ("min_p", _is_real(p.min_p) and 0 <= p.min_p <= 1, "in [0, 1]"),
        ("repetition_penalty", _is_real(p.repetition_penalty) and p.repetition_penalty > 0,
         "a finite number > 0"),
        ("presence_penalty", _is_real(p.presence_penalty) and -2 <= p.presence_penalty <= 2,
         "in [-2, 2]"),
        ("frequency_penalty", _is_real(p.frequency_penalty) and -2 <= p.frequency_penalty <= 2,
         "in [-2, 2]"),
        ("seed", p.seed is None or (_is_int(p.seed) and -2**63 <= p.seed < 2**64),
         "None or an int in [-2**63, 2**64)"),
        ("logprobs", p.logprobs is None or (_is_int(p.logprobs)
                                            and 0 <= p.logprobs <= MAX_LOGPROBS),
         f"None or an int in [0, {MAX_LOGPROBS}]"
         + (" (-1, the whole vocabulary, is more than that)" if p.logprobs == -1 else "")),
        ("prompt_logprobs", p.prompt_logprobs is None or (
            _is_int(p.prompt_logprobs) and 0 <= p.prompt_logprobs <= MAX_LOGPROBS),
         f"None or an int in [0, {MAX_LOGPROBS}]"),
        ("stop", all(isinstance(s, str) and s for s in p.stop), "non-empty strings"),
        ("stop_token_ids", all(_is_int(t) and t >= 0 for t in p.stop_token_ids),
         "non-negative ints"),
        *[(name, isinstance(getattr(p, name), bool), "a bool") for name in (
            "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
            "spaces_between_special_tokens", "detokenize")],
        ("truncate_prompt_tokens", p.truncate_prompt_tokens is None or (
            _is_int(p.truncate_prompt_tokens) and p.truncate_prompt_tokens >= 1),
         "None or an int >= 1"),
        ("stop", p.detokenize or not p.stop, "empty when detokenize=False (stop strings "
         "match text)"),
    ]


def _logit_bias(bias: object) -> dict[int, float] | None:
    """`logit_bias` with int keys (JSON gives strings); ValueError naming a bad entry."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, not "
                         f"{type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias key {key!r} must be a token id (an int >= 0)")
        if not _is_real(value) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias[{key!r}]={value!r} must be a number in [-100, 100]")
        out[token] = float(value)
    return out


def _sequence(name: str, value: object) -> tuple:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list, not {type(value).__name__}")
    return tuple(value)


def _bad_words(words: object) -> tuple[str, ...]:
    """`bad_words` as a tuple (one string: one word, as `stop`); ValueError naming a bad
    entry. MAX_BAD_WORDS bounds the words here and their token sequences once tokenized."""
    words = _sequence("bad_words", (words,) if isinstance(words, str) else words)
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS}")
    bad = [w for w in words if not isinstance(w, str) or not w]
    if bad:
        raise ValueError(f"bad_words entries {bad[:5]!r} must be non-empty strings")
    return words


def _allowed_ids(ids: object) -> tuple[int, ...] | None:
    """`allowed_token_ids` as a tuple; ValueError naming a bad entry (the list may hold
    the whole vocabulary: the message shows only the first few)."""
    if ids is None:
        return None
    ids = _sequence("allowed_token_ids", ids)
    if not ids:
        raise ValueError("allowed_token_ids must be None or a non-empty list of token ids")
    bad = [t for t in ids if not _is_int(t) or t < 0]
    if bad:
        raise ValueError(f"allowed_token_ids entries {bad[:5]} must be token ids "
                         "(ints >= 0)")
    return ids


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A request checked and tokenized (`Engine.prepare`), ready to add."""

    prompt: str | list[int] | None  # as given (text is echoed in outputs)
    prompt_token_ids: list[int]
    params: SamplingParams
    # the constraint's compiled matcher (engine/structured/grammar.py), copied for each completion
    grammar: object | None = dataclasses.field(default=None, compare=False, repr=False)
    # its token filter (engine/structured/token_filter.py), shared by its completions
    token_filter: object | None = dataclasses.field(default=None, compare=False, repr=False)
    lora: object = None  # its LoRARequest (jaxinfer/lora/); None: the base model


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A token's logprob, its rank in the vocabulary (1 = most likely; 1 + the tokens with
    a strictly higher logprob) and its text, as vLLM's `Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]  # None for the first prompt token
MIN_JSON_LOGPROB = -9999.0  # what -inf becomes in JSON, as vLLM and OpenAI send it


def prompt_logprobs_json(entries: PromptLogprobs) -> list[dict[str, dict] | None]:
    """vLLM's JSON of prompt logprobs (the server's `prompt_logprobs`, the batch runner's
    records): per prompt token None (the first) or {str(token id): {"logprob", "rank",
    "decoded_token"}}, the prompt token first, then the top k; -inf as -9999.0."""
    return [None if entry is None else {
        str(token): {"logprob": max(lp.logprob, MIN_JSON_LOGPROB), "rank": lp.rank,
                     "decoded_token": lp.decoded_token} for token, lp in entry.items()}
        for entry in entries]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False, kw_only=True)
class Request:
    """One completion in flight: its tokens, progress through the KV cache, pages."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # order of arrival; ties in priority go to the earlier
    seed: int  # in [0, 2**31): params.seed (or one drawn when added) and the index, folded
    priority: int = 0  # lower runs first, as in vLLM
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache or a step in flight
    # Tokens sampled by steps in flight, not yet read by the host (asynchronous scheduling):
    # they follow output_token_ids, and the next step feeds them from the device.
    num_output_placeholders: int = 0
    # Its KV page ids in each page group (engine/core/kv_groups.py), group 0 the one that
    # keeps every page: entry i of a group's list is its logical page i, 0 where a page no
    # query sees any more was given back. [] while it holds no pages.
    page_ids: list[list[int]] = dataclasses.field(default_factory=list)
    page_serials: list[int] = dataclasses.field(default_factory=list)  # of full cached pages
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served, once set
    group: str = ""  # the prompt's id when n > 1: siblings share its cached pages
    parent_id: str = ""  # the prompt's id (add_request's); request_id is parent_id#index
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    # Scored prompt tokens 1, 2, ... (entry i: token i + 1, scored at position i) when
    # this request collects its prompt's logprobs (the first of n completions); else None.
    prompt_logprobs: list[dict[int, Logprob]] | None = None
    # The LoRA adapter it runs with (a jaxinfer.lora.LoRARequest; None: the base model),
    # and the device slot it holds while admitted (-1: none; jaxinfer/lora/slots.py).
    lora: object = None
    adapter_slot: int = -1

    @property
    def cache_key(self) -> tuple[str, int] | None:
        """What its prefix-cache pages are keyed by besides tokens: its adapter."""
        return None if self.lora is None else ("lora", self.lora.lora_int_id)

    @property
    def scoring_prompt(self) -> bool:
        """Whether prompt positions are still to be scored (`prompt_logprobs`): such a
        request computes its whole prompt, taking no prefix-cache hits."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must eventually hold."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without copying the rest of the context."""
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        if start >= prompt:
            return self.output_token_ids[start - prompt:end - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt]

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority, then arrival."""
        return (self.priority, self.arrival)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclasses.dataclass(kw_only=True)
class CompletionOutput:
    """One of the `n` completions of a prompt."""

    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: it and the top k (vLLM's)
    # the sum of the chosen tokens' logprobs (vLLM's); None unless logprobs were asked
    cumulative_logprob: float | None = None
    delta_text: str = ""  # text added by the last step (held back near a stop string)
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class RequestOutput:
    """What one prompt produced. `text`, `token_ids`, ... are those of outputs[0]."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first,
    # else {token_id: Logprob} of that prompt token and the top k; set once all are scored.
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


def token_id(token: object) -> int | None:
    """A prompt entry as a token id (ints and numpy ints alike), or None if not one."""
    try:
        return operator.index(token)
    except TypeError:
        return None
