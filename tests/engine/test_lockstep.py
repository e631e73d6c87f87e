"""The lockstep protocol of multi-host serving (jaxinfer/engine/parallel/lockstep.py) in one
process: a Leader records what is added and aborted between its steps; an engine that
applies the published messages before each of its own steps (`follow`) produces exactly
the leader's tokens (greedy, seeded, unseeded, n=2 and filtered requests, an abort mid-run,
requests added while others run) and keeps none of them afterwards. The multi-process
server: tests/server/test_multihost_serving.py."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from jaxinfer import SamplingParams, testing
from jaxinfer.config import EngineConfig, SpeculativeConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.parallel import lockstep

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
FILTER_IDS = [7, 8, 9, 10, 11]


class MemoryChannel:
    def __init__(self) -> None:
        self.messages: dict[int, bytes] = {}

    def publish(self, step: int, message: bytes) -> None:
        assert step not in self.messages
        self.messages[step] = message

    def receive(self, step: int) -> bytes | None:
        return self.messages.get(step)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    testing.make_hf_model(path, "llama")
    return path


def _finished(outputs, into: dict) -> None:
    for out in outputs:
        if out.finished:
            into[out.request_id] = [c.token_ids for c in out.outputs]


def _lead(leader: lockstep.Leader) -> dict:
    """Drive the leader the way the server's engine loop does; final token ids by id."""
    done: dict = {}
    sampled = SamplingParams(temperature=0.9, max_tokens=12)
    leader.add_request("greedy", [1, 2, 3], SamplingParams(temperature=0, max_tokens=10))
    leader.add_request("unseeded", [4, 5, 6, 7], sampled)
    leader.add_request("aborted", [8, 9], SamplingParams(temperature=0, max_tokens=40))
    for _ in range(3):
        _finished(leader.step(), done)
    leader.abort("aborted")
    leader.release("aborted")
    leader.add_request("two", "x = ", dataclasses.replace(sampled, n=2, seed=7))
    leader.add_request("later", [10, 11] * 9, sampled, priority=-1)
    # a token filter is rebuilt from the params on each process
    leader.add_request("filtered", [1, 2, 3], dataclasses.replace(
        sampled, seed=5, allowed_token_ids=FILTER_IDS, bad_words=["x"]))
    while leader.has_unfinished():
        outputs = leader.step()
        _finished(outputs, done)
        for out in outputs:
            if out.finished:
                leader.release(out.request_id)
    leader.close()
    return done


def test_a_follower_computes_exactly_the_leaders_tokens(model_dir):
    channel = MemoryChannel()
    want = _lead(lockstep.Leader(Engine(model_dir), channel))
    assert set(want) == {"greedy", "unseeded", "two", "later", "filtered"}
    assert set(want["filtered"][0]) <= set(FILTER_IDS)
    follower, got = Engine(model_dir), {}
    steps = lockstep.follow(follower, channel, on_step=lambda outs: _finished(outs, got))
    assert steps == len(channel.messages) - 1  # the last message says shutdown
    assert got == want
    assert not follower.has_unfinished()
    for request_id in [*want, "aborted"]:  # released: nothing kept
        with pytest.raises(KeyError):
            follower.output(request_id)


def test_a_refused_add_is_not_published(model_dir):
    channel = MemoryChannel()
    leader = lockstep.Leader(Engine(model_dir, CONFIG, warm_up=False), channel)
    leader.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        leader.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    leader.close()
    (message,) = channel.messages.values()
    assert b'"shutdown":true' in message and message.count(b'"add"') == 1
    with pytest.raises(RuntimeError, match="closed"):
        leader.step()


@pytest.mark.parametrize(("settings", "field"), [
    (dict(data_parallel_size=2), "data_parallel_size=2"),
    (dict(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2)),
     "speculative_config adaptive=true"),
])
def test_settings_that_would_desynchronize_the_processes_are_refused(settings, field):
    with pytest.raises(ValueError, match=field):
        lockstep.check_lockstep(EngineConfig(**settings))
    lockstep.check_lockstep(EngineConfig())


def test_the_watchdog_fires_once_on_a_step_that_runs_too_long():
    fired = []
    watchdog = lockstep.Watchdog(0.3, fired.append, poll_s=0.05)
    with watchdog.watching():
        time.sleep(0.1)  # a normal step
    time.sleep(0.4)
    assert fired == []
    with watchdog.watching():
        time.sleep(0.8)
    assert len(fired) == 1 and fired[0] > 0.3


# One value other than the default for every SamplingParams field: a new field fails
# this test until it is listed, and then must survive the message's JSON.
EVERY_FIELD = dict(n=2, max_tokens=9, min_tokens=2, temperature=0.7, top_k=5, top_p=0.9,
                   min_p=0.1, repetition_penalty=1.1, presence_penalty=0.2,
                   frequency_penalty=0.3, seed=3, logprobs=2, prompt_logprobs=1,
                   stop=["a", "bb"], stop_token_ids=[4, 5], ignore_eos=True,
                   structured_outputs={"json": {"type": "object", "required": ["a"]}},
                   logit_bias={7: -2.5, 11: 100}, bad_words=["foo", "bar baz"],
                   allowed_token_ids=[3, 4, 5], include_stop_str_in_output=True,
                   skip_special_tokens=False, spaces_between_special_tokens=False,
                   detokenize=True, truncate_prompt_tokens=4)
# stop strings need text, so detokenize=False travels in a second message
NO_TEXT = dict(EVERY_FIELD, stop=[], detokenize=False)


@pytest.mark.parametrize("changed", [EVERY_FIELD, NO_TEXT], ids=["text", "no_text"])
def test_every_sampling_field_survives_the_message(changed):
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(changed) == fields
    params = SamplingParams(**changed)
    defaults = SamplingParams()
    differing = {name for name in fields if getattr(params, name) != getattr(defaults, name)}
    assert differing | {"stop", "detokenize"} == fields
    prepared = lockstep.PreparedRequest(prompt="hi", prompt_token_ids=[1, 2], params=params)
    message = lockstep.encode(0, [lockstep.add_op("r", prepared, 3)])
    (op,) = json.loads(message)["ops"]
    assert SamplingParams(**op[4]) == params and op[5] == 3
