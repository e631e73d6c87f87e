"""PEFT adapters for the LoRA tests (imported as `lora_adapters`, see pyproject's
pythonpath): random, non-zero adapters saved by peft itself, and peft's model of one."""

from __future__ import annotations

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ALL[:4]


def save_adapter(model_dir, out, *, rank: int, targets: list[str], seed: int,
                 alpha: int = 16, **extra) -> None:
    """A random (non-zero) PEFT LoRA adapter of the model at `model_dir`."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                             init_lora_weights=False, **extra)
    peft.get_peft_model(model, config).save_pretrained(out)


def peft_model(model_dir, adapter_dir):
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    return peft.PeftModel.from_pretrained(model, adapter_dir).eval()
