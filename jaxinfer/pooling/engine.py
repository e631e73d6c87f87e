"""`PoolingEngine`: a pooling model served, whatever its kind: an encoder (BERT,
XLM-RoBERTa) packed into dense steps (encoder_runner.py), or a decoder through the paged
engine (engine/pooled.py), each prompt chunked as the scheduler chunks it. It tokenizes
and checks inputs, pools them, and makes embeddings and classifier outputs of the
pooled states. See docs/pooling.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pathlib
import time
from collections.abc import Sequence

import numpy as np

from jaxinfer.checkpoint.encoder import load_encoder_params
from jaxinfer.config import EngineConfig
from jaxinfer.config.encoder import EncoderConfig, is_encoder
from jaxinfer.config.pooling import PoolerConfig, read_pooler_config
from jaxinfer.engine import loading
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import PreparedRequest, SamplingParams
from jaxinfer.pooling import packing
from jaxinfer.pooling.encoder_runner import EncoderRunner
from jaxinfer.pooling.params import PoolingParams
from jaxinfer.text.tokenizer import Tokenizer, read_json

log = logging.getLogger(__name__)
Input = tuple[list[int], list[int]]  # token ids and token type ids
# a decoder's pooling request: one token "sampled" and never computed (engine/pooled.py)
_POOL_REQUEST = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


@dataclasses.dataclass(frozen=True)
class Pooled:
    """One input's hidden states pooled as the model pools: f32[D] (f32[n, D] for
    pooling "all"), and its classifier's logits f32[num_labels] ([0]: none)."""

    vector: np.ndarray
    logits: np.ndarray


@dataclasses.dataclass
class PoolingMetrics:
    """What `LLM.metrics()` reports for a pooling model: its calls so far."""

    batches: int = 0  # pool() calls
    inputs: int = 0
    input_tokens: int = 0
    seconds: float = 0.0
    padding: object = None  # () -> (real, padded) tokens of the steps run so far

    def summary(self) -> dict[str, float | int]:
        real, padded = self.padding() if self.padding else (0, 0)
        return {"pooling_batches": self.batches, "pooled_inputs": self.inputs,
                "input_tokens": self.input_tokens, "pooling_seconds": round(self.seconds, 3),
                "input_tokens_per_s": round(self.input_tokens / max(self.seconds, 1e-9), 1),
                "padding_waste": round(1 - real / max(padded, 1), 4)}


