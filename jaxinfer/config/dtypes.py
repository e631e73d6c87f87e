"""The dtypes weights are served in, and how --dtype's "auto" picks one from a
checkpoint's config.json. See docs/models.md#dtype.
"""

from __future__ import annotations

DTYPES = ("float32", "bfloat16")  # the dtypes weights are served in
# --dtype's values (vLLM's): auto is the checkpoint's dtype (`served_dtype`); float is
# float32; float16/half are refused (`check_dtype_choice`). docs/models.md#dtype.
DTYPE_CHOICES = ("auto", *DTYPES, "float", "float16", "half")


def check_dtype_choice(dtype: object) -> None:
    """ValueError unless `dtype` is a value of --dtype jaxinfer serves, with the reason
    for the float16 it does not."""
    if dtype in ("float16", "half"):
        raise ValueError(
            f"dtype={dtype!r} is not served: jaxinfer's attention kernels and KV cache take "
            "float32 or bfloat16 activations. Use dtype='bfloat16' (float16's memory, "
            "float32's range) or 'auto', which serves a float16 checkpoint in bfloat16")


def checkpoint_dtype(hf: dict) -> str | None:
    """The dtype a config.json says its weights were saved in (`dtype`, the older
    `torch_dtype`, or its text tower's), or None when it says none."""
    for config in (hf, hf.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(config.get(key), str):
                return config[key]
    return None


def served_dtype(requested: str, hf: dict | None, platform: str) -> str:
    """The dtype weights are served in on `platform` ("cpu", "gpu", "tpu"): `requested`,
    or for "auto" (vLLM's) the checkpoint's own, where float32 (also a config that names
    none, as in vLLM) becomes bfloat16 on TPU and GPU (their fast path; on CPU it can be
    the slow one) and float16 becomes bfloat16. See docs/models.md#dtype."""
    check_dtype_choice(requested)
    if requested != "auto":
        return "float32" if requested == "float" else requested
    saved = checkpoint_dtype(hf or {})
    if saved in (None, "float32", "float"):
        return "float32" if platform == "cpu" else "bfloat16"
    return "bfloat16"
