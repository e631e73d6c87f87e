"""What speculative decoding adds to a loaded engine: `prepare` reads and checks a draft
model or speculative heads against the target before the planner and runner are built;
`make_speculation` builds the proposer (n-gram, `DraftRunner` or `HeadRunner`) over the
target's page ids. See docs/speculative_decoding.md (#proposers,
#heads-on-the-targets-hidden-states-eagle-12-eagle-3-medusa).
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax.numpy as jnp
import numpy as np

from jaxinfer import checkpoint
from jaxinfer.checkpoint import heads as heads_checkpoint
from jaxinfer.checkpoint.head_layouts import published_layout
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.config.heads import HEAD_METHODS, HeadConfig, head_config
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.engine.runner.device import tree_bytes
from jaxinfer.engine.runner.draft import DraftRunner
from jaxinfer.engine.runner.heads import HeadRunner
from jaxinfer.engine.spec_decode.proposer import DraftProposer, HeadProposer, NgramProposer
from jaxinfer.engine.spec_decode.speculation import Speculation
from jaxinfer.model import sharding
from jaxinfer.model.attention import feature_dtype
from jaxinfer.sizing import planner
from jaxinfer.text.tokenizer import Tokenizer, read_json


@dataclasses.dataclass(frozen=True)
class SpecParts:
    """What `prepare` read: a draft model's config, or heads' config and weights."""

    draft: ModelConfig | None = None  # as its checkpoint says
    served_draft: ModelConfig | None = None  # as it runs (KV heads copied under TP)
    head: HeadConfig | None = None
    head_params: dict | None = None

    @property
    def proposes_with_model(self) -> bool:
        """Whether proposals come with their probabilities (the verify step takes q)."""
        return self.draft is not None or self.head is not None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's features its heads read, which its step keeps
        (ModelOptions.feature_layers); none without heads."""
        return () if self.head is None else self.head.feature_layers

    def plan_draft(self, target: ModelConfig, config: EngineConfig
                   ) -> ModelConfig | tuple[int, int] | None:
        """What the planner counts beside the target: the draft's config, or the heads'
        (weight bytes, bytes per token: their K/V and the features kept)."""
        if self.head is None:
            return self.served_draft
        return tree_bytes(self.head_params), head_bytes_per_token(self.head, config)


def head_bytes_per_token(head: HeadConfig, config: EngineConfig) -> int:
    """What heads add to each token's pages: the target's kept features, and an EAGLE
    layer's K/V."""
    per_token = head.feature_size * jnp.dtype(feature_dtype(config.kv_dtype)).itemsize
    if head.layer is not None:
        per_token += planner.kv_bytes_per_token(head.layer, config.kv_dtype)
    return per_token


def head_plan(model_dir: str, target: ModelConfig, config: EngineConfig) -> tuple[int, int]:
    """(weight bytes, bytes per token) of the heads in `model_dir` from their config.json
    and published layout alone (the `plan` command reads no weights)."""
    root = pathlib.Path(model_dir)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"speculative_config model={model_dir!r}: no config.json")
    head = head_config(read_json(root / "config.json"), target,
                       config.speculative_config.method)
    itemsize = jnp.dtype(config.dtype).itemsize
    weights = sum(int(np.prod(spec.shapes[0])) * itemsize
                  for spec in published_layout(head).values() if spec.required)
    return weights, head_bytes_per_token(head, config)


