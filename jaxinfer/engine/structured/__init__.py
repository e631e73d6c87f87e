"""Structured outputs, host half: what a request asks for (params.py), its grammar and
matchers (grammar.py), and the child process that compiles it (compile_process.py);
the step's token mask is the runner's (runner/token_masks.py).
docs/structured_outputs.md."""

from jaxinfer.engine.structured.params import (
    KINDS,
    StructuredOutputsParams,
    from_response_format,
    is_given,
)

__all__ = ["KINDS", "StructuredOutputsParams", "from_response_format", "is_given"]
