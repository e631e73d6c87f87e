"""Train speculative heads for the demo model: EAGLE-3, Medusa and EAGLE-1 drafters.

The heads learn the target's own behaviour: the data are windows of the corpus's
training files and the target's own greedy and sampled continuations of training-file
prompts that end with a `def` line (the benchmark's workload, tools/heads_data.py), and
the labels are the target's distributions (cross-entropy against its softmax at
temperature 1, which serves greedy and sampled decoding alike):

- eagle3 (EAGLE-3): fc over three target layers' streams plus one decoder layer, its
  own LM head over a reduced draft vocabulary (the most frequent tokens of the data,
  d2t / t2d maps). Trained with "training-time test": `--ttt_steps` unrolled drafting
  steps, step j > 1 fed the drafter's own hidden state of step j - 1 and attending to
  the true-feature keys of the prefix plus its own chain's keys, as at inference.
- medusa: K heads of one residual block each on the target's final normed hidden state,
  head h predicting the token h + 2 places ahead; LM heads start as the target's.
- eagle (EAGLE-1): fc over [embedding, final normed feature] plus one decoder layer, the
  target's tied LM head; the same unrolled loss plus a regression onto the next feature.

Each head is saved in its published layout (jaxinfer/checkpoint/heads.py) in bfloat16
as checkpoints/demo-<method>/ with training.json. Held-out acceptance is measured as
the engine runs speculation: the benchmark's prompts (benchmarks/bench_spec.py, the
held-out files), the target's continuation by the engine, and at each verify step a
chain of `--eval_k` drafts from the true prefix, stepping by accepted + 1; greedy
(drafts accepted until the first mismatch) and sampled at `--eval_temperature`
(draft j accepted with probability sum_x min(p, q), drawn with a fixed seed).

    python tools/train_heads.py                     # all three: 30-50 min on 2 CPU cores
    python tools/train_heads.py --methods=eagle3 --gen_prompts=128 --windows=128 \\
        --eagle3_steps=150 --eval_prompts=16        # a quick run, a few minutes
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil
import sys
import time

import heads_data
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxinfer.checkpoint import heads as head_ckpt
from jaxinfer.config.heads import HeadConfig
from jaxinfer.config.model import FINAL_NORMED
from jaxinfer.model import layers
from jaxinfer.text.corpus import corpus_files, read_texts

FLAGS = flags.FLAGS
flags.DEFINE_string("target", "checkpoints/demo", "the target model's directory")
flags.DEFINE_string("out", "checkpoints", "where demo-<method>/ directories go")
flags.DEFINE_string("prefix", "demo-", "output directory name: prefix + method")
flags.DEFINE_list("methods", ["eagle3", "medusa", "eagle"], "heads to train")
flags.DEFINE_integer("gen_prompts", 1024, "training prompts the target continues (half "
                     "greedy, half sampled at --gen_temperature)")
flags.DEFINE_float("gen_temperature", 0.8, "temperature of the sampled continuations")
flags.DEFINE_integer("windows", 384, "plain training-file windows")
flags.DEFINE_integer("prompt_tokens", 192, "prompt length (bench_spec's)")
flags.DEFINE_integer("output_tokens", 128, "continuation length (bench_spec's)")
flags.DEFINE_integer("batch", 8, "sequences per eagle/eagle3 training step")
flags.DEFINE_integer("medusa_rows", 4096, "positions per medusa training step")
flags.DEFINE_integer("eagle3_steps", 450, "optimizer steps for eagle3")
flags.DEFINE_integer("medusa_steps", 250, "optimizer steps for medusa")
flags.DEFINE_integer("eagle_steps", 250, "optimizer steps for eagle")
flags.DEFINE_float("lr", 2e-3, "peak learning rate (warm-up, cosine decay to a tenth)")
flags.DEFINE_integer("ttt_steps", 3, "unrolled drafting steps in the eagle losses")
flags.DEFINE_integer("draft_vocab", 3072, "eagle3's draft vocabulary (the most frequent "
                     "ids of the training sequences)")
flags.DEFINE_integer("medusa_vocab", 2048, "medusa's truncated vocabulary (likewise)")
flags.DEFINE_list("eagle3_layers", ["2", "4", "6"], "target streams eagle3 reads "
                  "(entry i: the stream entering layer i; 6: after the last)")
flags.DEFINE_integer("medusa_heads", 4, "Medusa heads")
flags.DEFINE_enum("init", "identity", ["identity", "random"], "eagle/eagle3's start "
                  "(see init_head)")
flags.DEFINE_integer("eval_prompts", 64, "held-out prompts for the acceptance figures")
flags.DEFINE_integer("eval_k", 4, "drafts per verify step in the acceptance figures")
flags.DEFINE_float("eval_temperature", 0.8, "temperature of the sampled acceptance")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_string("sequences_cache", None, "an .npz of the generated sequences: read "
                    "when it exists, else written (development runs)")
flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"],
                  "matmul inputs in training (weights stay float32)")

TTT_DECAY = 0.8  # weight of unrolled step j: 0.8 ** j (EAGLE-3's)
REG_WEIGHT = 1.0  # eagle: feature regression (smooth L1), next to the soft-label CE


def compute_dtype() -> jnp.dtype:
    return jnp.dtype(FLAGS.compute_dtype)


# --- optimizer ---------------------------------------------------------------------

def adamw_update(params: dict, grads: dict, state: tuple, step: jax.Array, *, lr: float,
                 steps: int, b1: float = 0.9, b2: float = 0.95, wd: float = 0.01,
                 clip: float = 1.0) -> tuple[dict, tuple]:
    """One AdamW step with global-norm clipping; learning rate: linear warm-up over 5%
    of `steps`, cosine decay to lr / 10. Weight decay on matrices only."""
    m, v = state
    warm = max(1, steps // 20)
    progress = jnp.clip((step - warm) / max(1, steps - warm), 0.0, 1.0)
    rate = jnp.where(step < warm, lr * (step + 1) / warm,
                     lr / 10 + 0.45 * lr * (1 + jnp.cos(jnp.pi * progress)))
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip / (norm + 1e-6)), grads)
    m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
    t = step + 1

    def move(p: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        update = (a / (1 - b1 ** t)) / (jnp.sqrt(b / (1 - b2 ** t)) + 1e-8)
        return p - rate * (update + (wd * p if p.ndim >= 2 else 0.0))

    return jax.tree.map(move, params, m, v), (m, v)


def fit(name: str, loss_fn: object, params: dict, batches: object, steps: int
        ) -> tuple[dict, dict]:
    """Train `params` (float leaves) on `batches(rng)` for `steps`; returns (params,
    report). `loss_fn(params, batch)` -> (loss, top-1 agreement with the target)."""
    state = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params))

    @jax.jit
    def update(params: dict, state: tuple, step: jax.Array, batch: tuple) -> tuple:
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        params, state = adamw_update(params, grads, state, step, lr=FLAGS.lr, steps=steps)
        return params, state, loss, acc

    rng = np.random.default_rng(FLAGS.seed)
    started, losses, accs = time.time(), [], []
    for step in range(steps):
        params, state, loss, acc = update(params, state, jnp.asarray(step, jnp.int32),
                                          batches(rng))
        losses.append(float(loss))
        accs.append(float(acc))
        if step % 50 == 0 or step == steps - 1:
            print(f"[{name}] step {step} loss {np.mean(losses[-50:]):.3f} top1 "
                  f"{np.mean(accs[-50:]):.3f} {time.time() - started:.0f}s",
                  file=sys.stderr, flush=True)
    tail = max(1, steps // 10)
    return params, {"steps": steps, "lr": FLAGS.lr,
                    "train_seconds": round(time.time() - started),
                    "first_loss": round(float(np.mean(losses[:tail])), 4),
                    "final_loss": round(float(np.mean(losses[-tail:])), 4),
                    "final_top1": round(float(np.mean(accs[-tail:])), 4)}


def sequence_batches(data: heads_data.Features, cols: np.ndarray) -> object:
    """`--batch` random whole sequences: (tokens, features `cols`, teacher ids, probs)."""
    def batch(rng: np.random.Generator) -> tuple:
        rows = np.sort(rng.choice(len(data.tokens), FLAGS.batch, replace=False))
        return (data.tokens[rows], data.features[rows][..., cols], data.teacher_ids[rows],
                data.teacher_probs[rows])
    return batch


def position_batches(data: heads_data.Features, cols: np.ndarray, ahead: int) -> object:
    """`--medusa_rows` random positions t: (features at t, the teacher's distributions
    at t + 1 .. t + ahead, [R, ahead, K] ids and probs)."""
    n, t = data.tokens.shape

    def batch(rng: np.random.Generator) -> tuple:
        seqs = rng.integers(0, n, FLAGS.medusa_rows)
        pos = rng.integers(0, t - ahead, FLAGS.medusa_rows)
        later = (pos[:, None] + 1 + np.arange(ahead))
        return (data.features[seqs, pos][:, cols], data.teacher_ids[seqs[:, None], later],
                data.teacher_probs[seqs[:, None], later])
    return batch


# --- losses -------------------------------------------------------------------------

def draft_logits(params: dict, shared: dict, hidden: jax.Array, cfg: HeadConfig
                 ) -> jax.Array:
    """f32[..., V_draft]: eagle3's logits over its draft vocabulary (draft ids), eagle's
    through the target's LM head."""
    if cfg.method == "eagle3":
        return layers.linear(layers.norm(hidden, params["final_norm"], cfg.layer),
                             params["lm_head"])
    head = shared["embed"]
    return jnp.einsum("...d,vd->...v", hidden.astype(head.dtype), head,
                      preferred_element_type=jnp.float32)


