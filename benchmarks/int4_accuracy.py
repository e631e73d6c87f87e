"""int4 accuracy on the demo model: held-out perplexity of float weights,
int4 round-to-nearest and int4 with AWQ scales (jaxinfer/checkpoint/awq.py), asymmetric (the
engine's int4) and symmetric (for the record: why the engine is asymmetric).

Teacher-forced: the dense causal forward (model/transformer.py forward_dense) over
`--windows` windows of `--window_tokens` tokens, one from the start of each of that many
held-out files of the bundled corpus (jaxinfer/text/corpus.py: never trained on, never
calibrated on), tokenized by the demo's tokenizer; perplexity = exp(mean NLL of every
next token). "int4" rows run the engine's int4 pytree and matmul (bf16 activations);
"fake" rows hold the weights rounded through 4 bits and back in float32 (the same
forward for both schemes). Then the engine itself (`LLM(quantization="int4")`, AWQ on
the default calibration, against `LLM()` in float32): greedy continuations of
`--prompts` held-out prompts, the fraction of positions where the tokens agree.
Prints one JSON object.

    python benchmarks/int4_accuracy.py [--windows=32] [--window_tokens=256] [--prompts=32]
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import app, flags

from jaxinfer import checkpoint
from jaxinfer.checkpoint import awq
from jaxinfer.config import DEFAULT_MODEL
from jaxinfer.model import quantization, transformer
from jaxinfer.text import corpus
from jaxinfer.text.tokenizer import Tokenizer

flags.DEFINE_integer("windows", 32, "held-out windows (one per file)")
flags.DEFINE_integer("window_tokens", 256, "tokens per window")
flags.DEFINE_integer("prompts", 32, "engine: held-out prompts (0 skips the engine part)")
flags.DEFINE_integer("prompt_tokens", 32, "engine: tokens per prompt")
flags.DEFINE_integer("output_tokens", 32, "engine: greedy tokens per prompt")
FLAGS = flags.FLAGS


def held_out_windows(tokenizer: Tokenizer, count: int, length: int) -> np.ndarray:
    _, held = corpus.corpus_files()
    windows = []
    for text in corpus.read_texts(held):
        ids = tokenizer.encode(text[:length * 16], add_special_tokens=False)
        if len(ids) >= length:
            windows.append(ids[:length])
        if len(windows) == count:
            break
    return np.asarray(windows, np.int32)


def perplexity(params: dict, cfg: object, windows: np.ndarray) -> float:
    @functools.partial(jax.jit)
    def nll(p: dict, ids: jax.Array) -> jax.Array:
        logits = transformer.forward_dense(p, ids[:, :-1], cfg=cfg)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()
    total = [float(nll(params, jnp.asarray(windows[i:i + 8])))
             for i in range(0, len(windows), 8)]
    return math.exp(float(np.mean(total)))


def fake_symmetric_int4(w: np.ndarray) -> np.ndarray:
    """Symmetric 4-bit: codes -7..7 times a bf16 max|w| / 7 per group (same groups)."""
    rows, columns = w.shape
    groups = w.reshape(rows // quantization.int4_group(rows), -1, columns)
    step = (np.abs(groups).max(axis=1) / np.float32(7)).astype(ml_dtypes.bfloat16)
    step = np.where(step > 0, step, 1).astype(np.float32)[:, None]
    return (np.clip(np.round(groups / step), -7, 7) * step).reshape(rows, columns)


def fake_quantized(params: dict, quantizer: awq.Quantizer) -> dict:
    layers = [{k: quantizer(np.asarray(v, np.float32)) if k in quantization.QUANTIZED_WEIGHTS
               else v for k, v in layer.items()} for layer in params["layers"]]
    return params | {"layers": layers}


def greedy_agreement(prompts: list[list[int]]) -> dict:
    """Greedy continuations of the float32 and int4 engines: agreeing positions."""
    from jaxinfer import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=FLAGS.output_tokens, ignore_eos=True)
    outputs = {}
    for mode in (None, "int4"):
        llm = LLM(DEFAULT_MODEL, quantization=mode, max_num_seqs=8,
                  max_num_batched_tokens=256, max_model_len=128)
        outputs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
    pairs = [(a, b) for x, y in zip(outputs[None], outputs["int4"], strict=True)
             for a, b in zip(x, y, strict=True)]
    same_first = sum(x[0] == y[0] for x, y in zip(outputs[None], outputs["int4"], strict=True))
    return {"prompts": len(prompts), "output_tokens": FLAGS.output_tokens,
            "token_agreement": round(sum(a == b for a, b in pairs) / len(pairs), 4),
            "first_token_agreement": round(same_first / len(prompts), 4)}


def main(argv: list[str]) -> None:
    del argv
    cfg = checkpoint.load_config(DEFAULT_MODEL)
    params = jax.device_get(checkpoint.load_params(DEFAULT_MODEL, cfg, "float32"))
    tokenizer = Tokenizer.from_dir(DEFAULT_MODEL)
    windows = held_out_windows(tokenizer, FLAGS.windows, FLAGS.window_tokens)
    calibration = awq.calibration_token_ids(tokenizer, None, max_len=cfg.max_position_embeddings)
    out = {"windows": list(windows.shape), "calibration_windows": list(calibration.shape)}
    ppl = {"float32": perplexity(params, cfg, windows)}
    ppl["int4_rtn"] = perplexity(quantization.quantize_params(params, "int4"), cfg, windows)
    started = time.perf_counter()
    awq_params = awq.calibrate(params, cfg, calibration)
    out["awq_seconds"] = round(time.perf_counter() - started, 1)
    ppl["int4_awq"] = perplexity(quantization.quantize_params(awq_params, "int4"), cfg, windows)
    for name, quantizer in (("asymmetric", awq.fake_int4), ("symmetric", fake_symmetric_int4)):
        ppl[f"fake_{name}_rtn"] = perplexity(fake_quantized(params, quantizer), cfg, windows)
        scaled = awq.calibrate(params, cfg, calibration, quantizer)
        ppl[f"fake_{name}_awq"] = perplexity(fake_quantized(scaled, quantizer), cfg, windows)
    out["perplexity"] = {k: round(v, 4) for k, v in ppl.items()}
    out["vs_float32"] = {k: round(v / ppl["float32"] - 1, 4) for k, v in ppl.items()}
    if FLAGS.prompts:
        prompts = held_out_windows(tokenizer, FLAGS.windows + FLAGS.prompts,
                                   FLAGS.prompt_tokens)[FLAGS.windows:]  # other files
        out["engine_greedy"] = greedy_agreement([list(map(int, p)) for p in prompts])
    sys.stdout.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    app.run(main)
