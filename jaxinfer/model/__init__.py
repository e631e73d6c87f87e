"""Device code: pure functions of pytrees for the decoder family; nothing here imports
the engine. Shapes in comments (`# f32[T, D]`) and einsum strings use the shape alphabet
of docs/architecture.md#5-glossary-one-word-per-idea.
"""
