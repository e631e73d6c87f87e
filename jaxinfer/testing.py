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

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 256, 257, 258 after the bytes
TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(sliding_window=24),
    "qwen2": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(num_attention_heads=8, tie_word_embeddings=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=96, mlp_only_layers=[1],
                      norm_topk_prob=False),
    "qwen3_moe": dict(num_attention_heads=8, num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=32, norm_topk_prob=True),
    # Windows shorter than the test prompts; soft caps small enough to bend the scores
    # and logits of a tiny model; query_pre_attn_scalar other than head_dim.
    "gemma2": dict(sliding_window=12, query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
                   final_logit_softcapping=2.0),
    # 5 local layers to 1 global, each with its own RoPE (the global one scaled).
    "gemma3": dict(num_hidden_layers=6, sliding_window=12, query_pre_attn_scalar=24,
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                       "full_attention": {"rope_type": "linear", "factor": 4.0,
                                          "rope_theta": 50000.0}}),
}
# gpt-oss: hidden 64 but 4 heads of 32; a window shorter than the test prompts; YaRN
# over an original context of 64; a SwiGLU limit the tiny model's gate/up outputs cross.
FAMILIES["gpt_oss"] = dict(
    num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=32,
    sliding_window=12, swiglu_limit=0.4, rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 10000.0})
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
GEMMA_FAMILIES = ("gemma2", "gemma3")


def hf_config(family: str, **overrides: Any) -> Any:
    """A tiny transformers config of `family`."""
    import transformers

    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
               "qwen3_moe": transformers.Qwen3MoeConfig, "gemma2": transformers.Gemma2Config,
               "gemma3": transformers.Gemma3TextConfig, "gpt_oss": transformers.GptOssConfig}
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
    write_byte_tokenizer(path)
    return model


def write_byte_tokenizer(path: str | os.PathLike) -> None:
    """A byte-level tokenizer without merges: ids 0-255 are bytes, then SPECIAL_TOKENS."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    root = pathlib.Path(path)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[0],
              "eos_token": SPECIAL_TOKENS[1], "pad_token": SPECIAL_TOKENS[2],
              "clean_up_tokenization_spaces": False}
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _byte_of(char: str) -> int:
    """The byte that GPT-2's byte-to-unicode table maps to `char`."""
    code = ord(char)
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    if code in printable:
        return code
    missing = [b for b in range(256) if b not in printable]
    return missing[code - 256]


def make_random_model(path: str | os.PathLike, preset: Any, *, seed: int = 0,
                      max_position_embeddings: int | None = None,
                      dtype: str = "float32") -> pathlib.Path:
    """An HF directory with random weights of a preset's shape (a name, or a ModelConfig;
    no torch needed), saved in `dtype`, and a word-level tokenizer whose ids cover the
    vocabulary ("<17>" is id 17)."""
    import dataclasses
    import json

    import jax
    from tokenizers import Tokenizer, models

    from jaxinfer import checkpoint
    from jaxinfer.config import load_preset
    from jaxinfer.model import transformer

    cfg = load_preset(preset) if isinstance(preset, str) else preset
    if max_position_embeddings:
        cfg = dataclasses.replace(cfg, max_position_embeddings=max_position_embeddings)
    root = pathlib.Path(path)
    params = transformer.init_params(cfg, jax.random.key(seed), dtype=dtype)
    checkpoint.save_hf(root, cfg, params, dtype=dtype,
                       extra_config={"eos_token_id": 0, "bos_token_id": 0})
    del params
    vocab = {f"<{i}>": i for i in range(cfg.vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="<0>")).save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<0>"}))
    return root
