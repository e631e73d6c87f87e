"""Tiny random pooling checkpoints for the server and batch tests (importable as
`pooling_models`, see pyproject's pythonpath): a bare Qwen3 decoder as a
sentence-transformers embedding model with query / document prompts, and a Qwen3
cross-encoder (Qwen3ForSequenceClassification, one label)."""

from __future__ import annotations

import json
import pathlib

from jaxinfer import testing

PROMPTS = {"query": "query: ", "document": "passage: "}
# the settings the tests serve them with: warm-up in seconds
SETTINGS = {"runner": "pooling", "max_model_len": 128, "max_num_batched_tokens": 64,
            "max_num_seqs": 8, "dtype": "float32"}


def _save(model, path: pathlib.Path, seed: int) -> pathlib.Path:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(path)
    testing.write_byte_tokenizer(path)
    return path


def embedding_model(path: pathlib.Path) -> pathlib.Path:
    """A bare Qwen3Model pooled by its last token, normalized, with PROMPTS."""
    import torch
    import transformers

    model = transformers.AutoModel.from_config(testing.hf_config("qwen3"), dtype=torch.float32)
    _save(model, path, seed=0)
    modules = [{"idx": 0, "name": "0", "path": "", "type":
                "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type":
                "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    return path


def cross_encoder(path: pathlib.Path) -> pathlib.Path:
    """A Qwen3ForSequenceClassification with one label (a reranker's shape)."""
    import torch
    import transformers

    config = testing.hf_config("qwen3", num_labels=1)
    model = transformers.AutoModelForSequenceClassification.from_config(
        config, dtype=torch.float32)
    return _save(model, path, seed=1)
