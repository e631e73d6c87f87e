"""Text: the tokenizer, chat templates, reasoning and tool-call parsers, and the bundled
corpus the demo model was trained on. No jax (docs/sampling.md#tokenizer-and-chat-template).
"""
