"""Test doubles shared by tests/ and benchmarks/: tiny random HF checkpoints.

`make_hf_model` builds a tiny model of a family with `transformers` (random
init, fixed seed, every weight perturbed so norms and biases matter) and saves
it with `save_pretrained`: the ground truth our forward pass is checked
against. Needs the `test` extra (torch, transformers); imported lazily.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(sliding_window=24),
    "qwen2": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(num_attention_heads=8, tie_word_embeddings=True),
}


def hf_config(family: str, **overrides: Any) -> Any:
    """A tiny transformers config of `family`."""
    import transformers

    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    kwargs = TINY | FAMILIES[family] | overrides
    return classes[family](**kwargs)


def make_hf_model(path: str | os.PathLike, family: str, *, seed: int = 0,
                  **overrides: Any) -> Any:
    """Save a random tiny HF model of `family` at `path`; returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.eval()
    model.save_pretrained(pathlib.Path(path))
    return model
