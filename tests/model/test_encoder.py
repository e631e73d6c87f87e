"""The encoder (model/encoder.py) over packed rows against transformers' BERT and
XLM-RoBERTa on tiny random checkpoints: every token's last hidden state of each input
run alone, the classifier heads' logits, bfloat16 weights; and the checkpoint reader's
and config reader's refusals."""

from __future__ import annotations

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer import testing
from jaxinfer.checkpoint import safetensors_file
from jaxinfer.checkpoint.encoder import load_encoder_params
from jaxinfer.config.encoder import EncoderConfig, is_encoder
from jaxinfer.model import encoder

ARCHITECTURES = ("bert", "xlm_roberta")
LENGTHS = (40, 1, 23, 7, 31, 12, 9)  # first fit into 2 rows of 64: 40+1+23 and 7+31+12+9
ROWS, WIDTH = 2, 64


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(architecture, num_labels) -> (directory, torch model, EncoderConfig), made once."""
    made = {}

    def get(architecture: str, num_labels: int = 0):
        key = (architecture, num_labels)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{architecture}-{num_labels}")
            model = testing.make_encoder_model(path, architecture, num_labels=num_labels)
            cfg = EncoderConfig.from_hf(json.loads((path / "config.json").read_text()))
            made[key] = path, model, cfg
        return made[key]

    return get


def _inputs(cfg: EncoderConfig, lengths=LENGTHS, seed: int = 0):
    """Random (ids, token types) per input; ids avoid the padding id (XLM-R numbers
    positions by it), types are random where the model has two."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(cfg.pad_token_id + 1, cfg.vocab_size, n)
        types = rng.integers(0, cfg.type_vocab_size, n)
        out.append((ids, types))
    return out


def _pack(inputs, rows: int = ROWS, width: int = WIDTH):
    """First fit into rows of `width`: the four i32[rows, width] arrays forward takes
    and each input's (row, start)."""
    arrays = [np.zeros((rows, width), np.int32) for _ in range(4)]
    token_ids, types, positions, segments = arrays
    used, places = [0] * rows, []
    for ids, kinds in inputs:
        r = next(r for r in range(rows) if used[r] + len(ids) <= width)
        span = slice(used[r], used[r] + len(ids))
        token_ids[r, span], types[r, span] = ids, kinds
        positions[r, span] = np.arange(len(ids))
        segments[r, span] = segments[r].max() + 1
        places.append((r, used[r]))
        used[r] += len(ids)
    return arrays, places


@functools.cache
def _jitted(cfg: EncoderConfig):
    return jax.jit(functools.partial(encoder.forward, cfg=cfg))


def _run(params, inputs, cfg: EncoderConfig, **pack):
    arrays, places = _pack(inputs, **pack)
    hidden = np.asarray(_jitted(cfg)(params, *(jnp.asarray(a) for a in arrays)))
    return hidden, arrays, places


def _hf(model, ids, types):
    with torch.no_grad():
        out = model(torch.tensor(ids)[None], token_type_ids=torch.tensor(types)[None])
    return out


