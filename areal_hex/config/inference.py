"""Inference servers: the built-in HF engine or SGLang."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from areal_hex.config.base import Section


class SGLangConfig(Section):
    tp_size: int = Field(1, gt=0)
    mem_fraction_static: float = Field(0.8, gt=0, le=1)
    dtype: str = "bfloat16"
    extra_args: list[str] = []


class InferenceConfig(Section):
    backend: Literal["builtin", "sglang"] = "builtin"
    num_servers: int = Field(1, gt=0)
    host: str = "127.0.0.1"
    base_port: int = Field(30000, gt=0, lt=65536)
    device: str = "cpu"
    max_running_requests: int = Field(64, gt=0)
    context_length: int = Field(512, gt=0)
    # Bearer token required by every endpoint but health and metrics (None: open).
    api_key: str | None = None
    # Weight reloads must name a directory inside this one.
    weights_dir: str | None = None
    sglang: SGLangConfig = SGLangConfig()
