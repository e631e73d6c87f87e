"""GRPO on the demo model in one process: the engine samples a group of completions per
prompt, a verifiable reward scores them, the trainer steps optax on the GRPO loss
computed with jaxinfer.training (the engine's own forward), and the engine takes the
new weights on device (`LLM.update_weights`, no recompilation). Prints one JSON line a
step: mean reward and the seconds of rollout, training and weight sync.

    python examples/grpo.py                      # the documented size
    python examples/grpo.py --steps=2 --groups=2 --group_size=4   # a smoke run

See docs/rl.md#an-end-to-end-grpo-example.
"""

from __future__ import annotations

import functools
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig
from jaxinfer.training import sequence_logprobs

STEPS = flags.DEFINE_integer("steps", 12, "optimizer steps (one rollout each)")
GROUPS = flags.DEFINE_integer("groups", 4, "prompts per step")
GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "completions sampled per prompt")
MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "tokens per completion")
LEARNING_RATE = flags.DEFINE_float("learning_rate", 3e-4, "Adam's learning rate")
CLIP = flags.DEFINE_float("clip", 0.2, "PPO's ratio clip")
RETURN_WITHIN = flags.DEFINE_integer("return_within", 3, "the reward's line budget")
SEED = flags.DEFINE_integer("seed", 0, "sampling seed of the first step")
BATCH_INVARIANT = flags.DEFINE_bool(
    "batch_invariant", False, "engine and loss in batch-invariant mode: the engine's "
    "logprobs equal the trainer's bitwise, so the first ratio is exactly 1 "
    "(docs/rl.md#batch-invariant-mode)")

# Function headers the demo model (trained on Python) continues.
PROMPTS = ["def add(a, b):\n", "def is_even(n):\n", "def first(items):\n",
           "def square(x):\n", "def last(items):\n", "def double(x):\n",
           "def negate(x):\n", "def count(items):\n"]


def reward(text: str) -> float:
    """1 when the word `return` is among the completion's first `return_within` lines:
    a short function body, checked by reading the text alone."""
    lines = text.split("\n")[:RETURN_WITHIN.value]
    return float(any(re.search(r"\breturn\b", line) for line in lines))


def rollout(llm: LLM, prompts: list[str], step: int) -> list[dict]:
    """Each prompt's group: token ids, the engine's logprob of each sampled token, and
    the reward."""
    params = SamplingParams(n=GROUP_SIZE.value, temperature=1.0, max_tokens=MAX_TOKENS.value,
                            logprobs=0, seed=SEED.value + step)
    groups = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        prompt_ids = list(output.prompt_token_ids)
        groups.append([{
            "ids": prompt_ids + list(c.token_ids), "prompt_len": len(prompt_ids),
            "old": [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs,
                                                         strict=True)],
            "reward": reward(c.text)} for c in output.outputs])
    return groups


def batch_arrays(groups: list[list[dict]]) -> dict[str, jax.Array]:
    """Right-padded ids, lengths, the completion-token mask and engine logprobs aligned
    with sequence_logprobs' columns, and each row's group-normalized advantage."""
    rows = [row for group in groups for row in group]
    # one width for every step (the longest prompt plus max_tokens): one compile
    width = max(r["prompt_len"] for r in rows) + MAX_TOKENS.value
    width = -(-width // 16) * 16
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    old = np.zeros((len(rows), width), np.float32)
    for i, r in enumerate(rows):
        ids[i, :len(r["ids"])] = r["ids"]
        start, end = r["prompt_len"] - 1, len(r["ids"]) - 1  # column t scores token t + 1
        mask[i, start:end] = 1.0
        old[i, start:end] = r["old"]
    advantages = []
    for group in groups:
        rewards = np.array([r["reward"] for r in group], np.float32)
        advantages += list((rewards - rewards.mean()) / (rewards.std() + 1e-4))
    return {"ids": jnp.asarray(ids), "lengths": jnp.asarray([len(r["ids"]) for r in rows]),
            "mask": jnp.asarray(mask), "old": jnp.asarray(old),
            "advantages": jnp.asarray(advantages, jnp.float32)}


def grpo_loss(params: dict, batch: dict[str, jax.Array], *, cfg: ModelConfig, clip: float,
              batch_invariant: bool) -> tuple[jax.Array, jax.Array]:
    """PPO's clipped objective with group-normalized advantages, averaged over the
    completion tokens; the old policy's logprobs are the engine's own. Also returns the
    largest |trainer - engine| logprob over those tokens (0: exactly on-policy)."""
    new = sequence_logprobs(params, batch["ids"], cfg=cfg, lengths=batch["lengths"],
                            batch_invariant=batch_invariant)
    ratio = jnp.exp(new - batch["old"])
    advantage = batch["advantages"][:, None]
    objective = jnp.minimum(ratio * advantage,
                            jnp.clip(ratio, 1 - clip, 1 + clip) * advantage)
    mismatch = jnp.max(jnp.abs(new - batch["old"]) * batch["mask"])
    return -(objective * batch["mask"]).sum() / batch["mask"].sum(), mismatch


def main(argv: list[str]) -> None:
    del argv
    llm = LLM(dtype="float32", batch_invariant=BATCH_INVARIANT.value)
    cfg = llm.llm_engine.model_config
    params = llm.llm_engine.runner.params
    optimizer = optax.adam(LEARNING_RATE.value)
    opt_state = optimizer.init(params)
    loss_grad = jax.jit(jax.value_and_grad(
        functools.partial(grpo_loss, cfg=cfg, clip=CLIP.value,
                          batch_invariant=BATCH_INVARIANT.value), has_aux=True))
    for step in range(STEPS.value):
        prompts = [PROMPTS[(step * GROUPS.value + i) % len(PROMPTS)]
                   for i in range(GROUPS.value)]
        began = time.perf_counter()
        groups = rollout(llm, prompts, step)
        rolled = time.perf_counter()
        (loss, mismatch), grads = loss_grad(params, batch_arrays(groups))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jax.block_until_ready(optax.apply_updates(params, updates))
        trained = time.perf_counter()
        sync = llm.update_weights(params)
        synced = time.perf_counter()
        rewards = [r["reward"] for group in groups for r in group]
        print(json.dumps({"step": step, "mean_reward": round(float(np.mean(rewards)), 4),
                          "loss": round(float(loss), 5),
                          "max_logprob_mismatch": float(mismatch),
                          "rollout_s": round(rolled - began, 3),
                          "train_s": round(trained - rolled, 3),
                          "weight_sync_s": round(synced - trained, 4),
                          "sync_bytes_from_host": sync["bytes_from_host"]}), flush=True)


if __name__ == "__main__":
    app.run(main)
