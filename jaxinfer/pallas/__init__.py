"""Attention kernels over the paged KV cache and their pure-jnp twins.

`ragged_paged_attention` (the function) is the entry point; it lives in `dispatch.py`
with its input validation and picks the TPU or GPU kernel or the reference, its static
settings in one `AttentionSettings` (settings.py).
Nothing here imports from jaxinfer, so the kernels can be lifted out whole.
"""

from jaxinfer.pallas.dispatch import ragged_paged_attention, resolve_impl, validate_inputs
from jaxinfer.pallas.settings import DEFAULT_SETTINGS, AttentionSettings

__all__ = ["DEFAULT_SETTINGS", "AttentionSettings", "ragged_paged_attention", "resolve_impl",
           "validate_inputs"]
