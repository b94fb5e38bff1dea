"""Inference servers: the built-in HF engine or SGLang."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from areal_hex.config.base import Section


class SGLangConfig(Section):
    tp_size: int = Field(1, gt=0)
    mem_fraction_static: float = Field(0.8, gt=0, le=1)
    dtype: str = "bfloat16"
    # Arguments appended verbatim to `python -m sglang.launch_server`
    # (e.g. ["--disable-radix-cache", "--skip-server-warmup"]).
    extra_args: list[str] = []
    # Python interpreter that has sglang installed (None: this one).
    python: str | None = None


class InferenceConfig(Section):
    backend: Literal["builtin", "sglang"] = "builtin"
    num_servers: int = Field(1, gt=0)
    host: str = "127.0.0.1"
    base_port: int = Field(30000, gt=0, lt=65536)
    # Where the controller reaches server i; empty: http://<host>:<base_port + i>.
    server_urls: list[str] = []
    # GPU kind of server i (e.g. ["H800", "H20"]), for per-kind metrics; empty: unknown.
    gpu_kinds: list[str] = []
    device: str = "cpu"
    max_running_requests: int = Field(64, gt=0)
    context_length: int = Field(512, gt=0)
    # Padded prompt tokens per prefill forward of the built-in engine.
    max_prefill_tokens: int = Field(8192, gt=0)
    # Built-in engine: while rows run and more requests wait than fit, admit them once
    # this many fit (one prefill and one merge for many) rather than one per freed row.
    # None: max_running_requests // 4.
    min_admit: int | None = Field(None, gt=0)
    # Bearer token required by every endpoint but health and metrics (None: open).
    api_key: str | None = None
    # Weight reloads must name a directory inside this one (None: any directory).
    weights_dir: str | None = None
    # Version reported for the weights the server starts with (v0 = the initial model).
    weight_version: str = "0"
    seed: int = 0
    # Built-in server: characters of one text prompt, checked before tokenizing (None:
    # 32 per token of context_length; docs/api.md, "Size limits").
    max_prompt_chars: int | None = Field(None, gt=0)
    # torch intra-op threads of a CPU server (None: torch's default, one per core). On a
    # small machine shared with the trainer, 1 is often much faster for small models.
    num_threads: int | None = Field(None, gt=0)
    # How long `serve` waits for a launched SGLang server to answer /health.
    startup_timeout_s: float = Field(600.0, gt=0)
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    sglang: SGLangConfig = SGLangConfig()

    @model_validator(mode="after")
    def _builtin_only(self) -> InferenceConfig:
        if self.backend == "sglang" and self.max_prompt_chars is not None:
            raise ValueError("max_prompt_chars: the built-in server's limit; SGLang has none")
        return self

    def urls(self) -> list[str]:
        """Base URLs of the `num_servers` servers, in index order."""
        if self.server_urls:
            return list(self.server_urls)
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return [f"http://{host}:{self.base_port + i}" for i in range(self.num_servers)]
