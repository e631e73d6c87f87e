"""Mixture-of-experts models against transformers, and the expert paths against the
dense reference (every expert for every token)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer import LLM, SamplingParams, checkpoint, testing
from jaxinfer.config import ModelConfig, ModelOptions, MoEConfig
from jaxinfer.engine.runner import Chunk, Runner
from jaxinfer.model import fusion, moe, quantization, sharding, transformer

MOE = testing.MOE_FAMILIES
TOL = 1e-4


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, size=length).tolist()


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].numpy()


@pytest.mark.parametrize("family", MOE)
def test_paged_forward_matches_transformers(family, hf_model_dirs, hf_models):
    """A whole prompt, then single-token steps (decode-sized buckets)."""
    cfg = checkpoint.load_config(hf_model_dirs[family])
    assert cfg.moe is not None
    runner = Runner(cfg, checkpoint.load_params(hf_model_dirs[family], cfg), num_pages=16,
                    page_size=8, max_model_len=64)
    ids = _prompt(1, 24)
    pages = [5, 2, 11, 7]
    pieces = [testing.logits(runner, [Chunk(ids[:20], 0, pages)])]
    pieces += [testing.logits(runner, [Chunk(ids[i:i + 1], i, pages)]) for i in range(20, 24)]
    diff = np.abs(np.concatenate(pieces) - _hf_logits(hf_models[family], ids)).max()
    print(f"{family}: max abs logit diff {diff:.2e}")
    assert diff < TOL


def test_qwen2_moe_layers_follow_mlp_only_layers_and_the_shared_expert(hf_model_dirs):
    cfg = checkpoint.load_config(hf_model_dirs["qwen2_moe"])
    params = checkpoint.load_params(hf_model_dirs["qwen2_moe"], cfg)
    moe_layer, dense_layer = params["layers"]
    assert cfg.moe.mlp_only_layers == (1,) and not cfg.moe.norm_topk_prob
    assert {"w_router", "we_gate_up", "we_down", "ws_gate_up", "ws_down",
            "w_shared_gate"} <= set(moe_layer) and "w_gate_up" not in moe_layer
    assert "w_router" not in dense_layer and dense_layer["w_down"].shape == (128, 64)
    assert moe_layer["we_gate_up"].shape == (8, 64, 64) and moe_layer["we_down"].shape == (
        8, 64, 32)  # [E, 2F, D] and [E, D, F], as HF stores each expert


def test_router_ties_take_the_lower_expert_and_match_transformers(tmp_path):
    """Two identical router rows: the two experts' probabilities are exactly equal for
    every token. jaxinfer gives a tie at the top-k boundary to the lower index
    (`jax.lax.top_k`, on every backend); torch's CPU top-k picks by its selection
    algorithm's order, so the two experts' weights are made equal too: the logits then
    match whichever one each side takes."""
    model = testing.make_hf_model(tmp_path, "mixtral", seed=5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight[6] = layer.mlp.gate.weight[1]
            for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                weight[6] = weight[1]
    model.save_pretrained(tmp_path)
    cfg = checkpoint.load_config(tmp_path)
    params = checkpoint.load_params(tmp_path, cfg)
    ids = _prompt(3, 40)
    x = params["embed"][jnp.asarray(ids)]
    _, experts = moe.route(x, params["layers"][0]["w_router"], cfg)
    chosen = np.asarray(experts)
    one, six = (chosen == 1).any(-1), (chosen == 6).any(-1)
    assert (one & ~six).any() and not (six & ~one).any()  # ties occur; 1 always wins
    ours = transformer.forward_dense(params, jnp.asarray(ids)[None], cfg=cfg)[0]
    assert np.abs(np.asarray(ours) - _hf_logits(model, ids)).max() < TOL


def _random_layer(cfg: ModelConfig, seed: int) -> dict:
    params = transformer.init_params(cfg, jax.random.key(seed), std=0.3)
    return params["layers"][0]


@pytest.mark.parametrize("tokens", [1, 2, 5, 40])
@pytest.mark.parametrize("shared", [0, 24])
def test_expert_paths_match_the_dense_reference(tokens, shared):
    """Gathered (tokens * k < E) and grouped paths give every expert's weighted sum."""
    cfg = ModelConfig(architecture="qwen2_moe", vocab_size=32, hidden_size=16,
                      intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, moe=MoEConfig(num_experts=16, num_experts_per_tok=3,
                                                intermediate_size=24, norm_topk_prob=False,
                                                shared_expert_intermediate_size=shared))
    layer = _random_layer(cfg, tokens)
    x = jax.random.normal(jax.random.key(7), (tokens, 16))
    got = np.asarray(moe.moe_block(layer, x, cfg))
    want = np.asarray(testing.dense_reference(layer, x, cfg))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _hf_greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens, EOS included (as `ignore_eos` generates them)."""
    ids = list(ids)
    for _ in range(steps):
        ids.append(int(_hf_logits(model, ids)[-1].argmax()))
    return ids[-steps:]


@pytest.fixture(scope="module", params=MOE)
def moe_llm(request, hf_model_dirs):
    """Chunked prefill (16-token steps) and a KV pool of 14 pages of 8 tokens: the
    four requests below need 24, so some are preempted and resumed."""
    llm = LLM(model=hf_model_dirs[request.param], page_size=8, max_model_len=96,
              max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory_bytes=14 * 8 * 512,
              compilation_cache_dir="", strict_compile=True)
    return request.param, llm


def test_generate_greedy_matches_transformers_with_batching(moe_llm, hf_models):
    family, llm = moe_llm
    shared = _prompt(4, 19)  # two prompts share 16 tokens: a prefix hit
    prompts = [shared + _prompt(5, 4), shared + _prompt(6, 7), _prompt(7, 11), _prompt(8, 30)]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _hf_greedy(hf_models[family], prompt, 20)
    metrics = llm.metrics()
    assert metrics["preemptions"] > 0 and metrics["prefix_cache_hit_tokens"] >= 16
    assert metrics["compiles_after_warmup"] == 0


def test_expert_parallel_needs_experts(hf_model_dirs):
    cfg = checkpoint.load_config(hf_model_dirs["llama"])
    with pytest.raises(ValueError, match="enable_expert_parallel=True needs a mixture"):
        ModelOptions(expert_parallel=True).check(cfg)


@pytest.mark.parametrize("path", ["_gathered", "_grouped", "_all_experts"])
def test_each_expert_path_matches_the_reference_with_foreign_choices(path):
    """Each path on its own (CPU picks `_all_experts` over `_grouped` for big buckets, so
    the grouped matmul TPU and GPU run is checked here), with some choices naming
    another device's experts (id `held`, weight 0) as expert parallelism passes them."""
    held, tokens, k, d, f = 6, 5, 3, 16, 24
    keys = jax.random.split(jax.random.key(3), 4)
    w_gate_up = 0.3 * jax.random.normal(keys[0], (held, 2 * f, d))
    w_down = 0.3 * jax.random.normal(keys[1], (held, d, f))
    x = jax.random.normal(keys[2], (tokens, d))
    experts = jax.random.randint(keys[3], (tokens, k), 0, held + 1)  # held: foreign
    weights = jnp.where(experts < held, jax.random.uniform(keys[3], (tokens, k)), 0.0)
    block = fusion.mlp_block(f)
    want = np.zeros((tokens, d), np.float32)
    for t in range(tokens):
        for j in range(k):
            e = int(experts[t, j])
            if e < held:
                h = np.asarray(w_gate_up[e] @ x[t])
                hidden = np.asarray(moe._swiglu_rows(jnp.asarray(h), block))
                want[t] += float(weights[t, j]) * (np.asarray(w_down[e]) @ hidden)
    got = getattr(moe, path)(x, w_gate_up, w_down, weights, experts, block)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_decode_step_reads_only_the_chosen_experts_in_the_compiled_hlo():
    """XLA:CPU's compiled MoE layer for 2 tokens of 64 experts (top-2): the experts are
    touched only by gathers of 4 experts' rows; no dot, fusion or copy takes the whole
    [64, ...] stacks. A bucket of 64 tokens reads them whole (every expert)."""
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=32, hidden_size=32,
                      intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=16, moe=MoEConfig(num_experts=64, num_experts_per_tok=2,
                                                 intermediate_size=48))
    layer = _random_layer(cfg, 0)

    def compiled(tokens: int) -> str:
        x = jnp.zeros((tokens, 32))
        return jax.jit(lambda l, x: moe.moe_block(l, x, cfg)).lower(layer, x).compile(
        ).as_text()

    def results_of_expert_users(hlo: str) -> list[str]:
        """The result shapes of the instructions that take a whole expert stack."""
        names = re.findall(r"(%l__we_\w+\.\d+) = f32\[64,", hlo)
        assert len(names) == 2, hlo[:500]
        return [line.split("=", 1)[1].split()[0] for line in hlo.splitlines()
                if " = " in line and "parameter(" not in line
                and any(re.search(re.escape(n) + r"[,)]", line) for n in names)]

    small = results_of_expert_users(compiled(2))  # 4 choices: a gather fusion each
    assert sorted(small) == ["f32[4,32,48]{2,1,0}", "f32[4,96,32]{2,1,0}"], small
    big = results_of_expert_users(compiled(64))  # 128 choices: every expert
    assert big and not any(shape.startswith("f32[4,") for shape in big), big


