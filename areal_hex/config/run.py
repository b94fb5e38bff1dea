"""Run-wide settings: identity, output directory, mode, process placement."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from areal_hex.config.base import Section


class RunConfig(Section):
    name: str = "areal-hex"
    # Namespaces Redis keys and names the run directory; None: derived from name + time.
    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    output_dir: str = "runs"
    mode: Literal["async", "sync"] = "async"
    seed: int = 0
    # Pin processes to cores so rollout and training really run apart on small machines.
    pin_cores: bool = False
    # Restarts allowed per crashed inference server before the run fails.
    max_restarts: int = Field(3, ge=0)
    # Seconds a service may take to become healthy.
    start_timeout_s: float = Field(300.0, gt=0)
    # Share of the training split used for the tiny model's supervised warm start.
    warm_start_fraction: float = Field(0.5, gt=0, le=1)
    # Progress display: "auto" (live on a terminal, log lines otherwise), "live", "log".
    progress: Literal["auto", "live", "log"] = "auto"

    def run_dir(self) -> Path:
        """`output_dir/run_id`; the launcher fills in `run_id` before any process starts."""
        if self.run_id is None:
            raise ValueError("run.run_id is not set (the launcher sets it; or pass run.run_id=...)")
        return Path(self.output_dir) / self.run_id
