"""Pre-quantized checkpoints: the compressed-tensors FP8 format read as fp8
QuantizedWeights (`scheme_of`, `take_scales`, `describe`), and errors naming any other
`quantization_config`. See docs/quantization.md#pre-quantized-checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import ml_dtypes
import numpy as np

from jaxinfer.checkpoint import shard_source
from jaxinfer.model import params_table

METHOD = "compressed-tensors"
MODE = "fp8"  # the quantization.py mode these checkpoints load as
FORMATS = ("float-quantized", "naive-quantized")
MIXED = "mixed-precision"  # a top-level format whose groups name their own
STRATEGIES = ("tensor", "channel")
STATUSES = ("compressed", "frozen")
SUPPORTED = (f"quant_method {METHOD!r} with format {' or '.join(map(repr, FORMATS))} "
             "and 8-bit float (float8_e4m3fn), symmetric weights with 'tensor' or "
             "'channel' scales")
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_DTYPES = ("float32", "bfloat16", "float16")
SCALE, INPUT_SCALE = ".weight_scale", ".input_scale"
ZERO_POINTS = (".weight_zero_point", ".input_zero_point")
FP8_PARTS = tuple(part.key for param in params_table.LAYER if param.quantized
                  for part in param.parts)  # the HF tensors of the quantized weights
KV_SCALES = ("self_attn.k_scale", "self_attn.v_scale", "k_proj.output_scale",
             "v_proj.output_scale")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scheme:
    """A supported compressed-tensors FP8 `quantization_config`, as read."""

    strategies: tuple[str, ...]  # weight scale strategies of the groups
    activations: tuple[str, ...]  # input activation quantization asked for, e.g. "dynamic token"
    ignore: tuple[str, ...]  # modules the checkpoint keeps float
    kv_cache_scheme: bool  # k/v scales present (not used)

    def notes(self) -> list[str]:
        """What the checkpoint asks for that jaxinfer does not do, for the load log."""
        out = []
        if self.activations:
            out.append(f"it asks for FP8 input activations ({', '.join(self.activations)}); "
                       "jaxinfer's fp8 path is weight-only: activations run in bfloat16 "
                       "and input scales are not used")
        if self.kv_cache_scheme:
            out.append("its kv_cache_scheme k/v scales are not used: the KV cache's dtype "
                       "is the engine's kv_cache_dtype")
        return out


def scheme_of(hf: dict, source: object) -> Scheme | None:
    """The Scheme of config.json's `quantization_config` (`hf` is the whole config.json,
    `source` names it in errors); None when there is none. Raises ValueError naming the
    method or scheme when it is anything but a supported compressed-tensors FP8 one."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config must be a JSON object, got {qc!r}")
    method = qc.get("quant_method")
    if method != METHOD:
        raise ValueError(f"{source}: quantization_config.quant_method={method!r} is not "
                         f"supported; jaxinfer loads pre-quantized checkpoints only as "
                         f"{SUPPORTED}, or as AWQ or GPTQ 4-bit (docs/quantization.md). "
                         "Serve the float checkpoint with quantization="
                         "'int8', 'w8a8' or 'fp8' instead")
    _check_top_level(qc, source)
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{source}: compressed-tensors quantization_config has no "
                         "config_groups")
    strategies, activations = [], []
    for name, group in groups.items():
        strategy, activation = _check_group(name, group, qc.get("format"), source)
        strategies.append(strategy)
        if activation:
            activations.append(activation)
    return Scheme(strategies=tuple(strategies), activations=tuple(dict.fromkeys(activations)),
                  ignore=tuple(qc.get("ignore") or ()),
                  kv_cache_scheme=qc.get("kv_cache_scheme") is not None)


def _check_top_level(qc: dict, source: object) -> None:
    fmt, status = qc.get("format"), qc.get("quantization_status", "compressed")
    if fmt not in (*FORMATS, MIXED):
        raise ValueError(f"{source}: compressed-tensors format={fmt!r} is not supported; "
                         f"supported: {SUPPORTED}")
    if status not in STATUSES:
        raise ValueError(f"{source}: compressed-tensors quantization_status={status!r} is "
                         f"not supported; expected one of {STATUSES} (calibrated weights)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise ValueError(f"{source}: compressed-tensors sparsity_config format="
                         f"{sparsity.get('format')!r} (structure "
                         f"{sparsity.get('sparsity_structure')!r}) is not supported; "
                         f"supported: dense weights, {SUPPORTED}")
    if qc.get("transform_config"):
        raise ValueError(f"{source}: compressed-tensors transform_config (rotations) is "
                         f"not supported; supported: {SUPPORTED}")


