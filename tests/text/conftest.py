"""Tokenizer directories in the layouts of real checkpoints, built here (no network):
a byte-level BPE trained on a few sentences, each family's special tokens, its configs and
its chat template. templates/ holds copies of the checkpoints' own: gemma3.jinja is
google/gemma-3-*-it's (tokenizer_config.json), gpt_oss.jinja openai/gpt-oss-*'s
(chat_template.jinja, August 2025), unchanged."""

import json
import pathlib

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

TEMPLATES = pathlib.Path(__file__).parent / "templates"
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                  "<start_of_image>"]
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                    "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"]
CORPUS = ["What is 2+2? And 3+3? It is 20C in Paris.", "Answer briefly. You are terse.",
          "The weather in a city: get_weather(city) returns the temperature."] * 10


def _tokenizer_dir(path: pathlib.Path, specials: list[str], config: dict) -> pathlib.Path:
    """A byte-level BPE trained on CORPUS with `specials`, and its tokenizer_config.json."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> pathlib.Path:
    """Gemma 3's layout: the template inline in tokenizer_config.json."""
    return _tokenizer_dir(tmp_path_factory.mktemp("gemma3"), GEMMA_SPECIALS, {
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "chat_template": (TEMPLATES / "gemma3.jinja").read_text(encoding="utf-8")})


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> pathlib.Path:
    """gpt-oss's layout: the template in chat_template.jinja."""
    path = _tokenizer_dir(tmp_path_factory.mktemp("gpt_oss"), HARMONY_SPECIALS, {
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>"})
    (path / "chat_template.jinja").write_text(
        (TEMPLATES / "gpt_oss.jinja").read_text(encoding="utf-8"), encoding="utf-8")
    return path