def topk_ce(student: jax.Array, ids: jax.Array, probs: jax.Array,
            draft_index: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(cross-entropy of softmax(student) against the teacher's top-K distribution
    renormalized over the draft vocabulary, whether the student's argmax is the teacher's
    top id) per row; `draft_index`: target id -> draft column or -1 (None: identity)."""
    if draft_index is not None:
        ids = draft_index[ids]
        probs = jnp.where(ids >= 0, probs, 0.0)
        ids = jnp.maximum(ids, 0)
    probs = probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-6)
    log_q = jax.nn.log_softmax(student)
    ce = -jnp.sum(probs * jnp.take_along_axis(log_q, ids, -1), -1)
    return ce, jnp.argmax(student, -1) == ids[..., 0]


def eagle_loss(params: dict, batch: tuple, *, cfg: HeadConfig, frozen: dict
               ) -> tuple[jax.Array, jax.Array]:
    """Sum over unrolled steps of 0.8 ** j x (soft-label CE against the target's next
    distribution (+ smooth-L1 to the next feature for eagle)); aux: step 1's top-1
    agreement with the target."""
    tokens, feats, ids, probs = batch
    low = jax.tree.map(lambda w: w.astype(compute_dtype())
                       if jnp.issubdtype(w.dtype, jnp.floating) else w, params | frozen)
    shared = {"embed": low.pop("target_embed")}
    hiddens = heads_data.unrolled_hiddens(low, shared, tokens[:, 1:], feats[:, :-1], cfg=cfg,
                               steps=FLAGS.ttt_steps)
    total, top1 = 0.0, None
    for j, hidden in enumerate(hiddens):
        ce, hit = topk_ce(draft_logits(low, shared, hidden, cfg), ids[:, 1:],
                          probs[:, 1:], frozen.get("draft_index"))
        if cfg.method == "eagle":  # its feature is the target's final normed hidden
            diff = jnp.abs(hidden - feats[:, 1:].astype(jnp.float32))
            ce = ce + REG_WEIGHT * jnp.mean(
                jnp.where(diff < 1, 0.5 * diff * diff, diff - 0.5), -1)
        total = total + TTT_DECAY ** j * jnp.mean(ce[:, j:])
        top1 = jnp.mean(hit) if j == 0 else top1
    return total, top1


def medusa_loss(params: dict, batch: tuple, *, cfg: HeadConfig, frozen: dict
                ) -> tuple[jax.Array, jax.Array]:
    """Sum over heads h of 0.8 ** h x soft-label CE of head h at t against the target's
    distribution at t + 1 + h (the token at t + 2 + h); aux: head 0's top-1 agreement.
    The heads run as model/medusa.py's head_logits, one matmul per head (a bfloat16
    einsum batched over heads has no XLA:CPU kernel)."""
    feats, ids, probs = batch
    low = jax.tree.map(lambda w: w.astype(compute_dtype()), params)
    x = feats.astype(jnp.float32)
    total, top1 = 0.0, None
    for h in range(cfg.num_heads):
        y = x + jax.nn.silu(layers.linear(x, low["blocks_w"][h, 0], low["blocks_b"][h, 0]))
        ce, hit = topk_ce(layers.linear(y, low["lm_heads"][h]), ids[:, h], probs[:, h],
                          frozen.get("draft_index"))
        total = total + TTT_DECAY ** h * jnp.mean(ce)
        top1 = jnp.mean(hit) if h == 0 else top1
    return total, top1


# --- heads: initial params ------------------------------------------------------------

def layer_shape(target: object) -> dict:
    """The drafter layer's config.json fields: the target's own layer shape."""
    return {"hidden_size": target.hidden_size,
            "intermediate_size": target.intermediate_size,
            "num_attention_heads": target.num_heads,
            "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim,
            "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta}


def init_head(method: str, target: object, target_params: dict, draft_ids: np.ndarray,
              key: jax.Array) -> tuple[HeadConfig, dict, dict]:
    """(head, trainable float params, frozen params). LM heads start as the target's
    (tied) table, eagle3's final norm as the target's; eagle3's and medusa's vocabulary
    is `draft_ids` (ascending target ids: d2t, token_map). Medusa's blocks start at zero
    and, with `--init=identity`, eagle's fc passes the target's feature through (eagle3:
    its last stream) and the layer's output projections start small, so every head
    starts as the target's own next-token head; else the layers start random."""
    embed = np.asarray(target_params["embed"], np.float32)
    index = np.full(len(embed), -1, np.int32)
    index[draft_ids] = np.arange(len(draft_ids))
    frozen = {"draft_index": jnp.asarray(index)}
    if method == "medusa":
        head, params = head_ckpt.random_head(
            "medusa", target, key, num_heads=FLAGS.medusa_heads, num_hidden_layers=1,
            medusa_fc_bias=True, truncated_vocab_size=len(draft_ids))
        params = {"blocks_w": jnp.zeros_like(params["blocks_w"]),
                  "blocks_b": jnp.zeros_like(params["blocks_b"]),
                  "lm_heads": jnp.broadcast_to(embed[draft_ids].T, params["lm_heads"].shape)}
        return head, params, frozen | {"token_map": jnp.asarray(draft_ids, jnp.int32)}
    extra = {"bias": True} if method == "eagle" else {
        "draft_vocab_size": len(draft_ids),
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in FLAGS.eagle3_layers]}
    head, params = head_ckpt.random_head(method, target, key, **layer_shape(target),
                                         **extra)
    layer = {k: jnp.ones_like(v) if "norm" in k else v for k, v in params["layer"].items()}
    params["layer"] = layer
    if FLAGS.init == "identity":
        d = target.hidden_size
        layer |= {"wo": 0.1 * layer["wo"], "w_down": 0.1 * layer["w_down"]}
        params["fc"] = (0.1 * params["fc"]).at[-d:].set(jnp.eye(d))
    if method == "eagle":
        return head, params | {"fc_bias": jnp.zeros_like(params["fc_bias"])}, {}
    params |= {"final_norm": jnp.asarray(target_params["final_norm"], jnp.float32),
               "lm_head": jnp.asarray(embed[draft_ids].T)}
    del params["d2t"]
    d2t = jnp.asarray(draft_ids - np.arange(len(draft_ids)), jnp.int32)
    return head, params, frozen | {"d2t": d2t}