def _cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_packed_inputs_match_each_input_alone(saved, architecture):
    path, model, cfg = saved(architecture)
    params = load_encoder_params(path, cfg, "float32")
    inputs = _inputs(cfg)
    hidden, (_, _, _, segments), places = _run(params, inputs, cfg)
    assert hidden.shape == (ROWS, WIDTH, cfg.hidden_size) and hidden.dtype == np.float32
    assert {r for r, _ in places} == {0, 1} and segments[1].max() == 4
    for (ids, types), (r, start) in zip(inputs, places, strict=True):
        want = _hf(model, ids, types).last_hidden_state[0].numpy()
        got = hidden[r, start:start + len(ids)]
        assert _cosines(got, want).min() >= 0.99999
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.isfinite(hidden).all()  # the padding at row 1's end too


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_rows_of_several_key_blocks_match_each_input_alone(saved, architecture):
    """Rows of 4 * KEY_BLOCK tokens: the online softmax over key blocks, with inputs
    across block edges and a query whose first key blocks are all masked."""
    path, model, cfg = saved(architecture)
    params = load_encoder_params(path, cfg, "float32")
    inputs = _inputs(cfg, lengths=(100, 120, 128, 90, 30, 5), seed=1)
    width = 4 * encoder.KEY_BLOCK
    hidden, _, places = _run(params, inputs, cfg, rows=1, width=width)
    assert max(start for _, start in places) > 2 * encoder.KEY_BLOCK
    for (ids, types), (r, start) in zip(inputs, places, strict=True):
        want = _hf(model, ids, types).last_hidden_state[0].numpy()
        got = hidden[r, start:start + len(ids)]
        assert _cosines(got, want).min() >= 0.99999
        np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_longest_input_uses_every_position(saved, architecture):
    path, model, cfg = saved(architecture)
    assert cfg.max_len == 128
    params = load_encoder_params(path, cfg, "float32")
    inputs = _inputs(cfg, lengths=(cfg.max_len,), seed=1)
    hidden, _, _ = _run(params, inputs, cfg, rows=1, width=cfg.max_len)
    want = _hf(model, *inputs[0]).last_hidden_state[0].numpy()
    np.testing.assert_allclose(hidden[0], want, atol=1e-4)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("num_labels", [1, 3])