class PoolingEngine:
    """A pooling model: `inputs` (tokenize and check), `pool`, `embedding`,
    `probabilities`; `metrics` (PoolingMetrics)."""

    def __init__(self, model: str | os.PathLike, config: EngineConfig, *,
                 warm_up: bool = True) -> None:
        root = pathlib.Path(model)
        hf = read_json(root / "config.json")
        self.model_dir, self.config = root, config
        self.is_encoder = is_encoder(hf)
        self.pooler = read_pooler_config(root, hf, default_type=(
            "cls" if self.is_encoder else "last"))
        if self.is_encoder:
            self.backend: _Encoder | _Decoder = _Encoder(root, hf, config, self.pooler)
        else:
            self.backend = _Decoder(root, config, self.pooler)
        self.tokenizer: Tokenizer | None = self.backend.tokenizer
        self.max_model_len = self.backend.max_model_len
        self.hidden_size, self.num_labels = self.backend.hidden_size, self.backend.num_labels
        self.vocab_size = self.backend.vocab_size
        self.metrics = PoolingMetrics(padding=self.backend.padding)
        if warm_up:
            self.backend.warm_up()

    # ---- inputs ---------------------------------------------------------------------

    def inputs(self, prompt: str | Sequence[int], pair: str | None = None, *,
               params: PoolingParams | None = None,
               prompt_name: str | None = None) -> Input:
        """(ids, type ids) of a text (with the model's prompt `prompt_name`, else its
        default prompt), a (text, pair) for a cross-encoder, or token ids; checked."""
        limit = (params or PoolingParams()).max_length(self.max_model_len)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True): "
                                 "give inputs as token ids")
            text = self.prompt_prefix(prompt_name) + prompt
            ids, types = self.tokenizer.encode_for_pooling(text, pair, max_length=limit)
        else:
            ids = [int(t) for t in prompt][:limit]  # limit None: the whole input
            types = [0] * len(ids)
        return self._checked(ids), list(types)

    def prompt_prefix(self, prompt_name: str | None) -> str:
        """The text put before an input: sentence-transformers' prompt of that name, or
        the model's default prompt (empty when it has none)."""
        name = prompt_name or self.pooler.default_prompt_name
        if name is None:
            return ""
        if name not in self.pooler.prompts:
            raise ValueError(f"prompt_name={name!r} is not one of the model's prompts "
                             f"{sorted(self.pooler.prompts)}")
        return self.pooler.prompts[name]

    def _checked(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("the input is empty")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the input has {len(ids)} tokens, more than max_model_len "
                             f"{self.max_model_len} (truncate_prompt_tokens cuts it)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {self.vocab_size})")
        return ids

    # ---- pooling --------------------------------------------------------------------

    def pool(self, inputs: Sequence[Input]) -> list[Pooled]:
        """Every input's pooled hidden states, in order (one batch: packed or stepped
        together)."""
        if not inputs:
            return []
        began = time.perf_counter()
        pooled = self.backend.pool(list(inputs))
        metrics = self.metrics
        metrics.batches += 1
        metrics.inputs += len(inputs)
        metrics.input_tokens += sum(len(ids) for ids, _ in inputs)
        metrics.seconds += time.perf_counter() - began
        return pooled

    def embedding(self, pooled: Pooled, params: PoolingParams) -> np.ndarray:
        """The embedding: cut to `dimensions`, then normalized (the model's default or
        `normalize`), as vLLM does."""
        vector = pooled.vector
        if params.dimensions is not None:
            vector = vector[..., :params.dimensions]
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        if normalize:
            norm = np.linalg.norm(vector, axis=-1, keepdims=True)
            vector = vector / np.maximum(norm, 1e-12)
        return vector.astype(np.float32)

    def probabilities(self, pooled: Pooled, params: PoolingParams) -> np.ndarray:
        """A classifier's outputs: sigmoid of one logit, softmax of several, or the raw
        logits with `activation=False`."""
        if self.num_labels == 0:
            raise ValueError("this model has no classification head: it embeds; "
                             "use embed() or score() (cosine)")
        logits = pooled.logits.astype(np.float64)
        if params.activation is False:
            return logits.astype(np.float32)
        if logits.shape[-1] == 1:
            return (1 / (1 + np.exp(-logits))).astype(np.float32)
        exp = np.exp(logits - logits.max())
        return (exp / exp.sum()).astype(np.float32)


class _Encoder:
    """BERT / XLM-RoBERTa: inputs packed into rows, one dense step per batch."""

    def __init__(self, root: pathlib.Path, hf: dict, config: EngineConfig,
                 pooler: PoolerConfig) -> None:
        config = loading.with_served_dtype(root, config)
        self.cfg = EncoderConfig.from_hf(hf)
        self.tokenizer = loading.load_tokenizer(pathlib.Path(config.tokenizer or root),
                                                skip=config.skip_tokenizer_init)
        self.max_model_len = _max_len(self.cfg.max_len, config, pooler)
        self.hidden_size, self.num_labels = self.cfg.hidden_size, self.cfg.num_labels
        self.vocab_size = self.cfg.vocab_size
        self.pooling_type = pooler.pooling_type
        params = load_encoder_params(root, self.cfg, config.dtype)
        self.ladder = packing.buckets(self.max_model_len, config.max_num_batched_tokens)
        self.runner = EncoderRunner(self.cfg, params, self.ladder,
                                    all_tokens=pooler.pooling_type == "all")
        self.padded_tokens = self.real_tokens = 0  # for the padding figure

    def warm_up(self) -> None:
        self.runner.warm_up()

    def padding(self) -> tuple[int, int]:
        return self.real_tokens, self.padded_tokens

    def pool(self, inputs: list[Input]) -> list[Pooled]:
        out: list[Pooled | None] = [None] * len(inputs)
        for batch, pooled, logits in self.runner.run(packing.pack(inputs, self.ladder)):
            self.padded_tokens += batch.bucket.num_tokens
            self.real_tokens += batch.real_tokens
            for b, index in enumerate(batch.indices):
                start, length = int(batch.starts[b]), int(batch.lengths[b])
                vector = (pooled[start:start + length] if self.pooling_type == "all"
                          else _vector(pooled[b], length, self.pooling_type))
                out[index] = Pooled(vector, logits[b])
        return out


