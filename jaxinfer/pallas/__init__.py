"""Attention kernels over the paged KV cache and their pure-jnp twins.

Imports nothing from jaxinfer, so the kernels can be lifted out whole.
"""
