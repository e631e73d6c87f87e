"""Accelerator presets: every field present and published, GPU machines by name or GCP
machine type, `aot`'s lookup refusing GPUs."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.sizing import accelerators


@pytest.mark.parametrize("name", sorted(accelerators.PRESETS))
def test_preset_has_every_field(name):
    acc = accelerators.PRESETS[name]
    chip = acc.chip
    assert acc.name == name and acc.chips >= 1
    for field in ("hbm_bytes", "usable_hbm_bytes", "bf16_flops", "int8_ops",
                  "hbm_bytes_per_s"):
        assert getattr(chip, field) > 0, field
    assert chip.int8_ops == pytest.approx(2 * chip.bf16_flops, rel=5e-3)  # dense, both
    assert chip.source.startswith("https://")
    if chip.platform == "tpu":
        assert acc.topology.startswith(chip.generation + ":") and acc.machine_type is None
    else:
        assert acc.topology is None and acc.machine_type
        assert accelerators.ALIASES[acc.machine_type] == name
    assert acc.list_price_per_hour is None or acc.list_price_note
    described = accelerators.describe(acc)
    assert described["devices"] == acc.chips
    assert described["device_hbm_bytes_per_s"] == chip.hbm_bytes_per_s


@pytest.mark.parametrize("name", sorted(accelerators.CHIPS))
def test_chip_figures_are_consistent(name):
    """Dense datasheet figures: int8 at least bf16, usable memory within the memory, and
    a ridge point (FLOPs per byte at which a step turns compute-bound) in the range of
    real accelerators; a figure typed off by 10x or 1000x lands outside."""
    chip = accelerators.CHIPS[name]
    assert 0 < chip.usable_hbm_bytes <= chip.hbm_bytes
    assert chip.hbm_bytes % accelerators.GIB == 0
    assert chip.int8_ops >= chip.bf16_flops
    assert 50 < chip.bf16_flops / chip.hbm_bytes_per_s < 1000


def test_gpu_machines_by_name_or_machine_type():
    assert accelerators.find_preset("a3-highgpu-8g") is accelerators.find_preset("h100-8")
    assert accelerators.find_preset("h100-8").chips == 8
    assert accelerators.find_preset("a2-megagpu-16g").name == "a100-40gb-16"
    assert accelerators.find_preset("a2-ultragpu-1g").chip.generation == "a100-80gb"
    assert accelerators.find_preset("g2-standard-96").name == "l4-8"
    assert accelerators.find_preset("v5litepod-8") is accelerators.get("v5e-8")
    with pytest.raises(ValueError, match="'h200-8' is not a known accelerator preset"):
        accelerators.find_preset("h200-8")


def test_aot_lookup_takes_tpu_slices_only():
    assert accelerators.get("v5p-8").chips == 4 and accelerators.get("v6e-8").chips == 8
    with pytest.raises(ValueError, match=r"'a3-highgpu-8g' is a GPU machine \(a3-highgpu-8g"
                                         r"\); aot compiles for TPU only"):
        accelerators.get("a3-highgpu-8g")
    with pytest.raises(ValueError, match="'h100-8' is a GPU machine"):
        accelerators.get("h100-8")
    with pytest.raises(ValueError, match="not a known TPU accelerator type"):
        accelerators.get("v4-8")


def test_presets_validate_their_fields():
    chip = accelerators.CHIPS["l4"]
    with pytest.raises(ValueError, match="bf16_flops=0 must be > 0"):
        dataclasses.replace(chip, bf16_flops=0)
    with pytest.raises(ValueError, match="platform='npu' must be one of"):
        dataclasses.replace(chip, platform="npu")
    with pytest.raises(ValueError, match="topology=None must be given for TPU slices only"):
        accelerators.Accelerator(name="v5e-x", chip=accelerators.CHIPS["v5e"], chips=1)
    with pytest.raises(ValueError, match="list_price_note='' must say where and when"):
        accelerators.Accelerator(name="l4-1", chip=chip, chips=1, list_price_per_hour=1.0)


@pytest.mark.parametrize("kind, chip", [
    ("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e"), ("TPU v5p", "v5p"), ("TPU v5", "v5p"),
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA L4", "l4")])
def test_jax_device_kinds_map_to_their_chips(kind, chip):
    assert accelerators.chip_for_device_kind(kind) is accelerators.CHIPS[chip]


def test_other_device_kinds_have_no_chip():
    for kind in ("cpu", "TPU v4", "NVIDIA H100 PCIe", "NVIDIA A100-PCIE-40GB", "", "v5e"):
        assert accelerators.chip_for_device_kind(kind) is None, kind
    h200 = accelerators.CHIPS["h200"]  # NVIDIA's H200 datasheet, dense figures
    assert (h200.bf16_flops, h200.int8_ops, h200.hbm_bytes_per_s) == (989e12, 1979e12, 4.8e12)
    assert h200.hbm_bytes == 141 * accelerators.GIB


@pytest.mark.parametrize("name", sorted(accelerators.CHIPS))
def test_chip_interconnect_is_published_and_slower_than_its_memory(name):
    """Every chip carries its link bandwidth with a source and a collective latency; a
    figure typed in Gb/s for GB/s, or 1000x off, lands outside these ranges."""
    chip = accelerators.CHIPS[name]
    assert chip.interconnect_source.startswith("https://")
    assert 0.01 < chip.interconnect_bytes_per_s / chip.hbm_bytes_per_s < 1
    assert chip.ring_bytes_per_s == chip.interconnect_bytes_per_s / 2
    assert 0 <= chip.collective_latency_s < 1e-4 and 0 < chip.hop_latency_s < 1e-5
    with pytest.raises(ValueError, match="interconnect_bytes_per_s=0 must be > 0"):
        dataclasses.replace(chip, interconnect_bytes_per_s=0)
    described = accelerators.describe(accelerators.Accelerator(
        name=name, chip=chip, chips=1, topology=f"{name}:1x1" if chip.platform == "tpu"
        else None))
    assert described["device_ring_bytes_per_s"] == chip.ring_bytes_per_s
