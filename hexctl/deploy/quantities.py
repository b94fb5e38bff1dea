"""Kubernetes quantities (`4`, `500m`, `16Gi`) as numbers and back, and what a pod gets
from the per-GPU resources of the deploy config (`pod_share`); the compose target
sizes its services' /dev/shm the same way."""

from __future__ import annotations

from hexctl.deploy.config import Resources

_MEMORY_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_MEMORY_UNITS.update({"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40})


def cpu_millis(quantity: str) -> int:
    """A CPU quantity (`4`, `0.5`, `500m`) in millicores."""
    if quantity.endswith("m"):
        return int(float(quantity[:-1]))
    return int(round(float(quantity) * 1000))


def memory_bytes(quantity: str) -> int:
    """A memory quantity (`16Gi`, `512Mi`, `1G`, plain bytes) in bytes."""
    num = quantity.rstrip("KMGTi")
    return int(float(num) * _MEMORY_UNITS[quantity[len(num) :]])


def cpu_quantity(millis: int) -> str:
    return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"


def memory_quantity(n: int) -> str:
    """Bytes as whole Mi (rounded up), or Gi where exact."""
    mib = -(-n // 2**20)
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def pod_share(res: Resources, gpus: int) -> Resources:
    """What a pod with `gpus` GPUs gets from the per-GPU `res` (inference and trainer
    pods); CPU-only pods (`gpus` 0) get `res` as it is."""
    if gpus <= 1:
        return res
    return Resources(
        cpu=cpu_quantity(cpu_millis(res.cpu) * gpus),
        memory=memory_quantity(memory_bytes(res.memory) * gpus),
        cpu_limit=cpu_quantity(cpu_millis(res.cpu_limit) * gpus) if res.cpu_limit else None,
        memory_limit=(
            memory_quantity(memory_bytes(res.memory_limit) * gpus) if res.memory_limit else None
        ),
        shm=memory_quantity(memory_bytes(res.shm) * gpus),
    )