def draft_vocabulary(tokens: np.ndarray, size: int, vocab: int) -> tuple[np.ndarray, dict]:
    """The `size` most frequent ids of the training sequences, ascending, and the share
    of the data's tokens they cover."""
    counts = np.bincount(tokens.ravel(), minlength=vocab)
    ids = np.sort(np.argsort(-counts, kind="stable")[:size])
    return ids, {"draft_vocab_size": size,
                 "coverage": round(float(counts[ids].sum() / counts.sum()), 4)}


# --- held-out acceptance -------------------------------------------------------------

def held_out_acceptance(head: HeadConfig, params: dict, shared: dict, sets: dict,
                        start: int) -> dict:
    """Greedy and sampled acceptance on the held-out continuations (`sets`: "greedy"
    and "sampled" Features)."""
    fn = jax.jit(functools.partial(heads_data.chain_drafts, head, k=FLAGS.eval_k,
                                   temperature=FLAGS.eval_temperature))
    out = {}
    for name, data in sets.items():
        cols, d = data.columns(head.feature_layers), data.hidden_size
        drafts, alphas = [], []
        for i in range(0, len(data.tokens), 8):
            feats = data.features[i:i + 8]
            got = fn(params, shared, data.tokens[i:i + 8], feats[..., cols], feats[..., -d:])
            drafts.append(np.asarray(got[0]))
            alphas.append(np.asarray(got[1]))
        drafts, alphas = np.concatenate(drafts), np.concatenate(alphas)
        out[name] = heads_data.simulate(data.tokens, drafts, None if name == "greedy" else alphas,
                             start, FLAGS.eval_k, FLAGS.seed)
        out[name]["per_step_alpha"] = [round(float(a), 3) for a in
                                       alphas[:, start - 1:-FLAGS.eval_k].mean((0, 1))]
    return out