def test_a_router_biased_to_one_expert_shows_in_the_imbalance_metric(tmp_path, hf_model_dirs):
    """Channel 0 of every token's embedding set to 3 (so it stays positive through the
    norms) and layer 0's router row 3 reading only that channel: every token chooses
    expert 3 there. Greedy tokens still match transformers; the routed counts cover every
    real token k times (no padding) and reach the E / k = 4 ceiling in layer 0."""
    model = testing.make_hf_model(tmp_path, "mixtral", seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 3.0
        router = model.model.layers[0].mlp.gate.weight
        router[3] = 0.0
        router[3, 0] = 10.0
    model.save_pretrained(tmp_path)
    prompts = [_prompt(10, 12), _prompt(11, 25)]
    counts, fed_tokens = {}, {}
    for name, path in (("biased", tmp_path), ("plain", hf_model_dirs["mixtral"])):
        llm = LLM(model=path, page_size=8, max_model_len=64, max_num_seqs=2,
                  max_num_batched_tokens=16, compilation_cache_dir="", enable_prefix_caching=False)
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0,
                                                    ignore_eos=True))
        metrics = llm.metrics()
        counts[name] = metrics
        if name == "biased":
            for prompt, out in zip(prompts, outs, strict=True):
                assert out.token_ids == _hf_greedy(model, prompt, 10)
        fed = sum(len(p) for p in prompts) + 2 * 9 + metrics["discarded_tokens"]
        fed_tokens[name] = fed
        assert [sum(row) for row in metrics["expert_tokens"]] == [2 * fed] * 2
    biased = counts["biased"]
    assert max(range(8), key=lambda e: biased["expert_tokens"][0][e]) == 3
    assert biased["expert_tokens"][0][3] == fed_tokens["biased"]  # every token, once
    assert biased["expert_load_imbalance_per_layer"][0] == 4.0
    assert biased["expert_load_imbalance"] > counts["plain"]["expert_load_imbalance"]


