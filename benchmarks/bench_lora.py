"""Multi-LoRA throughput: 64 requests all on the base model vs spread over 8 adapters of
rank 16 on every projection (`max_loras=8`), measured in the same run.

A random-weight model of a preset's shape (default SmolLM-135M) and 8 PEFT adapters
(adapter_config.json + adapter_model.safetensors, random A and B) are written to a
temporary directory. Three runs, each a fresh LLM warmed up before timing: "base" (no
enable_lora: the baseline), "base_on_lora_engine" (enable_lora, every request on the
base model: the slots' cost alone) and "lora" (request i on adapter i % 8). Each
reports output tokens/s and compilations after warm-up; "lora" also the adapter slots'
writes. The slots' bytes (memory_plan.lora_bytes, beside the weights) and the extra
matmul FLOPs per token (every slot's shrink and expand, model/lora.py) are printed with
the base's own. Target: lora at least 0.8x base. Prints one JSON object.

    python benchmarks/bench_lora.py [--preset=smollm-135m] [--dtypes=float32,bfloat16]
        [--num_requests=64] [--output_tokens=64] [--rank=16] [--num_adapters=8]
"""

from __future__ import annotations

import gc
import json
import pathlib
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from jaxinfer import LLM, SamplingParams, testing
from jaxinfer.checkpoint import safetensors_file
from jaxinfer.config import load_preset
from jaxinfer.lora import LoRARequest
from jaxinfer.model import lora as lora_lib
from jaxinfer.sizing import planner

PEFT_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}
TARGET_RATIO = 0.8

flags.DEFINE_string("preset", "smollm-135m", "model shape (a preset name), random weights")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "weight dtypes to run")
flags.DEFINE_integer("num_requests", 64, "requests in the workload")
flags.DEFINE_integer("output_tokens", 64, "tokens generated per request (ignore_eos)")
flags.DEFINE_integer("rank", 16, "the adapters' rank (and max_lora_rank)")
flags.DEFINE_integer("num_adapters", 8, "adapters (and max_loras)")
flags.DEFINE_integer("seed", 0, "workload seed")
FLAGS = flags.FLAGS
SETTINGS = dict(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512,
                compilation_cache_dir="")


def write_adapter(path: pathlib.Path, cfg: object, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter on all seven projections of every layer, random A and B."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for target, name in PEFT_NAMES.items():
            fan_in, fan_out = lora_lib.target_dims(cfg, target)
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(
                0, fan_in ** -0.5, (rank, fan_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(
                0, 0.01, (fan_out, rank)).astype(np.float32)
    path.mkdir(parents=True)
    safetensors_file.save(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": [name.split(".")[1] for name in PEFT_NAMES.values()]}))


def workload(vocab: int) -> tuple[list[list[int]], SamplingParams]:
    rng = np.random.default_rng(FLAGS.seed)
    prompts = [rng.integers(1, vocab, size=int(rng.integers(32, 257))).tolist()
               for _ in range(FLAGS.num_requests)]
    return prompts, SamplingParams(max_tokens=FLAGS.output_tokens, temperature=0.0,
                                   ignore_eos=True)


def run(model_dir: str, dtype: str, prompts: list, params: SamplingParams,
        loras: list[LoRARequest | None], **settings: object) -> dict:
    started = time.perf_counter()
    llm = LLM(model_dir, dtype=dtype, **SETTINGS, **settings)
    used = sorted({lora.lora_int_id: lora for lora in loras if lora}.values(),
                  key=lambda lora: lora.lora_int_id)
    for lora in used:  # read to the host before timing, as a server's --lora_modules
        llm.engine.add_lora(lora)
    llm.generate(prompts[:len(used) or 1], dataclasses_replace(params, max_tokens=2),
                 lora_request=used or None, use_tqdm=False)  # places the adapters
    warm = time.perf_counter() - started
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    metrics = llm.metrics()
    result = {"output_tokens_per_s": round(generated / seconds, 1),
              "seconds": round(seconds, 2), "generated_tokens": generated,
              "warmup_seconds": round(warm, 1),
              "compiles_after_warmup": metrics["compiles_after_warmup"],
              "mean_requests_per_step": metrics["mean_requests_per_step"],
              "weight_bytes": llm.engine.memory_plan.weight_bytes,
              "lora_bytes": llm.engine.memory_plan.lora_bytes}
    if settings.get("enable_lora"):
        result["lora_counts"] = llm.engine.lora_counts()
    del llm
    gc.collect()
    return result


def dataclasses_replace(params: SamplingParams, **changes: object) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **changes)


def flops_per_token(cfg: object, slots: int, rank: int) -> dict:
    """Matmul FLOPs per decode token: the base's (planner.decode_flops, the LM head
    included) and the adapter slots' (every slot's shrink and expand, model/lora.py)."""
    base, _ = planner.decode_flops(cfg)
    extra = 0
    for layer in range(cfg.num_layers):
        for target in lora_lib.layer_targets(cfg, layer):
            fan_in, fan_out = lora_lib.target_dims(cfg, target)
            extra += 2 * slots * rank * (fan_in + fan_out)
    return {"base_matmul_flops_per_token": base, "lora_extra_flops_per_token": extra,
            "lora_extra_flops_fraction": round(extra / base, 3)}


def main(argv: list[str]) -> None:
    del argv
    cfg = load_preset(FLAGS.preset)
    result = {"model": f"random {FLAGS.preset} shape", "num_requests": FLAGS.num_requests,
              "output_tokens": FLAGS.output_tokens, "rank": FLAGS.rank,
              "adapters": FLAGS.num_adapters, **SETTINGS,
              **flops_per_token(cfg, FLAGS.num_adapters, FLAGS.rank)}
    prompts, params = workload(cfg.vocab_size)
    lora = dict(enable_lora=True, max_loras=FLAGS.num_adapters, max_lora_rank=FLAGS.rank)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(testing.make_random_model(pathlib.Path(tmp) / "model", cfg))
        adapters = []
        for i in range(FLAGS.num_adapters):
            write_adapter(pathlib.Path(tmp) / f"a{i}", cfg, FLAGS.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(pathlib.Path(tmp) / f"a{i}")))
        spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
        for dtype in FLAGS.dtypes:
            runs = {"base": run(model_dir, dtype, prompts, params, [None] * len(prompts)),
                    "base_on_lora_engine": run(model_dir, dtype, prompts, params,
                                               [None] * len(prompts), **lora),
                    "lora": run(model_dir, dtype, prompts, params, spread, **lora)}
            ratio = (runs["lora"]["output_tokens_per_s"]
                     / runs["base"]["output_tokens_per_s"])
            result[dtype] = runs | {
                "lora_over_base": round(ratio, 3), "target": TARGET_RATIO,
                "meets_target": ratio >= TARGET_RATIO,
                "lora_bytes_over_weight_bytes": round(
                    runs["lora"]["lora_bytes"] / runs["lora"]["weight_bytes"], 4)}
            print(json.dumps({dtype: result[dtype]}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)
