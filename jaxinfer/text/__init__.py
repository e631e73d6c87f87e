"""Text: the tokenizer (HF fast tokenizers, chat templates, streaming detokenization)
and the bundled code corpus the demo model was trained on. No jax."""
