"""Built-in GPU catalogue: dense BF16 tensor TFLOPS, HBM capacity and bandwidth.

Every figure is the vendor datasheet value for dense (no sparsity) BF16 with FP32
accumulation; the `source` field names the document. A cluster spec may override any
field per kind (`gpu_overrides`), e.g. for a different board variant.
"""

from __future__ import annotations

import difflib

from pydantic import Field

from areal_hex.config.base import Section


class GpuKind(Section):
    name: str
    bf16_tflops: float = Field(gt=0)  # dense BF16 tensor-core peak, TFLOP/s
    hbm_gb: float = Field(gt=0)  # device memory, GB (10^9 bytes)
    hbm_gbs: float = Field(gt=0)  # device-memory bandwidth, GB/s
    # Efficiencies for this kind; unset: the workload's constants (train_mfu, prefill_mfu,
    # decode_bw_efficiency). A cluster spec sets them under gpu_overrides; `areal-hex
    # profile` replaces the analytic rates of the kinds it measured altogether.
    train_mfu: float | None = Field(None, gt=0, le=1)
    prefill_mfu: float | None = Field(None, gt=0, le=1)
    decode_bw_efficiency: float | None = Field(None, gt=0, le=1)
    source: str = "user override"


def _k(name: str, tflops: float, gb: float, gbs: float, source: str) -> GpuKind:
    return GpuKind(name=name, bf16_tflops=tflops, hbm_gb=gb, hbm_gbs=gbs, source=source)


CATALOGUE: dict[str, GpuKind] = {
    k.name: k
    for k in (
        # Hopper. 8-GPU NVLink machines carry SXM boards; the PCIe and NVL boards are
        # separate kinds. H800 is the export variant of H100 (same SXM compute and HBM).
        _k("H100", 989.0, 80, 3350, "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column"),
        _k("H100-PCIe", 756.0, 80, 2000, "NVIDIA H100 datasheet, H100 PCIe column"),
        _k("H100-NVL", 835.0, 94, 3900, "NVIDIA H100 datasheet, H100 NVL column (1,671 sparse)"),
        _k("H800", 989.0, 80, 3350, "NVIDIA H800 SXM5 datasheet (H100 SXM figures)"),
        # The AReaL-Hex paper lists these PCIe figures for its H800 machines (sec. 5).
        _k("H800-PCIe", 756.0, 80, 2000, "NVIDIA H800 PCIe datasheet; AReaL-Hex paper, sec. 5"),
        _k("H200", 989.0, 141, 4800, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column"),
        _k("H20", 148.0, 96, 4000, "NVIDIA H20 product brief; AReaL-Hex paper, sec. 5"),
        # Blackwell: 4.5 PFLOPS BF16 with sparsity -> 2.25 dense; 180 GB, 8 TB/s per GPU.
        _k("B200", 2250.0, 180, 8000, "NVIDIA DGX B200 datasheet (1,440 GB, 64 TB/s per 8 GPUs)"),
        # Ampere
        _k("A100-40GB", 312.0, 40, 1555, "NVIDIA A100 datasheet, 40GB SXM column"),
        _k("A100-80GB", 312.0, 80, 2039, "NVIDIA A100 datasheet, 80GB SXM column"),
        _k("A10", 125.0, 24, 600, "NVIDIA A10 datasheet (250 with sparsity -> 125 dense)"),
        # Ada
        _k("L40S", 362.0, 48, 864, "NVIDIA L40S datasheet (362.05 dense BF16, GDDR6)"),
        _k("L20", 119.5, 48, 864, "NVIDIA L20 product brief (239 with sparsity -> 119.5 dense)"),
        _k("L4", 121.0, 24, 300, "NVIDIA L4 datasheet (242 with sparsity -> 121 dense)"),
        _k("RTX4090", 165.2, 24, 1008, "NVIDIA Ada Lovelace whitepaper, RTX 4090, FP32 acc."),
        # AMD CDNA 3
        _k("MI300X", 1307.4, 192, 5300, "AMD Instinct MI300X datasheet (dense BF16)"),
    )
}

# Spellings people use for the same boards.
ALIASES: dict[str, str] = {
    "A100-40": "A100-40GB",
    "A100-80": "A100-80GB",
    "A100": "A100-80GB",
    "H100-SXM": "H100",
    "H100-SXM5": "H100",
    "H800-SXM": "H800",
    "H800-SXM5": "H800",
    "H200-SXM": "H200",
    "RTX 4090": "RTX4090",
    "4090": "RTX4090",
    "RTX-4090": "RTX4090",
}


class UnknownGpuKind(ValueError):
    pass


def canonical_kind(name: str) -> str:
    """The catalogue name for `name` (case-insensitive, aliases accepted)."""
    table = {k.upper(): k for k in CATALOGUE} | {a.upper(): k for a, k in ALIASES.items()}
    hit = table.get(name.strip().upper())
    if hit is None:
        close = difflib.get_close_matches(name.upper(), list(table), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(table[c]) for c in close)}?" if close else ""
        raise UnknownGpuKind(
            f"unknown GPU kind {name!r}{hint} (known: {', '.join(CATALOGUE)}; or define it "
            f"under gpu_overrides with bf16_tflops, hbm_gb, hbm_gbs)"
        )
    return hit


def resolve_kind(name: str, overrides: dict[str, dict[str, float]]) -> GpuKind:
    """The catalogue entry for `name` with the spec's overrides applied; a kind missing
    from the catalogue is accepted when its override gives all three figures."""
    extra = overrides.get(name, {})
    try:
        base = CATALOGUE[canonical_kind(name)]
    except UnknownGpuKind:
        if set(extra) >= {"bf16_tflops", "hbm_gb", "hbm_gbs"}:
            return GpuKind(name=name, **extra)
        raise
    extra = extra or overrides.get(base.name, {})
    if not extra:
        return base
    return base.model_copy(update={**extra, "source": f"{base.source}; overridden in spec"})
