"""config.json's `quantization_config` of an AWQ or GPTQ checkpoint read as a `Scheme`, or
refused naming the field and its value; `requested_mode`: what `quantization="awq"` or
`"gptq"` serves. See docs/quantization.md#pre-quantized-awq-and-gptq-checkpoints.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import PREQUANTIZED_METHODS

METHODS = PREQUANTIZED_METHODS  # quant_method values read here (vLLM's names)
MODE = "int4"  # the model/quantization.py mode their weights are served in
BITS = 4
GROUP_SIZES = (128, 64, 32)  # the int4 groups jaxinfer computes with
AWQ_VERSIONS = ("gemm",)  # AutoAWQ's GEMM layout: [in, out / 8] words
AWQ_BACKENDS = ("autoawq",)  # transformers' AwqConfig.backend; llm-awq packs otherwise
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> added to a stored zero
SUPPORTED = ("AWQ (quant_method 'awq': version 'gemm', bits 4, zero_point true) and GPTQ "
             "(quant_method 'gptq': bits 4, desc_act false, checkpoint_format 'gptq' or "
             "'gptq_v2'), group_size 128, 64 or 32, every decoder layer projection "
             "quantized and the LM head float; or compressed-tensors FP8")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scheme:
    """A supported AWQ or GPTQ `quantization_config`, as read."""

    method: str  # "awq" or "gptq"
    group_size: int  # input rows per (scale, zero): one of GROUP_SIZES
    zero_offset: int  # added to each stored zero: 1 for GPTQ v1, which stores zero - 1
    modules_to_not_convert: tuple[str, ...] = ()  # AWQ: modules the checkpoint keeps float


def method_of(hf: dict) -> str | None:
    """"awq" or "gptq" when config.json (`hf`) says its weights are in that format."""
    qc = hf.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return method.lower() if isinstance(method, str) and method.lower() in METHODS else None


def scheme_of(hf: dict, source: object) -> Scheme | None:
    """The Scheme of config.json's `quantization_config` (`source` names the file in
    errors); None unless its quant_method is "awq" or "gptq". ValueError naming the field
    and its value for what jaxinfer does not read as int4."""
    method = method_of(hf)
    if method is None:
        return None
    qc = hf["quantization_config"]
    where = f"{source}: {method} quantization_config"
    bits = _field(qc, "bits", "w_bit")
    if bits != BITS:
        raise ValueError(f"{where}: bits={bits!r} is not supported (jaxinfer serves 4-bit "
                         f"weights); supported: {SUPPORTED}")
    group = _field(qc, "group_size", "q_group_size")
    if group not in GROUP_SIZES:
        raise ValueError(f"{where}: group_size={group!r} is not supported (jaxinfer's int4 "
                         f"groups are {GROUP_SIZES} input rows); supported: {SUPPORTED}")
    if method == "awq":
        _check_awq(qc, where)
        skipped = qc.get("modules_to_not_convert") or ()
        return Scheme(method=method, group_size=group, zero_offset=0,
                      modules_to_not_convert=tuple(skipped))
    return Scheme(method=method, group_size=group, zero_offset=_check_gptq(qc, where))


def _field(qc: dict, name: str, older: str) -> object:
    """`name`, or AutoAWQ's older spelling of it (quant_config.json's)."""
    return qc[name] if name in qc else qc.get(older)


def _check_awq(qc: dict, where: str) -> None:
    version = str(qc.get("version", "gemm")).lower()
    if version not in AWQ_VERSIONS:
        raise ValueError(f"{where}: version={qc.get('version')!r} is not supported (its "
                         f"words pack another layout); supported: {SUPPORTED}")
    if qc.get("zero_point", True) is not True:
        raise ValueError(f"{where}: zero_point={qc.get('zero_point')!r} (symmetric AWQ) is "
                         f"not supported; supported: {SUPPORTED}")
    backend = qc.get("backend")
    if backend is not None and str(backend).lower() not in AWQ_BACKENDS:
        raise ValueError(f"{where}: backend={backend!r} is not supported (it packs its "
                         f"own layout); supported: {SUPPORTED}")


def _check_gptq(qc: dict, where: str) -> int:
    """The zero offset of a supported GPTQ config."""
    if qc.get("desc_act") and not qc.get("static_groups"):
        raise ValueError(
            f"{where}: desc_act={qc.get('desc_act')!r} (act-order: each input row's group "
            "given by g_idx, not by its position) is not supported: jaxinfer's int4 "
            "matmul takes contiguous groups of rows and permutes no activations; "
            f"supported: {SUPPORTED}")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS or qc.get("is_marlin_format"):
        raise ValueError(f"{where}: checkpoint_format={fmt!r}"
                         f"{' (is_marlin_format)' if qc.get('is_marlin_format') else ''} is "
                         f"not supported; supported: {SUPPORTED}")
    if qc.get("lm_head"):
        raise ValueError(f"{where}: lm_head={qc.get('lm_head')!r} (a quantized LM head) is "
                         f"not supported; supported: {SUPPORTED}")
    if qc.get("dynamic"):
        raise ValueError(f"{where}: dynamic={qc.get('dynamic')!r} (per-module overrides) "
                         f"is not supported; supported: {SUPPORTED}")
    return GPTQ_FORMATS[fmt]


def requested_mode(hf: dict | None, requested: str | None, source: object) -> str | None:
    """What `quantization=requested` (EngineConfig.quantization) serves for a checkpoint
    whose config.json is `hf` (None: it has none): "awq" or "gptq" the mode its int4
    weights are served in when the checkpoint is in that format, as vLLM checks;
    anything else unchanged. ValueError when the checkpoint is not in that format."""
    if requested not in METHODS:
        return requested
    held = method_of(hf or {})
    if held == requested:
        return MODE
    qc = (hf or {}).get("quantization_config")
    if held is not None:
        holds = f"holds {held} weights"
    elif isinstance(qc, dict):
        holds = f"has quantization_config.quant_method={qc.get('quant_method')!r}"
    else:
        holds = "has no quantization_config (float weights)"
    raise ValueError(f"quantization={requested!r} reads a checkpoint quantized with "
                     f"{requested.upper()} as it is, but {source} {holds}; to quantize "
                     "a float checkpoint at load use quantization='int4'")
