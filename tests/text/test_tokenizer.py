"""Tokenizer parity with transformers on tiny tokenizers built at test time, and streaming."""

import json
import pathlib

import jinja2
import pytest
import transformers
from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as HFTokenizer

from jaxinfer.text.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "héllo wörld 你好 🙂 naïve café crème brûlée",
    "你好世界，你好吗？我很好。 こんにちは 안녕하세요",
    "emoji: 🙂😀🎉👍🏽 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "The model answered: 42. Ünïcödé ß ø å — “quotes” …",
] * 20

TEXTS = [
    "hello world",
    " leading space and  double  spaces ",
    "héllo wörld 你好 🙂",
    "你好世界🎉👍🏽 café",
    "line one\nline two\n\n\ttab",
    "👨‍👩‍👧 🇫🇷 ß…",
]

# Llama-3-like: bos once, loop.index0, whitespace that trim_blocks/lstrip_blocks shape.
LLAMA3_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {% endif %}
    {% if loop.index0 == 0 and message['role'] == 'system' %}
<|start_header_id|>system<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
    {% else %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# ChatML-like with tools rendered through tojson.
CHATML_TEMPLATE = """{% if tools %}<|im_start|>system
{{ tools | tojson(indent=2) }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if loop.first and message.role != 'system' %}<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% if loop.last and message.role == 'user' and false %}{{ raise_exception('never') }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "  You are a terse assistant. Réponds en français.  "},
    {"role": "user", "content": "Bonjour! 你好 🙂"},
    {"role": "assistant", "content": "Salut.\n  Ça va?"},
    {"role": "user", "content": "Encore une fois.", "name": None},
]


def _write_json(path: pathlib.Path, data: object) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _byte_level_dir(path: pathlib.Path) -> pathlib.Path:
    """A Llama-3-like byte-level BPE that adds BOS, with configs and an inline chat template."""
    specials = ["<|begin_of_text|>", "<|endoftext|>", "<|eot_id|>",
                "<|start_header_id|>", "<|end_header_id|>"]  # fmt: skip
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False, "__type": "AddedToken"},
        "chat_template": LLAMA3_TEMPLATE,
    })  # fmt: skip
    _write_json(path / "generation_config.json",
                {"eos_token_id": [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|eot_id|>")]})
    return path


def _byte_fallback_dir(path: pathlib.Path) -> pathlib.Path:
    """A sentencepiece-style BPE (Llama-2-like): "▁" pieces, <0xNN> byte fallback, ChatML file."""
    base = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    base += list("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?:'")
    merges = [("▁", "h"), ("e", "l"), ("▁h", "el"), ("l", "o"), ("▁hel", "lo"), ("▁", "w"),
              ("o", "r"), ("▁w", "or"), ("l", "d"), ("▁wor", "ld"), ("▁", "t"), ("h", "e"),
              ("▁t", "he"), ("▁", "c"), ("a", "f"), ("▁c", "af")]  # fmt: skip
    vocab = {token: i for i, token in enumerate(base)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    tok.add_special_tokens([AddedToken(t, special=True) for t in
                            ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]])  # fmt: skip
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    })  # fmt: skip
    _write_json(path / "config.json", {"bos_token_id": 1, "eos_token_id": 2})
    (path / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {"byte_level": _byte_level_dir(root / "byte_level"),
            "byte_fallback": _byte_fallback_dir(root / "byte_fallback")}  # fmt: skip


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def pair(request, dirs) -> tuple[Tokenizer, transformers.PreTrainedTokenizerBase]:
    path = dirs[request.param]
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    deltas, i, k = [], 0, 0
    while i < len(ids):
        size = chunks[k % len(chunks)]
        deltas.append(detok.add(ids[i : i + size]))
        i, k = i + size, k + 1
    return deltas


def test_tokenizer_encode_matches_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs(
            text, add_special_tokens=False)["input_ids"], text  # fmt: skip
    assert ours.encode("hello")[0] == ours.bos_token_id
    assert ours.vocab_size == len(theirs)


def test_tokenizer_byte_fallback_encodes_cjk_as_bytes(dirs):
    tok = Tokenizer.from_dir(dirs["byte_fallback"])
    ids = tok.encode("你🙂", add_special_tokens=False)
    pieces = [tok._backend.id_to_token(i) for i in ids]
    assert pieces == ["▁", "<0xE4>", "<0xBD>", "<0xA0>", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]


def test_tokenizer_decode_matches_transformers(pair):
    ours, theirs = pair
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
        assert ours.decode(ids[1:]) == text  # round trip


def test_tokenizer_chat_template_matches_transformers(pair):
    ours, theirs = pair
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES) == expected
    one = MESSAGES[1:2]
    expected = theirs.apply_chat_template(one, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(MESSAGES[1:2], add_generation_prompt=False) == expected


def test_tokenizer_chat_template_tools_tojson_matches_transformers(dirs):
    path = dirs["byte_fallback"]
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"ville": "東京"}}}]
    expected = theirs.apply_chat_template(MESSAGES[1:], tools=tools, tokenize=False,
                                          add_generation_prompt=True)  # fmt: skip
    rendered = Tokenizer.from_dir(path).apply_chat_template(MESSAGES[1:], tools=tools)
    assert rendered == expected
    assert '"name": "météo"' in rendered and "\n  " in rendered


def test_tokenizer_chat_template_globals_match_transformers(tmp_path, dirs):
    (tmp_path / "tokenizer.json").write_bytes((dirs["byte_level"] / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}"
        "|{{ ns.n }}|{{ strftime_now('%Y') }}|{{ dict(a=1) | tojson }}|{{ extra }}|{{ tools }}",
        encoding="utf-8",
    )
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "ça <b>&</b> 你好"},
                {"role": "assistant", "content": "ok"}]
    expected = theirs.apply_chat_template(messages, tokenize=False, extra="x")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages, extra="x") == expected
    assert expected.startswith('"ça <b>&</b> 你好""ok"|2|')


def test_tokenizer_chat_template_namespace_refuses_underscores(tmp_path, dirs):
    (tmp_path / "tokenizer.json").write_bytes((dirs["byte_level"] / "tokenizer.json").read_bytes())
    template = "{% set ns = namespace(a=1) %}{% set ns._x = 2 %}{{ ns.a }}"
    _write_json(tmp_path / "tokenizer_config.json", {"chat_template": template})
    with pytest.raises(ValueError, match="underscore-prefixed"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES)


def test_tokenizer_chat_template_llama3_exact_text(dirs):
    tok = Tokenizer.from_dir(dirs["byte_level"])
    rendered = tok.apply_chat_template(MESSAGES[:2])
    # trim_blocks eats the newline after a block tag, lstrip_blocks the indent before one;
    # the newline after an expression or after text stays.
    assert rendered == (
        "<|begin_of_text|>\n<|start_header_id|>system<|end_header_id|>\n\n"
        "You are a terse assistant. Réponds en français.<|eot_id|>\n"
        "<|start_header_id|>user<|end_header_id|>\n\nBonjour! 你好 🙂<|eot_id|>\n"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_tokenizer_chat_template_raise_exception_gives_value_error(dirs):
    tok = Tokenizer.from_dir(dirs["byte_level"])
    with pytest.raises(ValueError, match="Unknown role: robot") as info:
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert isinstance(info.value.__cause__, jinja2.TemplateError)


def test_tokenizer_chat_template_list_picks_default(tmp_path, dirs):
    path = tmp_path / "tok"
    path.mkdir()
    (path / "tokenizer.json").write_bytes((dirs["byte_level"] / "tokenizer.json").read_bytes())
    _write_json(path / "tokenizer_config.json", {"chat_template": [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
    ]})  # fmt: skip
    tok = Tokenizer.from_dir(path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"


def test_tokenizer_chat_template_file_wins_over_config(tmp_path, dirs):
    path = tmp_path / "tok"
    path.mkdir()
    (path / "tokenizer.json").write_bytes((dirs["byte_level"] / "tokenizer.json").read_bytes())
    _write_json(path / "tokenizer_config.json", {"chat_template": "CONFIG"})
    (path / "chat_template.jinja").write_text("FILE", encoding="utf-8")
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False)
    assert Tokenizer.from_dir(path).apply_chat_template(MESSAGES) == expected == "FILE"


def test_tokenizer_special_ids_union_of_configs(dirs):
    tok = Tokenizer.from_dir(dirs["byte_level"])
    backend = tok._backend
    assert tok.eos_token_ids == {backend.token_to_id("<|endoftext|>"),
                                 backend.token_to_id("<|eot_id|>")}  # fmt: skip
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert tok.bos_token_id == backend.token_to_id("<|begin_of_text|>")
    fallback = Tokenizer.from_dir(dirs["byte_fallback"])
    assert (fallback.eos_token_ids, fallback.bos_token_id) == ({2}, 1)


def test_tokenizer_eos_ids_merge_int_list_and_token(tmp_path, dirs):
    path = tmp_path / "tok"
    path.mkdir()
    (path / "tokenizer.json").write_bytes((dirs["byte_fallback"] / "tokenizer.json").read_bytes())
    _write_json(path / "generation_config.json", {"eos_token_id": [7, 8], "bos_token_id": 5})
    _write_json(path / "config.json", {"eos_token_id": 9})
    _write_json(path / "tokenizer_config.json", {"eos_token": {"content": "</s>"}})
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token_ids == frozenset({2, 7, 8, 9})
    assert (tok.bos_token_id, tok.bos_token, tok.eos_token) == (5, None, "</s>")


@pytest.mark.parametrize("chunks", [[1], [3, 1, 2, 5], [7]])
def test_detokenizer_deltas_concatenate_to_decode(pair, chunks):
    ours, _ = pair
    held = 0
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        detok = ours.detokenizer()
        deltas = _stream(detok, ids, chunks)
        assert "".join(deltas) == detok.text == ours.decode(ids), text
        assert not any("\ufffd" in d for d in deltas), (text, deltas)
        held += deltas.count("")
    if chunks == [1]:
        assert held > 10  # characters spanning several tokens were held back


def test_detokenizer_prompt_seed_keeps_leading_space(pair):
    ours, _ = pair
    prompt = ours.encode("the quick brown fox")
    for text in TEXTS:
        ids = ours.encode(" " + text, add_special_tokens=False)
        if ours.bos_token == "<s>":  # sentencepiece: drop the prepended "▁" piece of the normalizer
            ids = ours.encode(text, add_special_tokens=False)
        detok = ours.detokenizer(prompt)
        deltas = _stream(detok, ids, [1, 2])
        whole, head = ours.decode(prompt + ids), ours.decode(prompt)
        assert "".join(deltas) == whole[len(head) :], text
        assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_prompt_seed_gives_sentencepiece_leading_space(dirs):
    tok = Tokenizer.from_dir(dirs["byte_fallback"])
    prompt, ids = tok.encode("hello"), tok.encode("world 你", add_special_tokens=False)
    assert tok._backend.id_to_token(ids[0]) == "▁world"
    assert tok.detokenizer(prompt).add(ids) == " world 你"
    assert tok.detokenizer().add(ids) == tok.decode(ids) == "world 你"


def test_detokenizer_holds_across_cross_character_tokens(dirs):
    tok = Tokenizer.from_dir(dirs["byte_level"])
    ids = tok.encode("🎉👍🏽 ok", add_special_tokens=False)
    pieces = [tok._backend.id_to_token(i) for i in ids]
    assert "įðŁ" in pieces  # one token ends 👍 and starts 🏽
    for size in range(1, len(ids) + 1):
        detok = tok.detokenizer()
        deltas = _stream(detok, ids, [size])
        assert detok.text == "🎉👍🏽 ok" and not any("\ufffd" in d for d in deltas)


def test_detokenizer_holds_byte_fallback_bytes_until_character_completes(dirs):
    tok = Tokenizer.from_dir(dirs["byte_fallback"])
    ids = tok.encode("hello 🙂", add_special_tokens=False)  # ..., ▁, F0, 9F, 99, 82
    detok = tok.detokenizer()
    deltas = [detok.add([i]) for i in ids]
    assert deltas[-4:] == ["", "", "", "🙂"]
    assert "".join(deltas) == "hello 🙂"


def test_detokenizer_emits_complete_part_of_chunk_and_holds_tail(dirs):
    tok = Tokenizer.from_dir(dirs["byte_fallback"])
    ids = tok.encode("hello 你", add_special_tokens=False)  # ..., ▁, E4, BD, A0
    detok = tok.detokenizer()
    assert detok.add(ids[:-1]) == "hello "
    assert detok.add(ids[-1:]) == "你"


def test_detokenizer_skips_special_tokens(pair):
    ours, _ = pair
    eos = min(ours.eos_token_ids)
    ids = ours.encode("héllo 🙂", add_special_tokens=False) + [eos]
    assert "".join(_stream(ours.detokenizer(), ids, [1])) == ours.decode(ids)
    kept = "".join(_stream(ours.detokenizer(skip_special_tokens=False), ids, [1]))
    assert kept == ours.decode(ids, skip_special_tokens=False)
    assert kept.endswith(ours._backend.id_to_token(eos))


def test_detokenizer_window_stays_bounded(pair):
    ours, _ = pair
    prompt = ours.encode("prompt")
    ids = ours.encode("héllo wörld 你好 🙂 " * 50, add_special_tokens=False)
    detok = ours.detokenizer(prompt)
    longest = 0
    for i in ids:
        detok.add([i])
        longest = max(longest, len(detok._ids))
    assert longest <= 10
    assert detok.text == ours.decode(prompt + ids)[len(ours.decode(prompt)) :]


def test_detokenizer_invalid_utf8_is_emitted_eventually(dirs):
    tok = Tokenizer.from_dir(dirs["byte_fallback"])
    lone = tok._backend.token_to_id("<0xFF>")
    detok = tok.detokenizer()
    _stream(detok, [lone] * 20, [1])
    assert "\ufffd" in detok.text


def test_tokenizer_from_dir_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory .*nope.* does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_tokenizer_from_dir_missing_tokenizer_json(tmp_path):
    _write_json(tmp_path / "config.json", {})
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("content", ["{not json", "{}", '{"model": {"type": "Nope"}}'])
def test_tokenizer_from_dir_corrupt_tokenizer_json(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_tokenizer_from_dir_corrupt_config_names_file(tmp_path, dirs):
    (tmp_path / "tokenizer.json").write_bytes((dirs["byte_level"] / "tokenizer.json").read_bytes())
    (tmp_path / "generation_config.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        Tokenizer.from_dir(tmp_path)


def test_tokenizer_apply_chat_template_without_template(tmp_path, dirs):
    (tmp_path / "tokenizer.json").write_bytes((dirs["byte_level"] / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template(MESSAGES)