def test_classifier_logits_match_transformers(saved, architecture, num_labels):
    path, model, cfg = saved(architecture, num_labels)
    assert cfg.num_labels == num_labels
    assert cfg.head == ("bert_pooler" if architecture == "bert" else "roberta_head")
    params = load_encoder_params(path, cfg, "float32")
    inputs = _inputs(cfg, seed=2)
    hidden, _, places = _run(params, inputs, cfg)
    first = jnp.asarray(np.stack([hidden[r, start] for r, start in places]))
    logits = np.asarray(encoder.classify(params, first, cfg=cfg))
    want = np.stack([_hf(model, ids, types).logits[0].numpy() for ids, types in inputs])
    assert logits.shape == (len(inputs), num_labels) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, want, atol=1e-4)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_bfloat16_weights_stay_close(saved, architecture):
    path, model, cfg = saved(architecture)
    params = load_encoder_params(path, cfg, "bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    inputs = _inputs(cfg, seed=3)
    hidden, _, places = _run(params, inputs, cfg)
    assert hidden.dtype == np.float32 and np.isfinite(hidden).all()
    for (ids, types), (r, start) in zip(inputs, places, strict=True):
        want = _hf(model, ids, types).last_hidden_state[0].numpy()
        assert _cosines(hidden[r, start:start + len(ids)], want).mean() >= 0.99


def test_init_params_fit_param_shapes_and_padding_rows_stay_finite():
    cfg = EncoderConfig(architecture="xlm_roberta", vocab_size=50, hidden_size=32,
                        num_layers=1, num_heads=2, intermediate_size=64,
                        max_position_embeddings=34, type_vocab_size=1,
                        layer_norm_eps=1e-5, hidden_act="gelu_new", pad_token_id=1,
                        position_offset=2, num_labels=2, head="roberta_head")
    params = encoder.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    shapes = jax.tree.map(lambda x: x.shape, params)
    assert shapes == encoder.param_shapes(cfg)
    assert params["layers"][0]["wqkv"].shape == (32, 96)
    ids = np.random.default_rng(0).integers(2, 50, (1, 5))
    inputs = [(ids[0], np.zeros(5, np.int32))]
    hidden, _, _ = _run(params, inputs, cfg, rows=3, width=16)  # rows 1, 2 all padding
    assert np.isfinite(hidden).all()
    logits = encoder.classify(params, jnp.asarray(hidden[:, 0]), cfg=cfg)
    assert logits.shape == (3, 2) and np.isfinite(np.asarray(logits)).all()


# ---- the checkpoint reader ------------------------------------------------------------


def _rewrite(src, dst, change) -> None:
    """A copy of the checkpoint at `src` in `dst`, its tensors passed through `change`."""
    shutil.copytree(src, dst)
    tensors = {k: np.array(v) for k, v in safetensors_file.load(src / "model.safetensors")
               .items()}
    safetensors_file.save(change(tensors), dst / "model.safetensors")


def test_loader_reads_shards_and_ignores_known_unused_tensors(saved, tmp_path):
    path, _, cfg = saved("bert")
    whole = load_encoder_params(path, cfg, "float32")
    tensors = safetensors_file.load(path / "model.safetensors")
    assert any(name.startswith("pooler.") for name in tensors)  # BertModel's, unused
    shutil.copytree(path, tmp_path / "sharded")
    (tmp_path / "sharded" / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        shard = {("bert." + n): np.array(tensors[n]) for n in part}  # prefixed, as saved
        shard |= {"bert.embeddings.position_ids": np.arange(128)[None]} if i else {}
        safetensors_file.save(shard, tmp_path / "sharded" / file)
        weight_map |= dict.fromkeys(shard, file)
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = load_encoder_params(tmp_path / "sharded", cfg, "float32")
    jax.tree.map(np.testing.assert_array_equal, sharded, whole)


def test_loader_refuses_unknown_and_missing_tensors(saved, tmp_path):
    path, _, cfg = saved("xlm_roberta", 3)
    _rewrite(path, tmp_path / "extra",
             lambda t: t | {"lm_head.dense.weight": np.zeros((64, 64), np.float32)})
    with pytest.raises(ValueError, match="lm_head.dense.weight"):
        load_encoder_params(tmp_path / "extra", cfg, "float32")
    gone = "roberta.encoder.layer.1.output.dense.bias"
    _rewrite(path, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != gone})
    with pytest.raises(ValueError, match="encoder.layer.1.output.dense.bias"):
        load_encoder_params(tmp_path / "missing", cfg, "float32")
    with pytest.raises(ValueError, match="classifier"):  # a head config.json lacks
        bare = EncoderConfig.from_hf(json.loads((path / "config.json").read_text())
                                     | {"architectures": ["XLMRobertaModel"]})
        load_encoder_params(path, bare, "float32")


# ---- the config reader ----------------------------------------------------------------


def test_config_reads_what_transformers_saves(saved):
    bert, xlmr = saved("bert")[2], saved("xlm_roberta", 3)[2]
    assert (bert.architecture, bert.position_offset, bert.max_len, bert.head) == (
        "bert", 0, 128, None)
    assert (xlmr.architecture, xlmr.position_offset, xlmr.max_len, xlmr.head,
            xlmr.num_labels) == ("xlm_roberta", 2, 128, "roberta_head", 3)
    hf = json.loads((saved("bert")[0] / "config.json").read_text())
    assert is_encoder(hf) and EncoderConfig.from_hf(hf) == bert
    for model_type, arch in (("bert", "bert"), ("xlm-roberta", "xlm_roberta"),
                             ("roberta", "xlm_roberta")):
        bare = {k: v for k, v in hf.items() if k != "architectures"} | {
            "model_type": model_type}
        assert is_encoder(bare) and EncoderConfig.from_hf(bare).architecture == arch
    roberta = hf | {"architectures": ["RobertaForSequenceClassification"], "num_labels": 1}
    assert EncoderConfig.from_hf(roberta).head == "roberta_head"
    assert not is_encoder({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


@pytest.mark.parametrize("field,value", [
    ("position_embedding_type", "relative_key"), ("is_decoder", True),
    ("add_cross_attention", True), ("hidden_act", "relu"),
    ("architectures", ["BertForMaskedLM"])])
def test_config_refusals_name_the_field(saved, field, value):
    hf = json.loads((saved("bert")[0] / "config.json").read_text())
    with pytest.raises(ValueError, match=field):
        EncoderConfig.from_hf(hf | {field: value})