def prepare(root: pathlib.Path, target: ModelConfig, config: EngineConfig, max_len: int
            ) -> SpecParts:
    """Read and check the draft model or heads `config.speculative_config` names."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return SpecParts()
    if spec.method in HEAD_METHODS:
        if not pathlib.Path(spec.model).is_dir():
            raise FileNotFoundError(f"speculative_config model={spec.model!r}: no such "
                                    "directory")
        head, params = heads_checkpoint.load_head(spec.model, target, config.dtype,
                                                  method=spec.method)
        if head.method == "medusa" and spec.num_speculative_tokens > head.num_heads:
            raise ValueError(f"speculative_config num_speculative_tokens="
                             f"{spec.num_speculative_tokens} exceeds the {head.num_heads} "
                             f"Medusa heads of {spec.model!r}")
        return SpecParts(head=head, head_params=params)
    draft = draft_config(root, target, config, max_len)
    return SpecParts(draft=draft, served_draft=sharding.served_config(
        draft, config.tensor_parallel_size))


def make_speculation(config: EngineConfig, parts: SpecParts, target: object, *,
                     vocab_size: int, mesh: object, num_pages: int, max_len: int,
                     buckets: BucketSet, eos_token_ids: frozenset[int]) -> Speculation:
    """The speculation policy and its proposer: n-gram lookup, the draft model (its
    weights read onto the target's mesh) or the heads, beside the `target` runner."""
    spec = config.speculative_config
    common = dict(mesh=mesh, num_pages=num_pages, page_size=config.page_size,
                  max_model_len=max_len, buckets=buckets,
                  num_positions=buckets.verify_positions, vocab_size=vocab_size,
                  kv_dtype=config.kv_dtype, eos_token_ids=eos_token_ids,
                  attention=target.attention)
    proposer = NgramProposer(min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max)
    if parts.draft is not None:
        proposer = DraftProposer(DraftRunner(
            parts.served_draft, checkpoint.load_params(spec.model, parts.draft,
                                                       config.dtype, mesh), **common))
    elif parts.head is not None:
        proposer = HeadProposer(HeadRunner(parts.head, parts.head_params, target, **common),
                                parts.head.method)
    return Speculation(proposer, max_drafts=spec.num_speculative_tokens,
                       adaptive=spec.adaptive, disable_by_batch_size=spec.disable_by_batch_size,
                       buckets=buckets)


def draft_config(root: pathlib.Path, target: ModelConfig, config: EngineConfig,
                 max_len: int) -> ModelConfig | None:
    """The draft model's config when `config` speculates with one, after checking it can
    serve `target`: the same tokenizer vocabulary (tokenizer.json), a context of at
    least `max_len`, a split over the same devices. ValueError naming the mismatch."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    draft_root = pathlib.Path(spec.model)
    if not draft_root.is_dir():
        raise FileNotFoundError(f"speculative_config model={spec.model!r}: no such directory")
    draft = checkpoint.load_config(draft_root)
    written = checkpoint.served_quantization(draft_root, None)
    if written is not None:
        raise ValueError(f"draft model {spec.model!r} holds {written} weights; a draft is "
                         "served in the engine's float dtype: give its float checkpoint")
    check_same_tokenizer(root, draft_root)
    if draft.max_position_embeddings < max_len:
        raise ValueError(f"draft model {spec.model!r}: max_position_embeddings="
                         f"{draft.max_position_embeddings} is below max_model_len={max_len}")
    degree = spec.draft_tensor_parallel_size
    if degree not in (None, config.tensor_parallel_size):
        raise ValueError(f"speculative_config draft_tensor_parallel_size={degree}: the draft "
                         "is split over the target's devices, so it must equal "
                         f"tensor_parallel_size={config.tensor_parallel_size} (or be left out)")
    try:
        planner.check_tensor_parallel(draft, config.tensor_parallel_size)
    except ValueError as e:
        raise ValueError(f"draft model {spec.model!r}: {e}") from None
    return draft


def check_same_tokenizer(target: pathlib.Path, draft: pathlib.Path) -> None:
    """ValueError unless both directories' tokenizer.json map the same tokens to the same
    ids (or neither has one: token-id prompts, nothing to compare)."""
    have = [(d / "tokenizer.json").is_file() for d in (target, draft)]
    if not any(have):
        return
    if not all(have):
        missing = draft if have[0] else target
        raise ValueError(f"the draft model must share the target's tokenizer, but "
                         f"{str(missing)!r} has no tokenizer.json")
    ours, theirs = Tokenizer.from_dir(target).vocab(), Tokenizer.from_dir(draft).vocab()
    differ = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
    if differ:
        token = differ[0]
        raise ValueError(
            f"the draft model {str(draft)!r} does not share the target's tokenizer: "
            f"{len(differ)} of {len(ours)} tokens differ (e.g. {token!r}: id "
            f"{ours.get(token)} in the target, {theirs.get(token)} in the draft)")