# --- main ------------------------------------------------------------------------------

def sequences(tok: object) -> tuple[np.ndarray, dict[str, np.ndarray], dict]:
    """(training sequences, held-out {"greedy", "sampled"} sequences or {}, data report):
    plain training windows and the target's continuations by the engine of training and
    held-out prompts, all prompt_tokens + output_tokens long."""
    train_files, held_files = corpus_files()
    train_texts = read_texts(train_files)
    length, seed = FLAGS.prompt_tokens + FLAGS.output_tokens, FLAGS.seed
    parts = [heads_data.corpus_windows(tok, train_texts, length, FLAGS.windows, seed)]
    held_sets, started = {}, time.time()
    if FLAGS.gen_prompts or FLAGS.eval_prompts:
        llm = heads_data.make_llm(FLAGS.target)
        cont = functools.partial(heads_data.continue_prompts, llm,
                                 output_tokens=FLAGS.output_tokens)
    if FLAGS.gen_prompts:
        prompts = heads_data.sampled_def_prompts(tok, train_texts, FLAGS.prompt_tokens,
                                                 FLAGS.gen_prompts, seed)
        half = len(prompts) // 2
        parts += [cont(prompts[:half], temperature=0.0, seed=seed),
                  cont(prompts[half:], temperature=FLAGS.gen_temperature, seed=seed)]
    if FLAGS.eval_prompts:
        held = heads_data.def_prompts(tok, read_texts(held_files), FLAGS.prompt_tokens,
                                      FLAGS.eval_prompts)
        held_sets = {"greedy": cont(held, temperature=0.0, seed=seed),
                     "sampled": cont(held, temperature=FLAGS.eval_temperature, seed=10**6)}
    train = np.concatenate([p for p in parts if len(p)])
    report = {"windows": FLAGS.windows, "gen_prompts": FLAGS.gen_prompts,
              "gen_temperature": FLAGS.gen_temperature, "seq_len": length,
              "train_sequences": len(train), "generate_seconds": round(time.time() - started),
              "eval_prompts": FLAGS.eval_prompts}
    return train, held_sets, report


