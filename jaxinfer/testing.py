"""Test doubles shared by tests/ and benchmarks/: `make_hf_model` (a tiny random HF
checkpoint of a family, made and saved by `transformers`: the parity tests' ground
truth; needs the `test` extra, imported lazily), and what only tests run: `logits`
(a runner's forward alone), `dense_reference` (a MoE layer the slow way) and views of
state. See docs/testing.md#ground-truth-tiny-hf-models.
"""

from __future__ import annotations

import os
import pathlib
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxinfer.config import families

if TYPE_CHECKING:
    import jax
    import numpy as np

    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.core.page_pool import PagePool
    from jaxinfer.engine.request import Request
    from jaxinfer.engine.runner import Chunk, Runner
    from jaxinfer.engine.runner.inputs import SampleRow

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
# Each registered family (config/families/) has its tiny sizes above; the groups below
# are the families the shared parity tests parametrize over.
OWN_TESTS = ("gpt_oss",)  # its parity tests are its own (tests/model/test_gpt_oss.py)
DENSE_FAMILIES = tuple(f for f in FAMILIES if not families.family(f).has_experts)
MOE_FAMILIES = tuple(f for f in FAMILIES
                     if families.family(f).has_experts and f not in OWN_TESTS)
GEMMA_FAMILIES = ("gemma2", "gemma3")


def hf_config(family: str, **overrides: Any) -> Any:
    """A tiny transformers config of `family` (transformers' config class of its
    registered model_type)."""
    import transformers

    kwargs = TINY | FAMILIES[family] | overrides
    return transformers.AutoConfig.for_model(families.family(family).model_type, **kwargs)


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


# ---- references and state views the tests compare the serving code with -----------


def logits(runner: Runner, chunks: Sequence[Chunk],
           adapters: Sequence[int] | None = None) -> np.ndarray:
    """Write the chunks' K/V into a Runner's cache and return f32[tokens, V] logits for
    every real token: the forward pass alone, compiled per shape outside the bucket set
    (the parity tests' side of the comparison; a runner with one page group).
    `adapters`: each chunk's LoRA slot (-1: the base model; model/lora.py)."""
    import jax
    import numpy as np

    from jaxinfer.engine.runner.inputs import build_metadata, next_power_of_two

    if len(runner.group_windows) > 1:  # build_metadata writes one page group's metadata
        raise NotImplementedError("logits() of a runner with several KV page groups")
    total = sum(len(c.token_ids) for c in chunks)
    token_ids, md = build_metadata(chunks, page_size=runner.page_size,
                                   pages_per_seq=runner.pages_per_seq, all_logits=True,
                                   attention=runner.attention,
                                   num_tokens=next_power_of_two(total, 8),
                                   num_slots=next_power_of_two(len(chunks)))
    if adapters is not None:
        import dataclasses

        per_token = [slot for c, slot in zip(chunks, adapters, strict=True)
                     for _ in c.token_ids]
        per_token += [-1] * (token_ids.shape[0] - len(per_token))
        md = dataclasses.replace(md, adapters=np.array(per_token, np.int32))
    with jax.set_mesh(runner.mesh):
        runner.kv_cache, out = _forward(runner)(runner.params, runner.kv_cache, token_ids, md)
    return np.asarray(out)[:total]


_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runner -> jitted


def _forward(runner: Runner) -> jax.stages.Wrapped:
    """The model's forward pass jitted once per runner, on the shardings its params and
    KV cache have (the cache donated, as the runner's own steps donate it)."""
    if runner not in _FORWARDS:
        import functools

        import jax

        from jaxinfer.model import sharding, transformer

        def placed(tree: object) -> object:
            return jax.tree.map(lambda x: x.sharding, tree)

        whole, kv = sharding.replicated(runner.mesh), placed(runner.kv_cache)
        _FORWARDS[runner] = jax.jit(
            functools.partial(transformer.forward, cfg=runner.cfg, options=runner.options),
            in_shardings=(placed(runner.params), kv, whole, whole),
            out_shardings=(kv, whole), donate_argnums=(1,))
    return _FORWARDS[runner]


