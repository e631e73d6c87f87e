"""Device code: pure functions of pytrees for the decoder family.

Shape alphabet used in comments (`# f32[T, D]`) and einsum strings:
B slots, T tokens in the step (padded), S max requests, P pages, K page size,
N query heads, G KV heads, H head dim, D model dim, F MLP dim, V vocab, L layers.
R = N // G query heads per KV head, C = pages_per_seq * K context slots,
Q sampled positions per request in a step (1 in a plain step; k + 1 when verifying k
drafts).

Nothing here imports the engine.
"""