def _check_group(name: str, group: object, top_format: str | None,
                 source: object) -> tuple[str, str | None]:
    """(weight strategy, activation quantization or None) of one config group."""
    where = f"{source}: compressed-tensors config_groups[{name!r}]"
    if not isinstance(group, dict):
        raise ValueError(f"{where} is {group!r}, not a scheme object (preset names are "
                         f"not supported); supported: {SUPPORTED}")
    fmt = group.get("format") or top_format
    if fmt not in FORMATS:
        raise ValueError(f"{where}: format={fmt!r} is not supported; supported: {SUPPORTED}")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{where} quantizes no weights ({weights!r}); supported: "
                         f"{SUPPORTED}")
    bits, kind = weights.get("num_bits"), weights.get("type")
    strategy = weights.get("strategy")
    if bits != 8 or kind != "float":
        raise ValueError(f"{where}: weights num_bits={bits!r} type={kind!r} ({fmt}) are "
                         f"not supported; supported: {SUPPORTED}")
    if strategy not in STRATEGIES:
        raise ValueError(f"{where}: weight strategy={strategy!r} is not supported "
                         f"(group_size={weights.get('group_size')!r}, block_structure="
                         f"{weights.get('block_structure')!r}); supported: {STRATEGIES}")
    if weights.get("symmetric", True) is not True:
        raise ValueError(f"{where}: asymmetric weights (symmetric="
                         f"{weights.get('symmetric')!r}) are not supported; supported: "
                         f"{SUPPORTED}")
    return strategy, _activation(group.get("input_activations"), group.get(
        "output_activations"))


def _activation(inputs: dict | None, outputs: dict | None) -> str | None:
    parts = []
    for label, args in (("input", inputs), ("output", outputs)):
        if args:
            dynamic = "dynamic" if args.get("dynamic") else "static"
            parts.append(f"{label} {args.get('num_bits')}-bit {args.get('type')} "
                         f"{dynamic} per-{args.get('strategy')}")
    return ", ".join(parts) or None


def take_scales(tensors: dict[str, np.ndarray], weight_names: Iterable[str],
                scheme: Scheme, source: object) -> dict[str, np.ndarray]:
    """Check the checkpoint's quantized tensors against `weight_names` (the HF names of
    every weight that must be fp8: each layer's seven projections) and remove from
    `tensors` every tensor of the format (scales, input scales, zero points, k/v
    scales). Returns `<module>.weight_scale` -> float32 [out] per weight in
    `weight_names` (a per-tensor scale broadcast), for the loader to read like a bias."""
    wanted = set(weight_names)
    extra = {n for n in tensors if n.endswith((SCALE, INPUT_SCALE, *ZERO_POINTS))
             or (scheme.kv_cache_scheme and n.endswith(KV_SCALES))}
    stray = sorted(n[: -len(SCALE)] + ".weight" for n in extra
                   if n.endswith(SCALE) and n[: -len(SCALE)] + ".weight" not in wanted)
    if stray:
        raise ValueError(f"{source}: {stray[:3]} are quantized, but jaxinfer serves only the "
                         "decoder layers' linear projections in fp8 and keeps the "
                         "embedding and LM head float (the checkpoint's ignore list "
                         f"{list(scheme.ignore)} should name them)")
    for name in sorted(n for n in extra if n.endswith(ZERO_POINTS)):
        if np.any(np.asarray(tensors[name])):
            raise ValueError(f"{source}: {name} is nonzero: asymmetric weights are not "
                             f"supported; supported: {SUPPORTED}")
    scales = {}
    for weight in sorted(wanted):
        scales[weight[: -len(".weight")] + SCALE] = _scale(tensors, weight, source)
    for name in extra:
        del tensors[name]
    return scales


def _scale(tensors: dict[str, np.ndarray], weight: str, source: object) -> np.ndarray:
    """The float32 [out] scale of one fp8 weight, checked."""
    name = weight[: -len(".weight")] + SCALE
    value = tensors.get(weight)
    if value is None:
        return np.zeros(0, np.float32)  # checkpoint/hf.py names the missing weight
    if value.dtype != FP8:
        raise ValueError(f"{source}: tensor {weight} has dtype {value.dtype.name}, expected "
                         f"float8_e4m3fn: a compressed-tensors checkpoint is served with "
                         "every decoder layer projection in fp8 (its ignore list "
                         "may name only the LM head and other non-layer modules)")
    if name not in tensors:
        raise ValueError(f"{source}: fp8 tensor {weight} has no {name}")
    scale, out = tensors[name], value.shape[0]
    if scale.dtype.name not in SCALE_DTYPES:
        raise ValueError(f"{source}: tensor {name} has dtype {scale.dtype.name}; expected "
                         f"one of {SCALE_DTYPES}")
    if scale.size == 1 and scale.ndim <= 1:
        flat = np.broadcast_to(np.asarray(scale, np.float32).reshape(1), (out,))
    elif scale.shape in ((out,), (out, 1)):
        flat = np.asarray(scale, np.float32).reshape(out)
    else:
        raise ValueError(f"{source}: tensor {name} has shape {tuple(scale.shape)}; expected "
                         f"[] or [1] (per tensor) or [{out}, 1] (per channel) for "
                         f"{weight} of shape {tuple(value.shape)}")
    if not np.all(np.isfinite(flat)):
        raise ValueError(f"{source}: tensor {name} holds a scale that is not finite")
    return np.ascontiguousarray(flat)


def scale_layout(layout: shard_source.Layout) -> shard_source.Layout:
    """Where the f32 [O] scale of a fp8 params leaf comes from: the `weight_scale`s of
    its HF weights (as `take_scales` left them: [out] each), fused as the weights'
    output columns are (q/k/v by KV-head group, gate/up in blocks)."""
    kind = "plain" if layout.kind == "transposed" else layout.kind
    return shard_source.Layout(kind, tuple(n.removesuffix(".weight") + SCALE
                                           for n in layout.names))