def train_method(method: str, target: object, target_params: dict, train: object,
                 held: dict, draft_ids: np.ndarray, key: jax.Array) -> dict:
    """Train one head, save it (bfloat16), reload it as the engine does and measure its
    held-out acceptance; returns its report (also written as training.json)."""
    head, params, frozen = init_head(method, target, target_params, draft_ids, key)
    frozen["target_embed"] = target_params["embed"]
    cols = train.columns(head.feature_layers)
    if method == "medusa":
        loss, batches = medusa_loss, position_batches(train, cols, head.num_heads)
    else:
        loss, batches = eagle_loss, sequence_batches(train, cols)
    steps = getattr(FLAGS, f"{method}_steps")
    params, report = fit(method, functools.partial(loss, cfg=head, frozen=frozen), params,
                         batches, steps)
    rows = FLAGS.medusa_rows if method == "medusa" else FLAGS.batch * (train.tokens.shape[1] - 1)
    report |= {"batch": FLAGS.medusa_rows if method == "medusa" else FLAGS.batch,
               "train_positions": steps * rows}
    out = pathlib.Path(FLAGS.out) / (FLAGS.prefix + method)
    if out.exists():
        shutil.rmtree(out)
    saved = params | {k: np.asarray(v) for k, v in frozen.items() if k in ("d2t", "token_map")}
    save = {"eagle3": head_ckpt.save_eagle3, "eagle": head_ckpt.save_eagle,
            "medusa": head_ckpt.save_medusa}[method]
    save(out, head, saved, target, dtype="bfloat16")
    # evaluated in float32 from the bfloat16 file: XLA:CPU lacks some bf16 x bf16 -> f32
    # dots of these shapes (DotThunk); the values are the saved ones
    head, loaded = head_ckpt.load_head(out, target, "float32", method=method)
    shared = {"embed": target_params["embed"].astype(jnp.float32)}
    started = time.time()
    acceptance = held_out_acceptance(head, loaded, shared, held, FLAGS.prompt_tokens) \
        if held else {}
    report |= {
        "method": method, "parameters": int(sum(x.size for x in jax.tree.leaves(loaded)
                                                if jnp.issubdtype(x.dtype, jnp.floating))),
        "file_bytes": (out / "model.safetensors").stat().st_size,
        "feature_layers": list(head.feature_layers), "ttt_steps": FLAGS.ttt_steps,
        "held_out": {"k": FLAGS.eval_k, "temperature": FLAGS.eval_temperature,
                     "eval_seconds": round(time.time() - started), **acceptance},
        "device": jax.devices()[0].device_kind}
    return report