class _Decoder:
    """A decoder without its LM head, through the paged engine: a request per input,
    its prompt chunks pooled as each step reads them back."""

    def __init__(self, root: pathlib.Path, config: EngineConfig,
                 pooler: PoolerConfig) -> None:
        if pooler.pooling_type == "all":
            raise ValueError("pooling 'all' (every token's vector) runs on encoder models; "
                             "a decoder pools last, mean or cls")
        if pooler.pooling_type != "last" and config.enable_prefix_caching:
            # a cached prefix is never computed again, so its tokens could not be pooled
            log.info("pooling %r: prefix caching off (it serves last-token pooling)",
                     pooler.pooling_type)
            config = dataclasses.replace(config, enable_prefix_caching=False)
        self.engine = Engine(root, dataclasses.replace(config, runner="pooling"),
                             warm_up=False)
        self.tokenizer = self.engine.tokenizer
        cfg = self.engine.model_config
        self.max_model_len = _max_len(self.engine.max_model_len, config, pooler)
        self.hidden_size, self.num_labels = cfg.hidden_size, cfg.num_labels
        self.vocab_size = cfg.vocab_size
        self.pooling_type = pooler.pooling_type
        self._ids = itertools.count()

    def warm_up(self) -> None:
        self.engine.warm_up()

    def padding(self) -> tuple[int, int]:
        return self.engine.metrics.real_tokens, self.engine.metrics.padded_tokens

    def pool(self, inputs: list[Input]) -> list[Pooled]:
        ids = [f"pool-{next(self._ids)}" for _ in inputs]
        try:
            for request_id, (tokens, _) in zip(ids, inputs, strict=True):
                self.engine.add_prepared(request_id, PreparedRequest(
                    prompt=None, prompt_token_ids=tokens, params=_POOL_REQUEST,
                    grammar=None, token_filter=None))
            pending = set(ids)
            while pending:
                for output in self.engine.step():
                    if output.finished:
                        pending.discard(output.request_id)
            return [self._take(request_id, len(tokens))
                    for request_id, (tokens, _) in zip(ids, inputs, strict=True)]
        finally:  # a failed call leaves none of its requests in the engine
            for request_id in ids:
                self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
            self.engine.release(request_id)
        except KeyError:  # never added, or already released by _take
            pass

    def _take(self, request_id: str, length: int) -> Pooled:
        pools = self.engine.pooled(request_id)
        output = self.engine.release(request_id)
        if pools is None or output.outputs[0].finish_reason not in ("length", "stop"):
            raise RuntimeError(f"pooling request {request_id} ended "
                               f"{output.outputs[0].finish_reason!r} without pooling")
        if self.pooling_type != "last" and pools.covered != length:
            raise RuntimeError(f"{request_id}: {pools.covered} of {length} tokens pooled")
        vector = {"last": pools.last, "cls": pools.first,
                  "mean": lambda: pools.total() / length}[self.pooling_type]()
        return Pooled(np.asarray(vector, np.float32), np.asarray(pools.scores()))


def _vector(pools: np.ndarray, length: int, pooling_type: str) -> np.ndarray:
    """f32[D] of an input's pooled f32[3, D] (first, last, sum) by the pooling type."""
    if pooling_type == "cls":
        return pools[0]
    if pooling_type == "last":
        return pools[1]
    return pools[2] / length


def _max_len(model_len: int, config: EngineConfig, pooler: PoolerConfig) -> int:
    """max_model_len: EngineConfig's, else sentence-transformers' max_seq_length, else
    the model's; never more than the model's."""
    wanted = config.max_model_len or pooler.max_seq_length or model_len
    if wanted > model_len:
        if config.max_model_len:
            raise ValueError(f"max_model_len={wanted} exceeds the model's {model_len}")
        wanted = model_len
    return wanted
