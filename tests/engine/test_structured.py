"""Structured outputs end to end on the bundled demo model (which never writes JSON
unconstrained), sampled at temperature 1.0: JSON schemas, regexes, choices and grammars
hold for every completion, with asynchronous scheduling on and off; bad constraints are
ValueErrors naming the field; n > 1, preemption and prefix caching keep each
completion's matcher right; nothing compiles after warm-up."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxinfer import LLM, SamplingParams, StructuredOutputsParams
from jaxinfer.config import DEFAULT_MODEL
from jaxinfer.server import prometheus

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=384, seed=0)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                 "maxItems": 3},
        "owner": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "ok": {"type": "boolean"}},
            "required": ["id", "ok"], "additionalProperties": False},
    },
    "required": ["name", "age", "kind", "owner"],
    "additionalProperties": False,
}
PROMPTS = ["import os\n", "The answer is", "def main():\n", "# A list of"]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    return LLM(str(DEFAULT_MODEL), async_scheduling=request.param, **CONFIG)


def _params(max_tokens: int = 256, n: int = 1, **constraint) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, n=n,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_structured_json_schema_every_completion_valid(llm):
    compiles = llm.metrics()["compiles_after_warmup"]
    outputs = llm.generate(PROMPTS * 2, _params(json=SCHEMA))
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    metrics = llm.metrics()
    assert metrics["compiles_after_warmup"] == compiles
    assert metrics["constrained_steps"] > 0 and metrics["grammar_mask_seconds"] > 0
    text = prometheus.exposition(prometheus.snapshot(llm.engine), "demo").decode()
    assert 'jaxinfer:constrained_steps_total{model_name="demo"} ' in text


def test_structured_regex_choice_and_grammar_hold(llm):
    regex = r"[A-Z][a-z]{1,6} (is|was) [0-9]{1,3}\."
    grammar = ('root ::= greeting " " name "!"\ngreeting ::= "hi" | "hello"\n'
               'name ::= [a-z]+')
    lark = 'start: "(" expr ")"\nexpr: NUM ("+" NUM)*\nNUM: /[0-9]{1,2}/'
    choices = ["yes", "no", "maybe later"]
    params = [_params(regex=regex), _params(choice=choices), _params(grammar=grammar),
              _params(grammar=lark)]
    outputs = llm.generate(PROMPTS * 2, params * 2)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
    texts = [o.text for o in outputs]
    for text in texts[0::4]:
        assert re.fullmatch(regex, text), text
    assert all(text in choices for text in texts[1::4])
    assert all(re.fullmatch(r"(hi|hello) [a-z]+!", t) for t in texts[2::4]), texts
    assert all(re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", t) for t in texts[3::4]), texts


def test_structured_n_completions_each_constrained(llm):
    out = llm.generate(["x = "], _params(n=2, json=SCHEMA))[0]
    assert len(out.outputs) == 2
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_structured_max_tokens_mid_structure_is_length(llm):
    out = llm.generate(["a"], _params(max_tokens=12, regex="[a-z ]{40,}"))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 12
    assert re.fullmatch("[a-z ]*", out.text)


def test_structured_mixed_with_unconstrained_requests(llm):
    free = SamplingParams(max_tokens=24, temperature=1.0)
    outputs = llm.generate(PROMPTS, [_params(json={"type": "object"}), free,
                                     _params(json_object=True), free])
    for out in outputs[0::2]:
        assert out.finish_reason == "stop"
        assert isinstance(json.loads(out.text), dict)
    assert all(len(out.token_ids) == 24 for out in outputs[1::2])
    assert llm.metrics()["compiles_after_warmup"] == 0


def test_structured_one_constrained_among_free_requests(llm):
    """One constrained request among three free ones: under asynchronous scheduling it
    sits out every other step (the free ones do not wait) and still holds."""
    free = SamplingParams(max_tokens=48, temperature=1.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [free, free, _params(json=SCHEMA), free])
    assert outputs[2].finish_reason == "stop"
    jsonschema.validate(json.loads(outputs[2].text), SCHEMA)
    assert all(len(outputs[i].token_ids) == 48 for i in (0, 1, 3))


@pytest.mark.parametrize("constraint, field", [
    ({"json": {"type": "bogus"}}, "structured_outputs.json"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"grammar": "root ::= ("}, "structured_outputs.grammar"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
])
def test_structured_bad_constraint_names_the_field(llm, constraint, field):
    engine = llm.engine
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.prepare("x", _params(**constraint))
    assert not engine.has_unfinished()


def test_structured_preemption_and_prefix_cache_keep_the_grammar(llm):
    """A pool of 25 pages of 16 tokens (one request's max_model_len) for 4 prompts of
    ~150 tokens: requests are preempted and recomputed mid-document; the first prompt,
    run once before, hits the prefix cache."""
    per_token = llm.engine.memory_plan.kv_bytes_per_token
    small = LLM(str(DEFAULT_MODEL), **CONFIG, page_size=16, enable_prefix_caching=True,
                kv_cache_memory_bytes=25 * 16 * per_token,
                async_scheduling=llm.engine.async_scheduling)
    words = ["the quick brown fox", "import sys and os", "def main(argv)", "class Foo(Bar)"]
    prompts = [f"# {w}\n" * 12 for w in words]
    small.generate(prompts[:1], _params(max_tokens=8, regex="[a-z]{8}"))
    outputs = small.generate(prompts, _params(max_tokens=150, json=SCHEMA))
    metrics = small.metrics()
    assert metrics["preemptions"] > 0
    assert metrics["prefix_cache_hit_tokens"] > 0
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_structured_batch_runner_response_format_lines(llm, tmp_path):
    from jaxinfer.batch import runner as batch_runner

    lines = [
        {"id": "a", "prompt": "x", "max_tokens": 256, "temperature": 1.0,
         "response_format": {"type": "json_schema",
                             "json_schema": {"name": "pet", "schema": SCHEMA}}},
        {"id": "b", "prompt": "y", "max_tokens": 16, "temperature": 1.0,
         "structured_outputs": {"choice": ["red", "green"]}},
        {"id": "c", "prompt": "z", "response_format": {"type": "xml"}},
        {"id": "d", "prompt": "z", "structured_outputs": {"regex": "[a-"}},
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    batch_runner.run(llm, source, target, progress=False)
    records = {r["id"]: r for r in map(json.loads, target.read_text().splitlines())}
    assert records["a"]["finish_reason"] == "stop", records["a"]
    jsonschema.validate(json.loads(records["a"]["text"]), SCHEMA)
    assert records["b"]["text"] in ("red", "green")
    assert "response_format.type" in records["c"]["error"]
    assert "structured_outputs.regex" in records["d"]["error"]


@pytest.mark.slow  # its own engine with verify buckets: ~40 s of warm-up
def test_structured_requests_never_speculate_in_verify_steps():
    """n-gram speculation on: the free greedy requests verify drafts while the
    constrained ones, in the same verify steps, sample one position under their mask."""
    from jaxinfer.config import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=False)
    llm = LLM(str(DEFAULT_MODEL), **CONFIG | dict(max_num_seqs=2), speculative_config=spec)
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(["# a b c\n" * 6, "x = "], [free, _params(json=SCHEMA)])
    assert len(outputs[0].token_ids) == 40
    assert outputs[1].finish_reason == "stop"
    jsonschema.validate(json.loads(outputs[1].text), SCHEMA)
    metrics = llm.metrics()
    assert metrics["spec_verify_steps"] > 0 and metrics["spec_draft_tokens"] > 0
    assert metrics["spec_skipped_structured_outputs"] > 0
    assert metrics["compiles_after_warmup"] == 0


def test_structured_failing_matcher_ends_in_error_not_stop(llm):
    """A rule of 2,500 alternatives passes the first mask and breaks llguidance's row
    limit after one token: each completion ends with "error" and why, never "stop"
    with a text the grammar does not accept; the others in the batch are unaffected."""
    alternatives = " | ".join(f'"a{i}"' for i in range(2500))
    broken = _params(8, n=2, grammar=f'start: "x" r\nr: {alternatives}\n')
    fine = _params(8, choice=["yes", "no"])
    outs = llm.generate(["x", "y"], [broken, fine])
    for completion in outs[0].outputs:
        assert completion.finish_reason == "error", completion
        assert completion.stop_reason.startswith("the output constraint failed after 1 ")
        assert len(completion.token_ids) == 1 and completion.text.startswith("x")
    assert outs[1].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text in ("yes", "no")
