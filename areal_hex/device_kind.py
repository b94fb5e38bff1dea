"""The kind of device a process runs on, in the planner's short names.

One answer for every part that names a device: the profiler files its rates under it, the
benches report it, and the trainer labels its Prometheus metrics with it (`gpu_kind`), so
the label matches the kinds a plan and its cluster YAML use (the catalogue,
`scheduler/catalogue.py`: "H100", "A100-80GB", "RTX4090"; a CPU is "CPU").
"""

from __future__ import annotations

# What a CPU is called in a cluster YAML, a profile and a plan.
CPU_KIND = "CPU"

# (marker in the upper-cased device name, catalogue kind), most specific first: "H100
# PCIE" before "H100", "H200" before "H20", "A100" before "A10", "L40S" before "L4".
_MARKERS = (
    ("H100 PCIE", "H100-PCIe"),
    ("H100 NVL", "H100-NVL"),
    ("H800 PCIE", "H800-PCIe"),
    ("H200", "H200"),
    ("H100", "H100"),
    ("H800", "H800"),
    ("H20", "H20"),
    ("B200", "B200"),
    ("A100", "A100"),  # 40 or 80 GB: told apart below
    ("A10", "A10"),
    ("L40S", "L40S"),
    ("L20", "L20"),
    ("L4", "L4"),
    ("4090", "RTX4090"),
    ("MI300X", "MI300X"),
)


def kind_of_device_name(name: str) -> str:
    """The catalogue kind of a device as its driver names it ("NVIDIA H100 80GB HBM3" ->
    "H100", "NVIDIA A100-SXM4-40GB" -> "A100-40GB"); a name no kind matches is returned
    as it is."""
    upper = name.upper()
    for marker, kind in _MARKERS:
        if marker in upper:
            if kind == "A100":
                return "A100-40GB" if "40GB" in upper.replace(" ", "") else "A100-80GB"
            return kind
    return name


def device_kind(device: str) -> str:
    """The kind of the device a process computes on: "CPU" for `device` "cpu", else the
    catalogue kind of the first visible CUDA device ("cuda" when none is visible)."""
    if not device.startswith("cuda"):
        return CPU_KIND
    import torch

    if not torch.cuda.is_available():
        return "cuda"
    return kind_of_device_name(torch.cuda.get_device_name(0))
