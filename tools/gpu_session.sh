#!/usr/bin/env bash
# What a lent GPU machine (an H100 here) runs, in stages, from the repo root:
#   bash tools/gpu_session.sh standing     # FIRST: the standing table (docs/benchmarks.md)
#   bash tools/gpu_session.sh kernels      # Triton kernel on device vs reference, bench_attention
#   bash tools/gpu_session.sh train        # the larger demo pair (corpus from .gpu/stdlib.tar.gz)
#   bash tools/gpu_session.sh throughput   # engine tokens/s on a random Llama-3.1-8B shape, bf16
# Several stages may be given; each has its own time limit so one overrun cannot eat the
# others. Results go to $OUT (default ./out). The machine's own JAX (with CUDA) runs the
# repo from the checkout (PYTHONPATH=.), not our pinned CPU JAX. `.gpu/stdlib.tar.gz` is
# the Python 3.11.7 standard library (.py files) the demo pair is trained on, packed with:
#   (cd "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" &&
#    find . -name '*.py' -not -path '*/site-packages/*' -print0 |
#    tar --null -czf "$OLDPWD/.gpu/stdlib.tar.gz" -T -)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
log() { echo "== $(date +%T) $*"; }

# The standing table: vLLM's random-data throughput workload, batch-1 decode against the
# weight-read bound and the 128-request mixed run on a random Llama-3.1-8B shape in bf16,
# each part under its own limit (535 s at most in all; about 5 minutes expected).
# COMMIT names the commit measured where the checkout carries no .git.
standing() {
  log "standing table, random Llama-3.1-8B shape, bf16"
  timeout "${STANDING_LIMIT:-560}" $PY benchmarks/bench_standing_table.py \
    --preset=llama3.1-8b --dtype=bfloat16 --save_dtype=bfloat16 \
    --num_prompts=1000 --input_len=256 --output_len=256 \
    --max_num_seqs=256 --max_num_batched_tokens=8192 --compile_threads=8 \
    --model_limit_s=120 --vllm_random_limit_s=240 --batch1_limit_s=75 --mixed128_limit_s=100 \
    ${COMMIT:+--commit="$COMMIT"} > "$OUT/standing_table.json"
  cat "$OUT/standing_table.json"
}

kernels() {
  log "device"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import jax; print(jax.__version__, jax.devices())"
  log "Triton kernel on the device vs the reference"
  timeout 200 $PY -m pytest -q -m accelerator -p no:cacheprovider \
    tests/pallas/test_rpa_gpu_device.py 2>&1 | tail -30
  log "bench_attention: Llama-3.1-8B layer, bf16, Triton vs XLA reference"
  timeout 200 $PY benchmarks/bench_attention.py --dtype=bfloat16 --requests=1,8,32,64 \
    --contexts=1024,4096,8192 --repeats=10 > "$OUT/bench_attention_h100.json"
  tail -c 3000 "$OUT/bench_attention_h100.json"
}

train() {
  log "train the larger demo pair"
  rm -rf /tmp/corpus /tmp/demo_out && mkdir -p /tmp/corpus /tmp/demo_out
  tar xzf .gpu/stdlib.tar.gz -C /tmp/corpus
  timeout "${TRAIN_LIMIT:-300}" $PY tools/train_demo.py --out=/tmp/demo_out --size=large \
    --corpus_dir=/tmp/corpus --batch=32 --main_steps="${MAIN_STEPS:-3000}" \
    --draft_steps="${DRAFT_STEPS:-3000}" --lr=2e-3 2>&1 | tail -40
  tar czf "$OUT/demo_models.tar.gz" -C /tmp/demo_out . && ls -la "$OUT"
}

throughput() {
  log "engine throughput, random Llama-3.1-8B shape, bf16"
  timeout "${THROUGHPUT_LIMIT:-540}" $PY benchmarks/bench_throughput.py --preset=llama3.1-8b \
    --dtypes=bfloat16 --save_dtype=bfloat16 --skip=transformers --max_num_seqs=32 \
    --max_num_batched_tokens=256 --static_batch=16 --compile_threads=8 \
    > "$OUT/bench_throughput_h100.json"
  cat "$OUT/bench_throughput_h100.json"
}

for stage in "$@"; do
  "$stage" 2>&1 | tee -a "$OUT/log.txt"
done
