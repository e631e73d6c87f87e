"""Fused q/k/v and gate/up weights: layout and exact round trips."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion


def _cfg(**kw: int) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=16, hidden_size=8, intermediate_size=384,
                num_layers=1, num_heads=6, num_kv_heads=2, head_dim=4)
    return ModelConfig(**(base | kw))


def test_mlp_block_leaves_block_counts_that_split_over_devices():
    assert fusion.mlp_block(1536) == 64  # 24 blocks: 1, 2, 3, 4, 6, 8 devices
    assert fusion.mlp_block(14336) == 128  # 112 blocks: 1, 2, 4, 8
    assert fusion.mlp_block(29568) == 112  # 264 blocks
    assert fusion.mlp_block(100) == 100  # no count divisible by 8: the largest divisor
    assert fusion.mlp_block(1000) == 125
    for f in (1536, 14336, 18944, 29568, 11008, 8960, 4864, 256):
        block = fusion.mlp_block(f)
        assert f % block == 0 and block <= fusion.MAX_MLP_BLOCK and (f // block) % 8 == 0


def test_gate_up_blocks_interleave_and_round_trip():
    rng = np.random.default_rng(0)
    gate, up = rng.normal(size=(8, 384)), rng.normal(size=(8, 384))
    fused = fusion.fuse_gate_up(gate, up)
    assert fused.shape == (8, 768)
    b = fusion.mlp_block(384)
    assert b == 16  # 24 blocks
    for j in range(24):  # blocks of b: gate_j, then up_j
        np.testing.assert_array_equal(fused[:, 2 * b * j:2 * b * j + b], gate[:, b * j:][:, :b])
        np.testing.assert_array_equal(fused[:, 2 * b * j + b:2 * b * (j + 1)],
                                      up[:, b * j:][:, :b])
    back_gate, back_up = fusion.split_gate_up(fused)
    np.testing.assert_array_equal(back_gate, gate)
    np.testing.assert_array_equal(back_up, up)


def test_layer_round_trip_with_biases():
    cfg = dataclasses.replace(_cfg(), qkv_bias=True)
    rng = np.random.default_rng(1)
    layer = {"wq": rng.normal(size=(8, 24)), "wk": rng.normal(size=(8, 8)),
             "wv": rng.normal(size=(8, 8)), "bq": rng.normal(size=24),
             "bk": rng.normal(size=8), "bv": rng.normal(size=8),
             "w_gate": rng.normal(size=(8, 384)), "w_up": rng.normal(size=(8, 384)),
             "wo": rng.normal(size=(24, 8))}
    fused = fusion.fuse_layer(layer, cfg)
    assert sorted(fused) == ["bqkv", "w_gate_up", "wo", "wqkv"]
    assert fused["wqkv"].shape == (8, (6 + 2 * 2) * 4)
    # Shard 1 of 2 along the fused axis holds KV head 1: query heads 3..5, k_1, v_1.
    shard = np.split(fused["wqkv"], 2, axis=1)[1]
    np.testing.assert_array_equal(shard[:, :12], layer["wq"][:, 12:])
    np.testing.assert_array_equal(shard[:, 12:16], layer["wk"][:, 4:])
    np.testing.assert_array_equal(shard[:, 16:], layer["wv"][:, 4:])
    back = fusion.unfuse_layer(fused, cfg)
    assert sorted(back) == sorted(layer)
    for name, value in layer.items():
        np.testing.assert_array_equal(back[name], value)