@pytest.mark.parametrize("mode", ["int8", "w8a8", "fp8"])
@pytest.mark.parametrize("path", ["_gathered", "_grouped", "_all_experts"])
def test_quantized_experts_compute_as_their_dequantized_weights(mode, path):
    """Each expert quantized as `quantize` quantizes a weight (a scale per output row);
    every path gives what the dequantized float experts give (w8a8: up to its
    activation rounding; the grouped path runs it weight-only)."""
    held, tokens, k, d, f = 6, 5, 2, 32, 24
    keys = jax.random.split(jax.random.key(4), 4)
    w_gate_up = 0.3 * jax.random.normal(keys[0], (held, 2 * f, d))
    w_down = 0.3 * jax.random.normal(keys[1], (held, d, f))
    q_gate_up, q_down = (quantization.quantize_experts(w, mode) for w in (w_gate_up, w_down))
    assert q_gate_up.value.shape == (held, 2 * f, d) and q_gate_up.scale.shape == (held, 2 * f)
    one = quantization.quantize(w_gate_up[2].T, mode)
    np.testing.assert_array_equal(np.asarray(q_gate_up.value[2], np.float32),
                                  np.asarray(one.value, np.float32))
    x = jax.random.normal(keys[2], (tokens, d))
    experts = jax.random.randint(keys[3], (tokens, k), 0, held)
    weights = jax.random.uniform(keys[3], (tokens, k))
    block = fusion.mlp_block(f)

    def dequantized(q):
        return q.value.astype(jnp.float32) * q.scale[..., None]

    want = moe._gathered(x, dequantized(q_gate_up), dequantized(q_down), weights, experts,
                         block)
    got = getattr(moe, path)(x, q_gate_up, q_down, weights, experts, block)
    tol = 0.05 if mode == "w8a8" and path != "_grouped" else 0.01  # bf16 activations
    np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                               atol=tol * float(jnp.abs(want).max()))


