"""Run-wide settings: identity, output directory, mode, process placement."""

from __future__ import annotations

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
