"""Embedding throughput against sentence-transformers, same machine, same run
(docs/pooling.md): random-weight models of the BERT-base shape (mean pooling) and the
Qwen3-Embedding-0.6B shape (last-token pooling), `--num_docs` documents of 20-500 words,
one token a word (a word-level tokenizer, so both sides see the same tokens), in float32
and bfloat16. Input tokens/s of `LLM.embed` (packed steps, or the paged engine for the
decoder) against `SentenceTransformer.encode` (length-sorted padded batches of
`--st_batch_size`), the ratio, each side's padding waste, and the two sides' cosine.
`--layers`: fewer layers than the shape's (the width is the shape's); both sides run
the same model. Prints JSON.

    python benchmarks/bench_embed.py [--num_docs=2000] [--layers=2] [--shapes=bert,qwen3]
"""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from jaxinfer import testing

flags.DEFINE_integer("num_docs", 2000, "documents embedded by each side")
flags.DEFINE_integer("layers", 0, "layers of each model (0: the shape's own)")
flags.DEFINE_list("shapes", ["bert", "qwen3"], "model shapes: bert, qwen3")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "weight dtypes")
flags.DEFINE_integer("st_batch_size", 32, "sentence-transformers' batch size (its default)")
flags.DEFINE_integer("max_num_batched_tokens", 8192, "jaxinfer's tokens per step")
flags.DEFINE_integer("seed", 0, "documents' lengths and words")
FLAGS = flags.FLAGS

SHAPES = {
    "bert": dict(kind="bert", vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                 num_attention_heads=12, intermediate_size=3072,
                 max_position_embeddings=512, pooling="mean"),
    "qwen3": dict(kind="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=3072, max_position_embeddings=32768,
                  tie_word_embeddings=True, pooling="lasttoken"),
}


def documents(count: int, vocab: int, seed: int) -> list[str]:
    """`count` texts of 20-500 words "w<id>" (each one token)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 501, count)
    return [" ".join(f"w{t}" for t in rng.integers(10, vocab, n)) for n in lengths]


def build(shape: dict, root: pathlib.Path) -> pathlib.Path:
    """A sentence-transformers directory of a random model of `shape`."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    torch.manual_seed(0)
    fields = {k: v for k, v in shape.items() if k not in ("kind", "pooling")}
    if FLAGS.layers:
        fields["num_hidden_layers"] = FLAGS.layers
    config = (transformers.BertConfig(**fields) if shape["kind"] == "bert"
              else transformers.Qwen3Config(**fields))
    model = transformers.AutoModel.from_config(config, dtype=torch.float32)
    bare = root / "bare"
    model.save_pretrained(bare)
    testing.write_word_tokenizer(bare, shape["vocab_size"],
                                 "bert" if shape["kind"] == "bert" else "decoder")
    transformer = modules.Transformer(str(bare), max_seq_length=512)
    st = SentenceTransformer(modules=[
        transformer, modules.Pooling(config.hidden_size, shape["pooling"]),
        modules.Normalize()])
    st.save(str(root / "st"))
    return root / "st"


def st_side(path: pathlib.Path, texts: list[str], dtype: str) -> tuple[dict, np.ndarray]:
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(path), model_kwargs={"dtype": getattr(torch, dtype)})
    st.encode(texts[:8], batch_size=FLAGS.st_batch_size)  # first call's costs
    lengths = [len(st.tokenize([t])["input_ids"][0]) for t in texts]
    began = time.perf_counter()
    vectors = st.encode(texts, batch_size=FLAGS.st_batch_size, convert_to_numpy=True)
    seconds = time.perf_counter() - began
    return {"seconds": round(seconds, 2), "tokens": sum(lengths),
            "tokens_per_s": round(sum(lengths) / seconds, 1),
            "padding_waste": round(st_waste(texts, lengths), 4)}, vectors.astype(np.float32)


def st_waste(texts: list[str], lengths: list[int]) -> float:
    """Padded tokens over all tokens of sentence-transformers' batches: it sorts the
    texts by character length, longest first, and pads each batch to its longest."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    size, padded = FLAGS.st_batch_size, 0
    for begin in range(0, len(order), size):
        batch = [lengths[i] for i in order[begin:begin + size]]
        padded += max(batch) * len(batch)
    return 1 - sum(lengths) / padded


def jaxinfer_side(path: pathlib.Path, texts: list[str], dtype: str
                  ) -> tuple[dict, np.ndarray]:
    from jaxinfer import LLM

    llm = LLM(str(path), dtype=dtype, max_model_len=512, max_num_seqs=64,
              max_num_batched_tokens=FLAGS.max_num_batched_tokens,
              compilation_cache_dir="")
    llm.embed(texts[:8])  # first call's costs
    engine = llm.llm_engine
    before = padding_counts(engine)
    began = time.perf_counter()
    outputs = llm.embed(texts)
    seconds = time.perf_counter() - began
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    result = {"seconds": round(seconds, 2), "tokens": tokens,
              "tokens_per_s": round(tokens / seconds, 1)}
    real, padded = (b - a for a, b in zip(before, padding_counts(engine), strict=True))
    result["padding_waste"] = round(1 - real / padded, 4)
    return result, np.array([o.outputs.embedding for o in outputs], np.float32)


def padding_counts(engine: object) -> tuple[int, int]:
    """(real, padded) tokens the engine's steps have run so far."""
    backend = engine.backend
    if engine.is_encoder:
        return backend.real_tokens, backend.padded_tokens
    metrics = backend.engine.metrics
    return metrics.real_tokens, metrics.padded_tokens


def one(name: str, dtype: str, path: pathlib.Path, texts: list[str]) -> dict:
    ours, ours_vectors = jaxinfer_side(path, texts, dtype)
    theirs, their_vectors = st_side(path, texts, dtype)
    assert ours["tokens"] == theirs["tokens"], (ours["tokens"], theirs["tokens"])
    cosine = (ours_vectors * their_vectors).sum(-1) / (
        np.linalg.norm(ours_vectors, axis=-1) * np.linalg.norm(their_vectors, axis=-1))
    return {"shape": name, "dtype": dtype, "jaxinfer": ours, "sentence_transformers": theirs,
            "ratio": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
            "min_cosine": round(float(cosine.min()), 6)}


def main(argv: list[str]) -> None:
    del argv
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        for name in FLAGS.shapes:
            shape = SHAPES[name]
            path = build(shape, root / name)
            texts = documents(FLAGS.num_docs, min(shape["vocab_size"], 30000), FLAGS.seed)
            for dtype in FLAGS.dtypes:
                results.append(one(name, dtype, path, texts))
                print(json.dumps(results[-1]), flush=True)
    print(json.dumps({
        "date": datetime.date.today().isoformat(), "machine": platform.processor(),
        "jax": jax.__version__, "num_docs": FLAGS.num_docs,
        "layers": FLAGS.layers or "shape's", "results": results}, indent=1))


if __name__ == "__main__":
    app.run(main)
