"""LoRA adapters against peft + transformers on tiny random models: logits within 1e-4
in float32 and greedy tokens equal, for ranks 8 and 64 and an adapter on a subset of
modules, three adapters and the base model in one batch (Llama, Qwen3, and Qwen3-MoE's
attention projections)."""

from __future__ import annotations

import numpy as np
import pytest
from lora_adapters import ALL, ATTENTION, peft_model, save_adapter

from jaxinfer import LLM, testing
from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.runner import Chunk
from jaxinfer.lora import LoRARequest

PROMPTS = [[5, 9, 13, 2, 7, 11, 40, 41, 42, 43], [100, 3, 3, 7], [1] * 19,
           [60, 61, 62, 63, 64, 65]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def reference(model, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    """peft's logits over the prompt and its 8 greedy tokens."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt])
        logits = model(ids).logits[0].numpy()
        out = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    return logits, out[0, len(prompt):].tolist()


def adapters_for(family: str) -> dict[str, dict]:
    if family == "qwen3_moe":  # attention alone: a MoE layer's experts take none
        return {"r8": dict(rank=8, targets=ATTENTION), "r64": dict(rank=64, targets=ATTENTION),
                "subset": dict(rank=8, targets=["q_proj", "v_proj"])}
    return {"r8": dict(rank=8, targets=ALL), "r64": dict(rank=64, targets=ALL),
            "subset": dict(rank=16, targets=["k_proj", "o_proj", "down_proj"],
                           use_rslora=True)}


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def family_case(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    testing.make_hf_model(root / "model", family, seed=3)
    loras = []
    for index, (name, spec) in enumerate(adapters_for(family).items()):
        save_adapter(root / "model", root / name, seed=10 + index, **spec)
        loras.append(LoRARequest(name, index + 1, str(root / name)))
    llm = LLM(str(root / "model"), enable_lora=True, max_loras=3, max_lora_rank=64,
              dtype="float32", page_size=8, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32)
    return root, llm, loras


def test_logits_match_peft_for_each_adapter_in_one_batch(family_case):
    root, llm, loras = family_case
    engine = llm.engine
    for slot, lora in enumerate(loras):  # straight into slots 0, 1, 2
        engine.runner.adapters.write(slot, engine.runner.adapters.read(lora))
    chunks, page = [], 1
    for prompt in PROMPTS:
        pages = -(-len(prompt) // 8)
        chunks.append(Chunk(prompt, 0, list(range(page, page + pages))))
        page += pages
    got = testing.logits(engine.runner, chunks, adapters=[0, 1, 2, -1])
    offsets = np.cumsum([0] + [len(p) for p in PROMPTS])
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(
        root / "model", dtype=torch.float32, attn_implementation="eager").eval()
    models = [peft_model(root / "model", lora.lora_path) for lora in loras] + [base]
    for i, (prompt, model) in enumerate(zip(PROMPTS, models, strict=True)):
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(got[offsets[i]:offsets[i + 1]], want, atol=1e-4,
                                   rtol=0, err_msg=f"chunk {i}")
    if models[0] is not base:  # the adapters change the logits
        with torch.no_grad():
            plain = base(torch.tensor([PROMPTS[0]])).logits[0].numpy()
        assert np.abs(got[:offsets[1]] - plain).max() > 1e-2


def test_greedy_tokens_match_peft_mixed_with_the_base_model(family_case):
    root, llm, loras = family_case
    prompts = [PROMPTS[0]] * 4  # one prompt, four models: the outputs must differ
    outs = llm.generate(prompts, GREEDY, lora_request=[*loras, None])
    got = [o.outputs[0].token_ids for o in outs]
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(
        root / "model", dtype=torch.float32, attn_implementation="eager").eval()
    for lora, tokens in zip(loras, got, strict=False):
        assert tokens == reference(peft_model(root / "model", lora.lora_path),
                                   PROMPTS[0])[1], lora.lora_name
    assert got[3] == reference(base, PROMPTS[0])[1]
    assert len({tuple(t) for t in got}) > 1
