"""How a pooling model turns hidden states into one vector (`PoolerConfig`), read from a
checkpoint as sentence-transformers reads it: `modules.json`, `1_Pooling/config.json`
(its current `pooling_mode` and the older `pooling_mode_*` flags), a Normalize module,
`config_sentence_transformers.json` (prompts) and `sentence_bert_config.json`
(`max_seq_length`), with config.json's Matryoshka dimensions. Standard library only.
See docs/pooling.md.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

POOLING_TYPES = ("last", "mean", "cls", "all")  # vLLM's names ("all": every token's)
RUNNERS = ("auto", "generate", "pooling")  # vLLM's `runner`
# sentence-transformers' pooling modes -> ours; the others are refused, naming them
_ST_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_LEGACY = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": "max",
              "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
              "pooling_mode_weightedmean_tokens": "weightedmean"}
# module types of modules.json this engine runs: the transformer itself, its pooling and
# a normalization; any other (Dense, LayerNorm, ...) changes the vector and is refused
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolerConfig:
    """The checkpoint's pooling defaults; a request may override `normalize` and pick one
    of `dimensions` (Matryoshka)."""

    pooling_type: str = "last"
    normalize: bool = True
    dimensions: tuple[int, ...] | None = None  # Matryoshka sizes the model was trained at
    prompts: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> prefix
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # sentence-transformers' truncation length

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type={self.pooling_type!r} must be one of "
                             f"{POOLING_TYPES}")
        if self.default_prompt_name is not None and (
                self.default_prompt_name not in self.prompts):
            raise ValueError(f"default_prompt_name={self.default_prompt_name!r} is not "
                             f"among the prompts {sorted(self.prompts)}")


def is_sentence_transformer(model_dir: str | pathlib.Path) -> bool:
    """Whether the directory is a sentence-transformers model (it has modules.json)."""
    return (pathlib.Path(model_dir) / "modules.json").is_file()


def read_pooler_config(model_dir: str | pathlib.Path, hf: dict[str, Any], *,
                       default_type: str) -> PoolerConfig:
    """The pooling of a checkpoint: sentence-transformers' files where present, else
    `default_type` (cls for an encoder, last for a decoder, as vLLM's defaults) and
    normalized vectors."""
    root = pathlib.Path(model_dir)
    fields: dict[str, Any] = {"pooling_type": default_type, "normalize": True,
                              "dimensions": _matryoshka(hf)}
    if is_sentence_transformer(root):
        fields |= _from_modules(root)
        fields |= _prompts(root / "config_sentence_transformers.json")
        bert = _read(root / "sentence_bert_config.json")
        if isinstance(bert.get("max_seq_length"), int):
            fields["max_seq_length"] = bert["max_seq_length"]
    return PoolerConfig(**fields)


def _read(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _from_modules(root: pathlib.Path) -> dict[str, Any]:
    try:
        modules = json.loads((root / "modules.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{root / 'modules.json'}: not JSON ({e})") from None
    fields: dict[str, Any] = {"normalize": False}
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _KNOWN_MODULES:
            raise ValueError(f"{root / 'modules.json'}: module {module.get('type')!r} "
                             f"({module.get('path')}) is not supported; jaxinfer runs "
                             f"{', '.join(_KNOWN_MODULES)} modules only")
        if kind == "Normalize":
            fields["normalize"] = True
        elif kind == "Pooling":
            fields["pooling_type"] = _pooling_mode(root / module.get("path", "") /
                                                   "config.json")
    return fields


def _pooling_mode(path: pathlib.Path) -> str:
    config = _read(path)
    mode = config.get("pooling_mode")
    if mode is None:  # the older flags: one of them set
        modes = [ours for key, ours in _ST_LEGACY.items() if config.get(key)]
        mode = modes[0] if len(modes) == 1 else (modes or "mean")
    if isinstance(mode, list | tuple):
        mode = mode[0] if len(mode) == 1 else mode
    if mode not in _ST_MODES and mode not in _ST_MODES.values():
        raise ValueError(f"{path}: pooling_mode {mode!r} is not supported; supported: "
                         f"{sorted(_ST_MODES)}")
    if config.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt=false (pooling that leaves the prompt "
                         "out) is not supported")
    return _ST_MODES.get(mode, mode)


def _prompts(path: pathlib.Path) -> dict[str, Any]:
    config = _read(path)
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
            isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{path}: prompts must map names to strings")
    return {"prompts": dict(prompts),
            "default_prompt_name": config.get("default_prompt_name") or None}


def _matryoshka(hf: dict[str, Any]) -> tuple[int, ...] | None:
    """config.json's `matryoshka_dimensions` (vLLM's key); `is_matryoshka: true` allows
    any size up to the hidden size (None here means no truncation allowed)."""
    dims = hf.get("matryoshka_dimensions")
    if dims is None and hf.get("is_matryoshka"):
        return tuple(range(1, int(hf["hidden_size"]) + 1))
    if dims is None:
        return None
    if not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims):
        raise ValueError(f"config.json matryoshka_dimensions={dims!r} must be a list of "
                         "positive ints")
    return tuple(sorted(dims))