def test_quantized_moe_model_holds_int8_experts_the_planner_counts(hf_model_dirs):
    from jaxinfer.engine.runner import tree_bytes
    from jaxinfer.sizing import planner

    llm = LLM(model=hf_model_dirs["qwen2_moe"], quantization="w8a8", max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=16, compilation_cache_dir="")
    layer = llm.engine.runner.params["layers"][0]
    for key in ("we_gate_up", "we_down", "ws_gate_up", "ws_down"):
        assert quantization.is_quantized(layer[key]) and layer[key].value.dtype == jnp.int8
    assert not quantization.is_quantized(layer["w_router"])
    assert not quantization.is_quantized(layer["w_shared_gate"])
    cfg = llm.engine.runner.cfg
    assert tree_bytes(llm.engine.runner.params) == planner.weight_bytes(
        cfg, "float32", quantization="w8a8")
    (out,) = llm.generate([_prompt(12, 9)], SamplingParams(max_tokens=6, temperature=0.0))
    assert len(out.token_ids) == 6


@pytest.mark.parametrize("rows", [8, 40, 128])
def test_megablox_path_matches_ragged_dot_and_zeroes_rows_outside_groups(rows):
    """TPU's grouped matmul for small buckets, in Pallas interpret mode: the rows of each
    group through its expert, and rows past every group (other devices' choices) 0."""
    held, d, o = 4, 128, 256
    keys = jax.random.split(jax.random.key(5), 2)
    x = jax.random.normal(keys[0], (rows, d))
    w = jax.random.normal(keys[1], (held, o, d))
    sizes = jnp.array([rows // 4, rows // 8, 0, rows // 2], jnp.int32)
    group = jnp.minimum(jnp.repeat(jnp.arange(held), sizes, total_repeat_length=rows),
                        held - 1)
    got = np.asarray(moe._megablox_dot(x, w, sizes, group, interpret=True))
    want = np.asarray(moe._ragged_dot(x, w, sizes, group))
    real = int(sizes.sum())
    np.testing.assert_allclose(got[:real], want[:real], rtol=1e-4, atol=1e-3)
    assert not got[real:].any()


def _biased_reference(layer: dict, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Each token through its chosen experts one by one, biases included."""
    weights, experts = (np.asarray(a) for a in moe.route(jnp.asarray(x),
                                                         layer["w_router"], cfg))
    block = fusion.mlp_block(cfg.moe.intermediate_size)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t], strict=True):
            h = np.asarray(layer["we_gate_up"][e]) @ x[t] + np.asarray(layer["be_gate_up"][e])
            hidden = np.asarray(moe._swiglu_rows(jnp.asarray(h), block))
            out[t] += w * (np.asarray(layer["we_down"][e]) @ hidden
                           + np.asarray(layer["be_down"][e]))
    return out


@pytest.mark.parametrize("tokens", [1, 40, 80])
@pytest.mark.parametrize("shards, expert_parallel", [(1, False), (4, True), (4, False)])
def test_per_expert_biases_on_every_path_and_split(tokens, shards, expert_parallel):
    """Biases on the experts' gate/up [E, 2F] and down [E, D] outputs (gpt-oss has them):
    the gathered path (1 token), every expert (40 and 80: both CPU forms), split by
    expert or inside each expert over 4 devices (the down bias added once)."""
    moe_cfg = MoEConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=32)
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=32, hidden_size=16,
                      intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, moe=moe_cfg)
    layer = _random_layer(cfg, 1)
    keys = jax.random.split(jax.random.key(6), 3)
    layer["be_gate_up"] = jax.random.normal(keys[0], (8, 64))
    layer["be_down"] = jax.random.normal(keys[1], (8, 16))
    x = np.asarray(jax.random.normal(keys[2], (tokens, 16)))
    mesh = sharding.make_mesh(shards)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda l, x: moe.moe_block(l, x, cfg, expert_parallel=expert_parallel))(
            layer, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), _biased_reference(layer, x, cfg),
                               rtol=1e-4, atol=1e-4)
    weights, experts = moe.route(jnp.asarray(x), layer["w_router"], cfg)  # TPU's path
    grouped = moe._grouped(jnp.asarray(x), (layer["we_gate_up"], layer["be_gate_up"]),
                           layer["we_down"], weights, experts, fusion.mlp_block(32))
    grouped += jnp.einsum("tk,tkd->td", weights, layer["be_down"][experts])
    np.testing.assert_allclose(np.asarray(grouped), _biased_reference(layer, x, cfg),
                               rtol=1e-4, atol=1e-4)
