"""Train the bundled demo model and its draft model on the Python stdlib source.

The corpus is the standard library's own .py files, on every machine with no
download. Files are split by a hash of their path: 1 in 20 is held out. A
byte-level BPE tokenizer is trained on the training files with `tokenizers`;
both models use it. Training runs our own JAX model code (`forward_dense`)
with optax AdamW, weights kept in float32 and matmuls in bfloat16 with float32
accumulation. Each model is saved as an ordinary HF directory (config.json,
model.safetensors in bfloat16, tokenizer files) that transformers loads too.

    python tools/train_demo.py --out=checkpoints --main_steps=1200 --draft_steps=1200

`--size=large` trains the larger pair (7.8 M + 1.6 M parameters) that is bundled now; it
was trained on an H100 (`tools/gpu_session.sh`) from the Python 3.11.7 standard library
carried there as a tarball (`--corpus_dir`), so with that Python the corpus and split of
`jaxinfer.text.corpus` are the ones it was trained on.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxinfer import checkpoint
from jaxinfer.config import ModelConfig
from jaxinfer.model import transformer
from jaxinfer.text.corpus import corpus_files as split_corpus
from jaxinfer.text.corpus import read_texts

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "checkpoints", "where to write demo/ and demo-draft/")
flags.DEFINE_integer("vocab", 4096, "BPE vocabulary size")
flags.DEFINE_integer("seq_len", 512, "training sequence length (= max positions)")
flags.DEFINE_integer("batch", 8, "sequences per step")
flags.DEFINE_integer("main_steps", 1200, "optimizer steps for the main model")
flags.DEFINE_integer("draft_steps", 1200, "optimizer steps for the draft model")
flags.DEFINE_float("lr", 3e-3, "peak learning rate")
flags.DEFINE_integer("eval_windows", 64, "held-out windows for the reported loss")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_string("corpus_dir", None, "directory of .py files; default: this Python's stdlib")
flags.DEFINE_enum("size", "small", ["small", "large"], "model shapes (see model_configs)")

EOS = "<|endoftext|>"
# generation_config.json's sampling defaults, applied when a caller gives no
# SamplingParams: chosen by reading samples of tools/demo_samples.py (checkpoints/README.md).
SAMPLING_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.1}
CHAT_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}# assistant:\n{% endif %}")


def model_configs(vocab: int, seq_len: int, size: str = "small") -> dict[str, ModelConfig]:
    common = dict(architecture="llama", vocab_size=vocab, tie_word_embeddings=True,
                  max_position_embeddings=seq_len, rms_norm_eps=1e-5, rope_theta=10000.0)
    if size == "large":
        return {
            "demo": ModelConfig(hidden_size=320, intermediate_size=864, num_layers=6,
                                num_heads=5, num_kv_heads=1, head_dim=64, **common),
            "demo-draft": ModelConfig(hidden_size=192, intermediate_size=512, num_layers=2,
                                      num_heads=3, num_kv_heads=1, head_dim=64, **common),
        }
    return {
        "demo": ModelConfig(hidden_size=192, intermediate_size=512, num_layers=4,
                            num_heads=3, num_kv_heads=1, head_dim=64, **common),
        "demo-draft": ModelConfig(hidden_size=96, intermediate_size=256, num_layers=2,
                                  num_heads=3, num_kv_heads=1, head_dim=32, **common),
    }


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


def loss_fn(params: dict, batch: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Mean next-token cross-entropy; matmuls in bf16 with f32 accumulation."""
    low = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    logits = transformer.forward_dense(low, batch[:, :-1], cfg=cfg)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def train(cfg: ModelConfig, data: np.ndarray, steps: int, name: str) -> tuple[dict, dict]:
    rng = np.random.default_rng(FLAGS.seed)
    params = transformer.init_params(cfg, jax.random.key(FLAGS.seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, min(100, steps // 10),
                                                  steps, FLAGS.lr / 10)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b2=0.95, weight_decay=0.1))
    state = opt.init(params)

    @jax.jit
    def update(params: dict, state: optax.OptState, batch: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    window = FLAGS.seq_len + 1
    start, losses = time.time(), []
    for i in range(steps):
        offsets = rng.integers(0, len(data) - window, FLAGS.batch)
        batch = np.stack([data[o:o + window] for o in offsets])
        params, state, loss = update(params, state, batch)
        losses.append(float(loss))
        if i % 50 == 0 or i == steps - 1:
            print(f"[{name}] step {i} loss {np.mean(losses[-50:]):.3f} "
                  f"{time.time() - start:.0f}s", file=sys.stderr, flush=True)
    elapsed = time.time() - start
    tokens = steps * FLAGS.batch * FLAGS.seq_len
    return params, {"steps": steps, "train_tokens": tokens, "train_seconds": round(elapsed),
                    "final_train_loss": round(float(np.mean(losses[-50:])), 4)}


def held_out_loss(cfg: ModelConfig, params: dict, data: np.ndarray) -> float:
    """Mean loss over non-overlapping held-out windows, weights rounded to bf16 as saved."""
    window = FLAGS.seq_len + 1
    count = min(FLAGS.eval_windows, len(data) // window)
    saved = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), params)
    fn = jax.jit(functools.partial(transformer.forward_dense, cfg=cfg))
    losses = []
    for i in range(count):
        batch = data[i * window:(i + 1) * window][None]
        logits = fn(saved, batch[:, :-1])
        losses.append(float(optax.softmax_cross_entropy_with_integer_labels(
            logits, batch[:, 1:]).mean()))
    return float(np.mean(losses))


def save(out: pathlib.Path, cfg: ModelConfig, params: dict, tok: Tokenizer,
         report: dict) -> None:
    eos = tok.token_to_id(EOS)
    checkpoint.save_hf(out, cfg, params, dtype="bfloat16",
                       extra_config={"bos_token_id": eos, "eos_token_id": eos})
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS,
               "bos_token": EOS, "model_max_length": cfg.max_position_embeddings,
               "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"bos_token_id": eos, "eos_token_id": eos, **SAMPLING_DEFAULTS}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str]) -> None:
    del argv
    t0 = time.time()
    train_files, held_files = split_corpus(FLAGS.corpus_dir)
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    tok = train_tokenizer(train_texts, FLAGS.vocab)
    train_data, held_data = encode_stream(tok, train_texts), encode_stream(tok, held_texts)
    python = "3.11.7 (carried)" if FLAGS.corpus_dir else sys.version.split()[0]
    corpus = {"python": python, "train_files": len(train_files),
              "held_out_files": len(held_files), "train_tokens_in_corpus": len(train_data),
              "held_out_tokens": len(held_data), "tokenizer_seconds": round(time.time() - t0)}
    print(json.dumps(corpus), file=sys.stderr)
    steps = {"demo": FLAGS.main_steps, "demo-draft": FLAGS.draft_steps}
    for name, cfg in model_configs(FLAGS.vocab, FLAGS.seq_len, FLAGS.size).items():
        params, report = train(cfg, train_data, steps[name], name)
        num_params = sum(x.size for x in jax.tree.leaves(params))
        report |= {"parameters": int(num_params), "corpus": corpus,
                   "held_out_loss": round(held_out_loss(cfg, params, held_data), 4),
                   "batch": FLAGS.batch, "seq_len": FLAGS.seq_len, "lr": FLAGS.lr,
                   "device": jax.devices()[0].device_kind}
        save(pathlib.Path(FLAGS.out) / name, cfg, params, tok, report)
        print(json.dumps({name: report}), flush=True)


if __name__ == "__main__":
    app.run(main)