def dense_reference(layer: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A MoE layer (model/moe.py) the slow way: every expert for every token in float32,
    weighted by the routing (zero where not chosen), plus the shared expert: what the
    tests compare `moe.moe_block`'s gathered and grouped paths with."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.model import expert_glu, layers, moe

    weights, experts = moe.route(x, layer["w_router"], cfg, layer.get("b_router"))
    full = jnp.zeros((x.shape[0], cfg.moe.num_experts), jnp.float32)
    full = full.at[jnp.arange(x.shape[0])[:, None], experts].set(weights)
    h = jnp.einsum("td,efd->tef", x, layer["we_gate_up"].astype(jnp.float32))
    h = h + layer["be_gate_up"].astype(jnp.float32) if "be_gate_up" in layer else h
    out = jnp.einsum("tef,edf->ted", expert_glu.gated(h, expert_glu.glu_of(cfg)),
                     layer["we_down"].astype(jnp.float32))
    out = out + layer["be_down"].astype(jnp.float32) if "be_down" in layer else out
    y = jnp.einsum("ted,te->td", out, full)
    if "ws_gate_up" in layer:
        gate = jax.nn.sigmoid(layers.linear(x, layer["w_shared_gate"]))
        y = y + gate * layers.swiglu(x, layer["ws_gate_up"], layer["ws_down"])
    return y


def sample_rows(requests: Sequence[Request], chunks: Sequence[Chunk], *, num_positions: int
                ) -> list[SampleRow | None]:
    """A step's sampling rows (runner/inputs.py `SampleRow`), `num_positions` per chunk:
    one per sampled token, in order, then None: what `sampling_inputs` takes."""
    from jaxinfer.engine.runner.inputs import SampleRow

    rows: list[SampleRow | None] = []
    for request, chunk in zip(requests, chunks, strict=True):
        if chunk.num_samples:
            fed = request.all_token_ids[:chunk.start] + list(chunk.token_ids)
            first = len(fed) - chunk.num_samples
            rows += [SampleRow(request, fed[:first + q + 1]) for q in range(chunk.num_samples)]
        rows += [None] * (num_positions - chunk.num_samples)
    return rows


def evictable(pool: PagePool) -> list[int]:
    """A PagePool's cached pages with no owner, least recently used first: its LRU, in
    the order it evicts them."""
    return list(pool._evictable)


ENCODERS = {  # tiny encoders: HF class prefix, position ids' offset past the padding id
    "bert": dict(prefix="Bert", vocab_size=300, max_position_embeddings=128,
                 type_vocab_size=2, pad_token_id=0),
    "xlm_roberta": dict(prefix="XLMRoberta", vocab_size=300, max_position_embeddings=130,
                        type_vocab_size=1, pad_token_id=1),
}
ENCODER_SPECIALS = {"bert": ("[PAD]", "[UNK]", "[CLS]", "[SEP]"),
                    "xlm_roberta": ("<s>", "<pad>", "</s>", "<unk>"),
                    "decoder": ("<pad>", "<unk>", "<s>", "</s>")}


def make_encoder_model(path: str | os.PathLike, architecture: str, *, num_labels: int = 0,
                       seed: int = 0, **overrides: Any) -> Any:
    """Save a random tiny BERT or XLM-RoBERTa (`XModel`, or with `num_labels` its
    `XForSequenceClassification`) at `path` with a word-level tokenizer whose words are
    "w<id>" (`encoder_text`); returns the torch model."""
    import torch
    import transformers

    spec = dict(ENCODERS[architecture])
    prefix = spec.pop("prefix")
    config = getattr(transformers, f"{prefix}Config")(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        initializer_range=0.2, **spec | overrides)
    torch.manual_seed(seed)
    if num_labels:
        config.num_labels = num_labels
        cls = getattr(transformers, f"{prefix}ForSequenceClassification")
    else:
        cls = getattr(transformers, f"{prefix}Model")
    model = cls(config).to(torch.float32).eval()
    model.save_pretrained(pathlib.Path(path))
    write_word_tokenizer(path, config.vocab_size, architecture)
    return model


def write_word_tokenizer(path: str | os.PathLike, vocab_size: int, architecture: str) -> None:
    """A word-level tokenizer.json: the encoder's four special tokens at ids 0-3, then
    "w4" .. "w<vocab_size - 1>", one token a word; BERT's [CLS] a [SEP] (b [SEP]) or
    XLM-R's <s> a </s></s> b </s> around inputs and pairs, as their tokenizers add;
    nothing around them for a "decoder"."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ENCODER_SPECIALS[architecture]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab |= {f"w{i}": i for i in range(len(specials), vocab_size)}
    unk = specials[3] if architecture == "xlm_roberta" else specials[1]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if architecture == "bert":
        tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
        names = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
                 "sep_token": "[SEP]"}
    elif architecture == "xlm_roberta":
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        names = {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>",
                 "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>"}
    else:
        names = {"pad_token": "<pad>", "unk_token": "<unk>", "eos_token": "</s>"}
    root = pathlib.Path(path)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 100000} | names
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def encoder_text(ids: Sequence[int]) -> str:
    """The text `write_word_tokenizer`'s tokenizer reads as exactly `ids` (each >= 4)."""
    return " ".join(f"w{i}" for i in ids)
