"""Names the deploy targets give things: DNS-1123 labels, service names, and the
node-label value that marks nodes of a planner GPU kind."""

from __future__ import annotations

import hashlib
import re

from hexctl.deploy.config import DNS_1035_LABEL, DeployConfig
from hexctl.job.layout import ServiceSpec

# Value of `nvidia.com/gpu.product` (set by NVIDIA GPU feature discovery) per planner GPU
# kind. Extend or override with `gpu_labels` in the deploy config.
GPU_PRODUCT_LABELS: dict[str, str] = {
    "H100": "NVIDIA-H100-80GB-HBM3",
    "H200": "NVIDIA-H200",
    "H800": "NVIDIA-H800",
    "H20": "NVIDIA-H20",
    "A100-40GB": "NVIDIA-A100-SXM4-40GB",
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "A10": "NVIDIA-A10",
    "A10G": "NVIDIA-A10G",
    "L40S": "NVIDIA-L40S",
    "L4": "NVIDIA-L4",
    "RTX4090": "NVIDIA-GeForce-RTX-4090",
}
DEFAULT_GPU_LABEL_KEY = "nvidia.com/gpu.product"


def slug(text: str, max_len: int = 40) -> str:
    """A DNS-1123 label from any text: lowercase, [a-z0-9-], no leading/trailing '-'."""
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return s[:max_len].strip("-") or "x"


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def dns_name(text: str, max_len: int) -> str:
    """`text` as a DNS-1035 label of at most `max_len` characters, one to one: `text`
    itself when it already is one, else its slug cut to fit plus a hash of all of
    `text`. So `exp.1`, `exp_1`, `EXP-1` and `exp-1` give four names (the first three
    `exp-1-<hash>`), and two runs whose ids differ only in case or punctuation never
    share an object name or a label selector."""
    if len(text) <= max_len and re.fullmatch(DNS_1035_LABEL, text):
        return text
    head = slug(text, max_len - 9)
    if not head[0].isalpha():  # Service names must start with a letter (RFC 1035)
        head = slug(f"ah-{head}", max_len - 9)
    return f"{head}-{short_hash(text)}"


def normalize_model_name(name: str) -> str:
    """`Qwen/Qwen3-8B`, `/data/models/qwen3_8b/` and `qwen3-8b` all give `qwen38b`."""
    last = name.rstrip("/").split("/")[-1]
    return re.sub(r"[^a-z0-9]", "", last.lower())


def gpu_label_value(kind: str, dcfg: DeployConfig) -> str | None:
    """The node-label value that marks nodes of `kind`; None when unknown."""
    want = _kind_key(kind)
    for k, v in dcfg.gpu_labels.items():
        if _kind_key(k) == want:
            return v
    if dcfg.gpu_label_key != DEFAULT_GPU_LABEL_KEY:
        return slug(kind, 63)  # a custom key such as areal-hex/gpu-kind holds the kind itself
    for k, v in GPU_PRODUCT_LABELS.items():
        if _kind_key(k) == want:
            return v
    return None


def _kind_key(kind: str) -> str:
    """`A100-80GB`, `a100_80gb` and `A100 80GB` name one kind."""
    return re.sub(r"[^a-z0-9]", "", kind.lower())


def service_name(prefix: str, svc: ServiceSpec) -> str:
    return f"{prefix}-{slug(svc.name, 62 - len(prefix))}"
