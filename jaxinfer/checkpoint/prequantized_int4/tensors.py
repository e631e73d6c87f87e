"""An AWQ or GPTQ checkpoint's packed tensors checked against the model (`int4_views`),
seen by the shard reader as three HF-like tensors per projection (codes two a byte,
float32 step and offset) of which each device converts only its slice, and built into
int4 QuantizedWeights (`quantized_leaf`). See
docs/quantization.md#pre-quantized-awq-and-gptq-checkpoints.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxinfer.checkpoint import shard_source
from jaxinfer.checkpoint.prequantized_int4 import packing
from jaxinfer.checkpoint.prequantized_int4.scheme import MODE, SUPPORTED, Scheme
from jaxinfer.model import params_table, sharding
from jaxinfer.model.quantization import QuantizedWeight

# the HF tensors of the weights served in int4: each decoder layer's projections
PARTS = tuple(dict.fromkeys(part.key for param in params_table.LAYER
                            if param.quantized and not param.experts for part in param.parts))
PACKED = (".qweight", ".qzeros", ".scales", ".g_idx")  # a quantized module's tensors
# the names the shard reader sees for a module's int4 tensors: [out, in / 2] codes, and
# [out, groups] float32 step and offset (w = code * step + offset)
VALUE, STEP, OFFSET = ".int4_value", ".int4_step", ".int4_offset"
SCALE_DTYPES = ("float16", "bfloat16", "float32")
F32 = np.dtype(np.float32)


class Int4Module:
    """One projection's packed tensors (memory-mapped), read in any slice as jaxinfer's
    int4: `value`, `step`, `offset`, each [out rows, ...] as HF stores a weight."""

    def __init__(self, name: str, tensors: dict[str, np.ndarray], scheme: Scheme,
                 shape: tuple[int, int], source: object) -> None:
        """`shape`: the float weight's [in, out]."""
        self.name, self.scheme, self.source = name, scheme, source
        self.inputs, self.outputs = shape
        self.groups = self.inputs // scheme.group_size
        self.qweight, self.qzeros, self.scales = (self._tensor(tensors, s) for s in PACKED[:3])
        self._check(tensors.get(PACKED[3]))

    def _tensor(self, tensors: dict[str, np.ndarray], suffix: str) -> np.ndarray:
        if tensors.get(suffix) is None:
            raise ValueError(f"{self.source}: {self.scheme.method} checkpoint lacks "
                             f"{self.name}{suffix}")
        return tensors[suffix]

    def _check(self, g_idx: np.ndarray | None) -> None:
        i, o, g, where = self.inputs, self.outputs, self.scheme.group_size, self.source
        if i % g or o % packing.PER_WORD or i % packing.PER_WORD:
            raise ValueError(f"{where}: {self.name} [{o}, {i}] cannot hold int4 groups of "
                             f"{g} inputs and words of {packing.PER_WORD} codes")
        words = (i, o // 8) if self.scheme.method == "awq" else (i // 8, o)
        want = {".qweight": (words, ("int32",)), ".qzeros": ((self.groups, o // 8), ("int32",)),
                ".scales": ((self.groups, o), SCALE_DTYPES)}
        if g_idx is not None:
            want[".g_idx"] = ((i,), ("int32", "int64"))
        for (suffix, (shape, dtypes)), tensor in zip(
                want.items(), (self.qweight, self.qzeros, self.scales, g_idx), strict=False):
            if tuple(tensor.shape) != shape or tensor.dtype.name not in dtypes:
                raise ValueError(f"{where}: {self.name}{suffix} is {tensor.dtype.name}"
                                 f"{list(tensor.shape)}, expected {' or '.join(dtypes)}"
                                 f"{list(shape)} for a [{o}, {i}] {self.scheme.method} "
                                 f"weight in groups of {g}")
        if g_idx is not None and not np.array_equal(np.asarray(g_idx), np.arange(i) // g):
            raise ValueError(f"{where}: {self.name}.g_idx is not each input row's position "
                             f"// group_size ({g}): act-order groups (desc_act) are not "
                             f"supported; supported: {SUPPORTED}")
        if not np.all(np.isfinite(np.asarray(self.scales, F32))):
            raise ValueError(f"{where}: {self.name}.scales holds a scale that is not finite")

    def codes(self, o0: int, o1: int, i0: int, i1: int) -> np.ndarray:
        """The 4-bit codes of outputs [o0, o1) and inputs [i0, i1): uint8 [in, out]."""
        if self.scheme.method == "awq":  # [in, out / 8]: any input rows, covering words
            words, within = packing.output_words(o0, o1)
            return packing.columns(self.qweight[i0:i1, words], "awq")[:, within]
        first = i0 // packing.PER_WORD  # GPTQ [in / 8, out]: the words covering the rows
        rows = packing.gptq_rows(self.qweight[first:-(-i1 // packing.PER_WORD), o0:o1])
        return rows[i0 - first * packing.PER_WORD:i1 - first * packing.PER_WORD]

    def value(self, o0: int, o1: int, p0: int, p1: int) -> np.ndarray:
        """uint8 [out, in / 2]: rows [o0, o1) of the codes of input pairs [p0, p1)."""
        return packing.pack_pairs(self.codes(o0, o1, 2 * p0, 2 * p1).T)

    def step(self, o0: int, o1: int, g0: int, g1: int) -> np.ndarray:
        """f32 [out, groups]: the scales, exact (float16 and bfloat16 are float32's)."""
        return np.asarray(self.scales[g0:g1, o0:o1], F32).T

    def offset(self, o0: int, o1: int, g0: int, g1: int) -> np.ndarray:
        """f32 [out, groups]: -zero * scale, exact in float32 (a 5-bit zero times an
        11-bit float16 scale), so code * step + offset = (code - zero) * scale."""
        words, within = packing.output_words(o0, o1)
        zeros = packing.columns(self.qzeros[g0:g1, words], self.scheme.method)[:, within]
        zeros = zeros.astype(F32) + np.float32(self.scheme.zero_offset)
        return (-zeros * np.asarray(self.scales[g0:g1, o0:o1], F32)).T


class Int4View:
    """One of a module's three int4 tensors as the shard reader sees an HF tensor:
    [out, in / 2] codes or [out, groups] float32; a slice converts only what it covers."""

    ndim = 2

    def __init__(self, module: Int4Module, part: str) -> None:
        self.module, self.part = module, part
        width = module.inputs // 2 if part == "value" else module.groups
        self.shape = (module.outputs, width)
        self.dtype = np.dtype(np.uint8) if part == "value" else F32

    def __getitem__(self, index: object) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (2 - len(index))
        if not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            raise TypeError(f"{self.module.name}: only contiguous slices are supported")
        (o0, o1, _), (c0, c1, _) = (i.indices(n) for i, n in zip(index, self.shape,
                                                                  strict=True))
        return getattr(self.module, self.part)(o0, o1, c0, c1)


def int4_views(tensors: dict[str, np.ndarray], shapes: dict[str, tuple[int, int]],
               scheme: Scheme, source: object) -> dict[str, Int4View]:
    """Check the packed tensors of every weight in `shapes` (HF `.weight` name -> its
    float [in, out]: each decoder layer's projections) and remove every packed tensor
    from `tensors`. Returns the reader's views: `<module>` + VALUE, STEP and OFFSET."""
    views: dict[str, Int4View] = {}
    for weight, shape in shapes.items():
        name = weight.removesuffix(".weight")
        if weight in tensors:
            raise ValueError(
                f"{source}: {weight} is float in a {scheme.method} checkpoint (its "
                f"modules_to_not_convert: {list(scheme.modules_to_not_convert)}); jaxinfer "
                f"serves every decoder layer projection in int4; supported: {SUPPORTED}")
        parts = {suffix: tensors.pop(name + suffix, None) for suffix in PACKED}
        module = Int4Module(name, parts, scheme, shape, source)
        views |= {name + suffix: Int4View(module, part)
                  for suffix, part in ((VALUE, "value"), (STEP, "step"), (OFFSET, "offset"))}
    stray = sorted(n for n in tensors if n.endswith(PACKED))
    if stray:
        raise ValueError(f"{source}: {stray[:3]} are {scheme.method} tensors of modules "
                         "jaxinfer does not serve in int4: only the decoder layers' linear "
                         "projections are (the embedding and LM head stay float, experts "
                         f"are not supported); supported: {SUPPORTED}")
    return views


def quantized_leaf(reader: shard_source.Reader, mesh: Mesh, name: str,
                   layout: shard_source.Layout, shape: tuple[int, int], spec: QuantizedWeight,
                   group: int) -> QuantizedWeight:
    """The int4 QuantizedWeight of params leaf `name` (float [in, out] `shape`, made of
    `layout`'s HF weights) placed by `spec` (quantization.partition_specs), each device's
    slice converted from the views: value uint8 [in / 2, out], scale f32 [2, groups, out]
    (step, offset). Refuses a split of the input rows that would cut a group."""
    rows, columns = shape
    shards = mesh.shape[sharding.MODEL_AXIS]
    if spec.value[0] is not None and (rows // group) % shards:
        raise ValueError(f"int4 groups of {group} rows (the checkpoint's group_size) "
                         f"straddle the {shards} devices' shares of {name} [{rows}, "
                         f"{columns}] (split by input rows, {rows // shards} each)")

    def named(suffix: str) -> shard_source.Layout:
        return shard_source.Layout(layout.kind, tuple(n.removesuffix(".weight") + suffix
                                                       for n in layout.names))

    def scale(index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (3 - len(index))
        pair = [reader.slice_of(f"{name}.scale", named(suffix), (rows // group, columns),
                                index[1:], F32) for suffix in (STEP, OFFSET)]
        return np.stack(pair)[index[0]]

    value = jax.make_array_from_callback(
        (rows // 2, columns), NamedSharding(mesh, spec.value),
        lambda index: reader.slice_of(name, named(VALUE), (rows // 2, columns), index,
                                      np.dtype(np.uint8)), dtype=np.dtype(np.uint8))
    return QuantizedWeight(value, jax.make_array_from_callback(
        (2, rows // group, columns), NamedSharding(mesh, spec.scale), scale, dtype=F32), MODE)
