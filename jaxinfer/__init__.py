"""jaxinfer: LLM inference on JAX. Public names only."""

from jaxinfer.api import LLM
from jaxinfer.engine.request import RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
