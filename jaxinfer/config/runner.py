"""Which runner serves a checkpoint (`with_runner`: EngineConfig.runner "auto" resolved)
and the decoder's head as that runner serves it (`served_head`). Standard library only:
`plan` and `aot` ask without loading the engine. See docs/pooling.md#choosing-the-runner.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

from jaxinfer.config import families
from jaxinfer.config.encoder import is_encoder
from jaxinfer.config.engine import EngineConfig
from jaxinfer.config.model import ModelConfig
from jaxinfer.config.pooling import is_sentence_transformer


def with_runner(model_dir: str | os.PathLike, config: EngineConfig) -> EngineConfig:
    """`config` with runner "auto" resolved: pooling for an encoder, a decoder saved
    without an LM head (`XModel`, `XForSequenceClassification`) or a sentence-transformers
    directory; else generate."""
    if config.runner != "auto":
        return config
    root = pathlib.Path(model_dir)
    path = root / "config.json"
    hf = json.loads(path.read_text()) if path.is_file() else {}
    pooling = (is_encoder(hf) or is_sentence_transformer(root)
               or families.head_of(hf) != "lm")
    return dataclasses.replace(config, runner="pooling" if pooling else "generate")


def served_head(model_config: ModelConfig, config: EngineConfig) -> ModelConfig:
    """The decoder as `config.runner` serves it: a pooling runner reads no LM head (a
    *ForCausalLM checkpoint's is ignored); the generate runner needs one."""
    if config.runner == "pooling":
        return (dataclasses.replace(model_config, head="none")
                if model_config.head == "lm" else model_config)
    if model_config.head != "lm":
        raise ValueError(f"this checkpoint has no LM head ({model_config.architecture} "
                         f"with head {model_config.head!r}): serve it with "
                         "runner='pooling' (--runner=pooling)")
    return model_config
