"""One device kind for the profiler, the benches and the metrics' `gpu_kind` label: the
planner's catalogue names."""

from __future__ import annotations

import pytest

from areal_hex.device_kind import _MARKERS, CPU_KIND, device_kind, kind_of_device_name
from scheduler.catalogue import CATALOGUE


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H800", "H800"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H20", "H20"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("Some New Board", "Some New Board"),
    ],
)
def test_driver_names_map_to_catalogue_kinds(name: str, kind: str) -> None:
    assert kind_of_device_name(name) == kind


def test_every_kind_it_can_answer_is_in_the_catalogue() -> None:
    kinds = {k for _, k in _MARKERS if k != "A100"} | {"A100-40GB", "A100-80GB"}
    assert kinds <= set(CATALOGUE)


def test_a_cpu_is_the_cluster_yaml_cpu_kind() -> None:
    assert device_kind("cpu") == CPU_KIND == "CPU"
