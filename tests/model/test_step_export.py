"""The whole step with the GPU (Triton) attention kernel, split over 4 devices (tensor
parallelism), exported for CUDA on a host without a GPU (`jax.export`, platforms=["cuda"]).

Export stops before XLA partitions the program, so the module holds the mesh, the
Runner's shardings on the arguments (runner.step_shardings), and the attention in a
manual computation (`shard_map`) whose Triton call sees one device's heads; the
all-reduces are inserted later, by the compiler on the GPU (see tests/tpu_aot for
counts from a real TPU compile). Needs 4 CPU devices (tests/conftest.py gives 8).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.config import DEFAULT_OPTIONS, ModelConfig, ModelOptions
from jaxinfer.engine.core.buckets import Bucket
from jaxinfer.engine.runner.programs import (
    input_spec,
    mask_spec,
    on_shardings,
    state_spec,
    step_function,
    step_shardings,
)
from jaxinfer.model import moe, sharding
from jaxinfer.model.attention import kv_cache_spec
from jaxinfer.model.params_table import param_shapes
from jaxinfer.model.quantization import quantize_params
from jaxinfer.pallas import AttentionSettings

TRITON_CALL = "__gpu$xla.gpu.triton"
TP, PAGES, PAGE_SIZE, MAX_LEN = 4, 33, 16, 128
BUCKETS = (Bucket(4, 4, True), Bucket(16, 4, False))


def _export(cfg: ModelConfig, bucket: Bucket, quantization: str | None = None,
            kv_dtype: str = "bfloat16", options: ModelOptions = DEFAULT_OPTIONS
            ) -> jax.export.Exported:
    """The step of `cfg` (the served model) for `bucket`, bf16, with the GPU kernel,
    exported for CUDA."""
    mesh = sharding.make_mesh(TP)
    params_sh, kv_sh, whole = step_shardings(cfg, mesh, quantization, kv_dtype=kv_dtype,
                                             options=options)
    shapes = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16),
                          param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    if quantization is not None:
        shapes = jax.eval_shape(functools.partial(quantize_params, mode=quantization), shapes)
    kv = kv_cache_spec(cfg, num_pages=PAGES, page_size=PAGE_SIZE, dtype=kv_dtype,
                       backend="gpu", shards=TP)
    step = jax.jit(step_function(cfg, page_size=PAGE_SIZE, decode_only=bucket.decode,
                                 attention=AttentionSettings(impl="gpu"), options=options),
                   in_shardings=(params_sh, kv_sh, whole, whole, whole),
                   out_shardings=(kv_sh, whole, whole), donate_argnums=(1, 2))
    inputs = input_spec(bucket, page_size=PAGE_SIZE)
    state = state_spec(bucket.num_slots, page_size=PAGE_SIZE, max_model_len=MAX_LEN,
                       experts=moe.routing_shape(cfg))
    with jax.set_mesh(mesh):
        return jax.export.export(
            step, platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
        )(on_shardings(shapes, params_sh), on_shardings(kv, kv_sh),
          on_shardings(state, whole), on_shardings(inputs, whole),
          on_shardings(mask_spec(bucket, cfg.vocab_size), whole))


@pytest.mark.parametrize("num_kv_heads", [4, 2])  # 2: each KV head copied to 2 devices
@pytest.mark.parametrize("bucket", BUCKETS, ids=["decode", "mixed"])
def test_step_with_gpu_kernel_in_shard_map_exports_for_cuda(num_kv_heads, bucket):
    if jax.device_count() < TP:
        pytest.skip(f"needs {TP} devices (tests/conftest.py sets jax_num_cpu_devices)")
    cfg = sharding.served_config(ModelConfig(
        architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=384,
        num_layers=2, num_heads=8, num_kv_heads=num_kv_heads, head_dim=32), TP)
    exported = _export(cfg, bucket)
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",) and exported.nr_devices == TP
    assert f'sdy.mesh @mesh = <["model"={TP}]>' in text
    assert text.count("sdy.manual_computation") == cfg.num_layers  # attention per layer
    assert text.count(TRITON_CALL) == cfg.num_layers
    # Inside shard_map each device's kernel sees its one KV head (K and V: 2 rows of
    # the page), not the model's 4: grid_y counts KV heads.
    assert f"tensor<{PAGES}x{PAGE_SIZE}x2x32xbf16>" in text
    assert "grid_y = 1 : i32" in text and "grid_y = 4 : i32" not in text
    # The Runner's shardings on the arguments: wqkv by columns, wo by rows, KV by head.
    assert '#sdy.sharding<@mesh, [{}, {"model"}]>' in text
    assert '#sdy.sharding<@mesh, [{"model"}, {}]>' in text
    assert '#sdy.sharding<@mesh, [{}, {}, {"model"}, {}, {}]>' in text
    assert exported.out_avals[0].shape == (PAGES, PAGE_SIZE, TP, 2, 32)  # whole KV array


@pytest.mark.parametrize("mode, weight", [("w8a8", "i8"), ("int8", "i8"),
                                          ("fp8", "f8E4M3FN")])
def test_quantized_step_exports_for_cuda(mode, weight):
    """int8 x int8 -> int32 dots (w8a8), or int8/fp8 weights converted inside the step
    (weight-only), split over 4 devices as the float step."""
    if jax.device_count() < TP:
        pytest.skip(f"needs {TP} devices (tests/conftest.py sets jax_num_cpu_devices)")
    cfg = sharding.served_config(ModelConfig(
        architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=384,
        num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32), TP)
    text = _export(cfg, BUCKETS[0], quantization=mode).mlir_module()
    assert f"tensor<512x128x{weight}>" in text  # wqkv values [O, I]: (8 + 2 x 4) x 32 rows
    assert f"tensor<256x128x{weight}>" in text  # the LM head's quantized copy [V, D]
    dots = re.findall(r"stablehlo.dot_general[^\n]*", text)
    int8_dots = [d for d in dots if "xi8>, tensor<" in d and "xi32>" in d]
    assert len(int8_dots) == (4 * cfg.num_layers + 1 if mode == "w8a8" else 0)


@pytest.mark.parametrize("kv_dtype, stored", [("int8", "i8"), ("fp8", "f8E4M3FN")])
def test_step_with_8bit_kv_and_scales_exports_for_cuda(kv_dtype, stored):
    """8-bit pages and their f32 scales per token and head (pallas/kv_quant.py), both
    split by KV head; the Triton kernel reads the scales."""
    if jax.device_count() < TP:
        pytest.skip(f"needs {TP} devices (tests/conftest.py sets jax_num_cpu_devices)")
    cfg = sharding.served_config(ModelConfig(
        architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=384,
        num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32), TP)
    exported = _export(cfg, BUCKETS[1], kv_dtype=kv_dtype)
    text = exported.mlir_module()
    assert text.count(TRITON_CALL) == cfg.num_layers
    # inside shard_map: one KV head's pages (padded to a word of 4) and its 2 scales
    assert f"tensor<{PAGES}x{PAGE_SIZE}x1x4x32x{stored}>" in text
    assert f"tensor<{PAGES}x{PAGE_SIZE}x2xf32>" in text
    assert '#sdy.sharding<@mesh, [{}, {}, {"model"}]>' in text  # the scales, by head
    pages, scales = exported.out_avals[:2]
    assert pages.shape == (PAGES, PAGE_SIZE, TP, 4, 32)
    assert scales.shape == (PAGES, PAGE_SIZE, 2 * TP) and scales.dtype == jnp.float32


def test_int4_step_exports_for_cuda():
    """int4 weights (packed uint8 codes, bf16 group scales) unpacked and scaled inside
    the step, then bf16 dots; wo and w_down split by rows over 4 devices in whole groups
    of 128 (512 and 512 inputs, 128 rows a device)."""
    if jax.device_count() < TP:
        pytest.skip(f"needs {TP} devices (tests/conftest.py sets jax_num_cpu_devices)")
    cfg = sharding.served_config(ModelConfig(
        architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=512,
        num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64), TP)
    text = _export(cfg, BUCKETS[0], quantization="int4").mlir_module()
    assert "tensor<64x1024xui8>" in text  # wqkv: 128 rows packed two a byte, 16 x 64 cols
    assert "tensor<2x1x1024xbf16>" in text  # its step and offset: one group of 128 rows
    assert "tensor<256x128xui8>" in text  # w_down [512, 128] packed
    assert "stablehlo.shift_right_logical" in text  # the high nibbles, unpacked on device
    dots = re.findall(r"stablehlo.dot_general[^\n]*", text)
    assert not [d for d in dots if "xui8>" in d]  # weight-only: bf16 dots
    assert "tensor<256x128xi8>" in text  # the LM head: int8 [V, D], weight-only


@pytest.mark.parametrize("expert_parallel", [True, False])
def test_moe_step_exports_for_cuda_with_grouped_experts(expert_parallel):
    """A Qwen3-MoE step over 4 devices: per layer a manual computation for attention and
    one for the experts; the mixed bucket (64 choices of 8 experts) lowers the grouped
    matmul to XLA's ragged dot for CUDA, the decode bucket (4 tokens x 2 = 8 choices, not
    fewer than the 8 experts held without expert parallelism, 2 with) as well."""
    if jax.device_count() < TP:
        pytest.skip(f"needs {TP} devices (tests/conftest.py sets jax_num_cpu_devices)")
    from jaxinfer.config import MoEConfig

    cfg = sharding.served_config(ModelConfig(
        architecture="qwen3_moe", vocab_size=256, hidden_size=128, intermediate_size=384,
        num_layers=2, num_heads=8, num_kv_heads=4, head_dim=32, qk_norm=True,
        moe=MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=64)), TP)
    options = ModelOptions(expert_parallel=expert_parallel)
    for bucket in BUCKETS:
        text = _export(cfg, bucket, options=options).mlir_module()
        assert text.count("sdy.manual_computation") == 2 * cfg.num_layers
        ops = re.findall(r'stablehlo\.composite "chlo\.ragged_dot"', text)  # gate/up, down
        assert len(ops) == 2 * cfg.num_layers, (bucket, len(ops))
