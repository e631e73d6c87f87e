"""An encoder checkpoint (BERT, XLM-RoBERTa: safetensors as transformers saves them)
read into model/encoder.py's params: with or without the `bert.` / `roberta.` prefix,
q/k/v fused, linear weights transposed to [in, out]. A missing tensor, or one this
engine would not use and does not know to be unused, is an error naming it. See
docs/pooling.md#encoder-models.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np

from jaxinfer.checkpoint import safetensors_file
from jaxinfer.config.encoder import EncoderConfig
from jaxinfer.model.encoder import param_shapes

PREFIXES = ("bert.", "roberta.")  # a *ForSequenceClassification's encoder
# saved but never read: position ids buffers; the pooler of a model without a head
UNUSED = ("embeddings.position_ids", "embeddings.token_type_ids")
# older checkpoints name LayerNorm's parameters gamma and beta
OLD_NAMES = {".gamma": ".weight", ".beta": ".bias"}


def load_encoder_params(model_dir: str | os.PathLike, cfg: EncoderConfig,
                        dtype: str) -> dict:
    """The params of the encoder at `model_dir` as numpy arrays of `dtype`."""
    import ml_dtypes

    root = pathlib.Path(model_dir)
    tensors = _tensors(root)
    wanted = hf_names(cfg)
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise ValueError(f"{root}: checkpoint lacks tensor(s) {missing[:5]} of "
                         f"{cfg.architecture}")
    unknown = sorted(n for n in tensors if n not in wanted and not _unused(n, cfg))
    if unknown:
        raise ValueError(f"{root}: unexpected tensor(s) {unknown[:5]}; config.json does "
                         "not describe this checkpoint")
    cast = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    params = _assemble(tensors, cfg)
    shapes = param_shapes(cfg)
    _check_shapes(params, shapes, root)
    return jax.tree.map(lambda x: np.asarray(x, np.float32).astype(cast), params)


def hf_names(cfg: EncoderConfig) -> list[str]:
    """The tensor names the params are read from (unprefixed)."""
    names = ["embeddings.word_embeddings.weight", "embeddings.position_embeddings.weight",
             "embeddings.token_type_embeddings.weight", "embeddings.LayerNorm.weight",
             "embeddings.LayerNorm.bias"]
    for i in range(cfg.num_layers):
        names += [f"encoder.layer.{i}.{part}.{kind}" for part in _LAYER_PARTS
                  for kind in ("weight", "bias")]
    if cfg.head == "bert_pooler":
        names += ["pooler.dense.weight", "pooler.dense.bias", "classifier.weight",
                  "classifier.bias"]
    elif cfg.head == "roberta_head":
        names += ["classifier.dense.weight", "classifier.dense.bias",
                  "classifier.out_proj.weight", "classifier.out_proj.bias"]
    return names


_LAYER_PARTS = ("attention.self.query", "attention.self.key", "attention.self.value",
                "attention.output.dense", "attention.output.LayerNorm",
                "intermediate.dense", "output.dense", "output.LayerNorm")


def _unused(name: str, cfg: EncoderConfig) -> bool:
    return name in UNUSED or (cfg.head != "bert_pooler" and name.startswith("pooler."))


def _tensors(root: pathlib.Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors by unprefixed, current name."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{root}: no model.safetensors or "
                                "model.safetensors.index.json")
    out = {}
    for file in files:
        for name, tensor in safetensors_file.load(root / file).items():
            out[_current_name(name)] = tensor
    return out


def _current_name(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for old, new in OLD_NAMES.items():
        if name.endswith(old):
            name = name[: -len(old)] + new
    return name


def _assemble(t: dict[str, np.ndarray], cfg: EncoderConfig) -> dict:
    params = {"word_embed": t["embeddings.word_embeddings.weight"],
              "position_embed": t["embeddings.position_embeddings.weight"],
              "type_embed": t["embeddings.token_type_embeddings.weight"],
              "embed_norm": t["embeddings.LayerNorm.weight"],
              "embed_norm_bias": t["embeddings.LayerNorm.bias"],
              "layers": [_layer(t, f"encoder.layer.{i}.") for i in range(cfg.num_layers)]}
    if cfg.head == "bert_pooler":
        params["head"] = _head(t, "pooler.dense", "classifier")
    elif cfg.head == "roberta_head":
        params["head"] = _head(t, "classifier.dense", "classifier.out_proj")
    return params


def _layer(t: dict[str, np.ndarray], p: str) -> dict:
    q, k, v = (f"{p}attention.self.{n}" for n in ("query", "key", "value"))
    return {
        "wqkv": np.concatenate([t[f"{n}.weight"].T for n in (q, k, v)], axis=1),
        "bqkv": np.concatenate([t[f"{n}.bias"] for n in (q, k, v)]),
        "wo": t[f"{p}attention.output.dense.weight"].T,
        "bo": t[f"{p}attention.output.dense.bias"],
        "attn_norm": t[f"{p}attention.output.LayerNorm.weight"],
        "attn_norm_bias": t[f"{p}attention.output.LayerNorm.bias"],
        "w_in": t[f"{p}intermediate.dense.weight"].T, "b_in": t[f"{p}intermediate.dense.bias"],
        "w_out": t[f"{p}output.dense.weight"].T, "b_out": t[f"{p}output.dense.bias"],
        "mlp_norm": t[f"{p}output.LayerNorm.weight"],
        "mlp_norm_bias": t[f"{p}output.LayerNorm.bias"]}


def _head(t: dict[str, np.ndarray], dense: str, out: str) -> dict:
    return {"w_dense": t[f"{dense}.weight"].T, "b_dense": t[f"{dense}.bias"],
            "w_out": t[f"{out}.weight"].T, "b_out": t[f"{out}.bias"]}


def _check_shapes(params: dict, shapes: dict, root: pathlib.Path, path: str = "") -> None:
    if isinstance(shapes, tuple):
        if tuple(params.shape) != shapes:
            raise ValueError(f"{root}: {path} has shape {tuple(params.shape)}, expected "
                             f"{shapes} from config.json")
        return
    items = shapes.items() if isinstance(shapes, dict) else enumerate(shapes)
    for key, shape in items:
        _check_shapes(params[key], shape, root, f"{path}/{key}")
