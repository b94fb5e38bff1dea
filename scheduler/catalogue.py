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
    source: str = "user override"


def _k(name: str, tflops: float, gb: float, gbs: float, source: str) -> GpuKind:
    return GpuKind(name=name, bf16_tflops=tflops, hbm_gb=gb, hbm_gbs=gbs, source=source)


CATALOGUE: dict[str, GpuKind] = {
    k.name: k
    for k in (
        _k("H100", 989.0, 80, 3350, "NVIDIA H100 Tensor Core GPU datasheet, SXM5 column"),
        # The AReaL-Hex paper's H800 figures (756 TFLOPS, 2 TB/s) are the PCIe board's;
        # the SXM board has H100 SXM compute and 3.35 TB/s (override per spec).
        _k("H800", 756.0, 80, 2000, "NVIDIA H800 PCIe datasheet; AReaL-Hex paper, sec. 5"),
        _k("H200", 989.0, 141, 4800, "NVIDIA H200 Tensor Core GPU datasheet, SXM column"),
        _k("H20", 148.0, 96, 4000, "NVIDIA H20 product brief; AReaL-Hex paper, sec. 5"),
        _k("A100-40GB", 312.0, 40, 1555, "NVIDIA A100 datasheet, 40GB SXM column"),
        _k("A100-80GB", 312.0, 80, 2039, "NVIDIA A100 datasheet, 80GB SXM column"),
        _k("L40S", 362.0, 48, 864, "NVIDIA L40S datasheet (362.05 dense BF16, GDDR6)"),
        _k("L4", 121.0, 24, 300, "NVIDIA L4 datasheet (242 with sparsity -> 121 dense)"),
        _k("A10", 125.0, 24, 600, "NVIDIA A10 datasheet (250 with sparsity -> 125 dense)"),
        _k("RTX4090", 165.2, 24, 1008, "NVIDIA Ada Lovelace whitepaper, RTX 4090, FP32 acc."),
    )
}

# Spellings people use for the same boards.
ALIASES: dict[str, str] = {
    "A100-40": "A100-40GB",
    "A100-80": "A100-80GB",
    "A100": "A100-80GB",
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
