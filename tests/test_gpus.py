"""The GPU catalog: lookups, aliases, the error, and figures as the sources give them."""

import json

import pytest

from memfit.errors import MemfitError
from memfit.hardware.gpus import ALIASES, CATALOG, GPU, gpu, gpu_names

REQUIRED = {"rtx-3090", "rtx-4090", "rtx-5090", "a6000", "a10g", "l4", "l40s", "t4", "v100-16gb", "v100-32gb",
            "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200"}


def test_names_are_sorted_and_cover_the_list():
    names = gpu_names()
    assert names == sorted(names) == sorted(CATALOG)
    assert REQUIRED <= set(names)


@pytest.mark.parametrize("spelling, name", [
    ("rtx-4090", "rtx-4090"), ("RTX-4090", "rtx-4090"), ("4090", "rtx-4090"), ("rtx4090", "rtx-4090"),
    ("RTX 4090", "rtx-4090"), ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("3090", "rtx-3090"),
    ("h100", "h100-sxm"), ("H100", "h100-sxm"), ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("h100-pcie", "h100-pcie"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("a100", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("v100", "v100-16gb"), ("Tesla V100-SXM2-32GB", "v100-32gb"), ("Tesla T4", "t4"), ("NVIDIA RTX A6000", "a6000"),
    (" l40s ", "l40s"), ("NVIDIA A10G", "a10g"),
])
def test_lookup_accepts_case_aliases_and_torch_device_names(spelling, name):
    assert gpu(spelling) is CATALOG[name]


def test_every_alias_points_into_the_catalog():
    assert set(ALIASES.values()) <= set(CATALOG)


def test_unknown_name_is_one_line_listing_the_names_and_the_fix():
    with pytest.raises(MemfitError) as err:
        gpu("rtx-4080")
    text = str(err.value)
    assert "\n" not in text and "'rtx-4080'" in text
    assert all(name in text for name in gpu_names() if CATALOG[name].vendor != "apple")
    assert "m3-max-36gb" in text and "--unified-memory" in text  # Macs by pattern, not 45 names
    assert "--budget" in text


@pytest.mark.parametrize("name", sorted(n for n, g in CATALOG.items() if g.vendor == "nvidia"))
def test_every_entry_is_consistent(name):
    g = CATALOG[name]
    assert g.name == name and g.full_name
    for figure in (g.memory_bytes, g.memory_bandwidth, g.host_link_bandwidth, g.bf16_flops, g.fp16_flops,
                   g.fp32_flops, g.tf32_flops, g.cuda_context_bytes, g.cublas_workspace_bytes):
        assert figure > 0
    assert g.bf16 == (g.compute_capability >= (8, 0))
    assert g.fp8 == (g.compute_capability >= (8, 9))
    assert g.memory == g.memory_bytes
    assert 0 < g.usable_bytes() < g.memory_bytes
    assert g.usable_bytes() == g.memory_bytes - g.outside_bytes
    assert 256 * 2**20 <= g.cuda_context_bytes <= 1024 * 2**20
    # dense tensor math is never slower than the CUDA cores; TF32 never faster than 16-bit
    assert g.fp16_flops >= g.fp32_flops and g.tf32_flops >= g.fp32_flops
    assert g.tf32_flops <= g.bf16_flops or not g.bf16
    # bytes, not GiB or GB: every part here is between 16 GB and 192 GB
    assert 14 * 2**30 < g.memory_bytes < 200 * 2**30


@pytest.mark.parametrize("name", sorted(n for n, g in CATALOG.items() if g.vendor != "nvidia"))
def test_every_amd_and_apple_entry_is_consistent(name):
    """AMD's compute capability is ROCm's gfx major.minor (bf16 on every card here, fp8 from CDNA3); a Mac's memory is
    its RAM, its usable bytes the working set macOS gives the GPU (hardware/macs.py)."""
    g = CATALOG[name]
    assert g.name == name and g.full_name and g.source and g.semantics in ("ROCm", "MPS")
    for figure in (g.memory_bytes, g.memory_bandwidth, g.bf16_flops, g.fp32_flops):
        assert figure > 0
    assert g.bf16 and g.fp16_flops >= g.fp32_flops and g.tf32_flops >= g.fp32_flops
    if g.vendor == "amd":
        assert g.fp8 == (g.arch in ("gfx942", "gfx950")) and g.usable_bytes() == g.memory_bytes - g.outside_bytes
        assert 20 * 2**30 < g.memory_bytes < 300 * 2**30 and g.memory_bytes % (16 * 2**20) == 0
    else:
        assert g.cuda_context_bytes == 0 and g.blas_workspaces == () and not g.fp8
        assert g.usable_bytes() == g.working_set_bytes in (g.memory_bytes * 2 // 3, g.memory_bytes * 3 // 4)


def test_known_values_from_the_sources():
    assert gpu("4090").memory_bytes == 25_757_220_864
    assert gpu("4090").compute_capability == (8, 9)
    assert gpu("h100-sxm").memory_bytes == 85_029_158_912
    assert gpu("h100-sxm").memory_bandwidth == 3.35e12
    assert gpu("a100-40gb").memory_bandwidth == 1.555e12
    assert gpu("a100-80gb").memory_bandwidth == 2.039e12
    assert gpu("h100-sxm").bf16_flops == 989.4e12
    assert gpu("a100-80gb").tf32_flops == 156e12 and gpu("a100-80gb").fp32_flops == 19.5e12
    assert not gpu("t4").bf16 and not gpu("v100").bf16 and gpu("a10g").bf16
    assert gpu("l4").fp8 and not gpu("a100").fp8
    assert gpu("h100").host_link == "PCIe 5.0 x16" and gpu("h100").host_link_bandwidth == 64e9


def test_cublas_workspace_matches_torch_defaults():
    # aten/src/ATen/cuda/CublasHandlePool.cpp: ":4096:2:16:8" by default, 32 MiB for sm90 (and, since
    # pytorch#175344, cc 10.x / 12.x)
    assert gpu("h100").cublas_workspace_bytes == 32 * 2**20 == gpu("h200").cublas_workspace_bytes
    assert gpu("a100").cublas_workspace_bytes == 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680
    assert gpu("4090").cublas_workspace_bytes == 8_519_680
    assert gpu("5090").cublas_workspace_bytes == 32 * 2**20


def test_to_dict_is_json_and_round_trips_the_fields():
    g = gpu("l40s")
    d = g.to_dict()
    json.dumps(d)
    assert d["compute_capability"] == [8, 9] and d["usable_bytes"] == g.usable_bytes()
    fields = {k: v for k, v in d.items() if k not in ("usable_bytes", "outside_bytes", "semantics", "blas_workspaces")}
    fields["compute_capability"] = tuple(fields["compute_capability"])
    fields["workspaces"] = tuple(tuple(w) for w in fields["workspaces"])
    assert d["semantics"] == "CUDA" and d["blas_workspaces"] == [["cuBLAS", g.cublas_workspace_bytes]]
    assert GPU(**fields) == g


def test_entries_are_frozen():
    with pytest.raises(AttributeError):
        gpu("t4").memory_bytes = 1