def load_sequences() -> tuple[np.ndarray, dict[str, np.ndarray], dict]:
    """`sequences()`, or the `--sequences_cache` file of an earlier run."""
    cache = pathlib.Path(FLAGS.sequences_cache or "")
    if FLAGS.sequences_cache and cache.is_file():
        with np.load(cache) as f:
            held = {k: f[k] for k in ("greedy", "sampled") if k in f}
            return f["train"], held, json.loads(str(f["report"]))
    train, held, report = sequences(heads_data.load_tokenizer(FLAGS.target))
    if FLAGS.sequences_cache:
        np.savez(cache, train=train, report=json.dumps(report), **held)
    return train, held, report


def main(argv: list[str]) -> None:
    del argv
    started = time.time()
    train_seqs, held_seqs, data_report = load_sequences()
    layers_used = heads_data.union_layers(
        tuple(int(i) for i in FLAGS.eagle3_layers), (FINAL_NORMED,))
    target, target_params = heads_data.load_target(FLAGS.target)
    feature_started = time.time()
    train = heads_data.extract(target, target_params, train_seqs, layers_used)
    held = {k: heads_data.extract(target, target_params, v, layers_used)
            for k, v in held_seqs.items()}
    data_report["feature_seconds"] = round(time.time() - feature_started)
    print(json.dumps({"data": data_report}), file=sys.stderr)
    results = {}
    for i, method in enumerate(FLAGS.methods):
        size = FLAGS.medusa_vocab if method == "medusa" else FLAGS.draft_vocab
        draft_ids, vocab_report = draft_vocabulary(train_seqs, size, target.vocab_size)
        report = train_method(method, target, target_params, train, held, draft_ids,
                              jax.random.key(FLAGS.seed + i))
        report |= {"data": data_report}
        if method != "eagle":
            report["draft_vocab"] = vocab_report
        out = pathlib.Path(FLAGS.out) / (FLAGS.prefix + method)
        (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
        results[method] = report
        print(json.dumps({method: report["held_out"]}), file=sys.stderr, flush=True)
    keys = ("parameters", "file_bytes", "train_seconds", "first_loss", "final_loss",
            "held_out")
    summary = {m: {k: r[k] for k in keys} for m, r in results.items()}
    print(json.dumps({"total_seconds": round(time.time() - started), "data": data_report,
                      "heads": summary}, indent=1))


if __name__ == "__main__":
    app.run(main)
