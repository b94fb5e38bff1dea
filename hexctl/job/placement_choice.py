"""`workflow.placement: auto`: the concrete placement a run runs in, chosen before it starts.

The candidates are the placements the run's config allows, each built and validated as
the config it would run: colocated only with `run.mode` sync; hybrid with the config's
servers on devices of their own plus `workflow.lent_servers` on the trainer's (as `bench
modes` runs it) and a version every step; disaggregated always. A `Price` gives each its
predicted samples/s in the run's mode (the launcher's: the cost model's prediction from
this machine's cached profile of the job, `hexctl/launch/placement_prices.py`), or why
it has none. The fastest runs; with no price at all, the default (`DEFAULT_PLACEMENT`),
which also wins ties. `prepare_run` resolves it, says the choice in one line and keeps it
in the run directory (`placement.json`, in summary.json as `placement_choice`); the
run's config.yaml holds the concrete placement, so eval and `--resume` see what ran.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from areal_hex.config import ConfigError, ExperimentConfig
from areal_hex.config.base import build
from areal_hex.config.workflow import AUTO_PLACEMENT, DEFAULT_PLACEMENT, PLACEMENT_MODES

# A candidate's predicted samples/s in its run mode, or why it has none.
Price = Callable[[ExperimentConfig], "float | str"]
NO_PROFILE = "no profile consulted"
_TIE = 1e-6  # relative: a candidate must beat the default by more to be chosen


@dataclass
class PlacementChoice:
    """What `auto` became and why: each candidate's predicted samples/s (None: no
    price), and why a placement was not a candidate or has no price."""

    chosen: str
    source: Literal["profile", "default"]
    run_mode: str
    candidates: dict[str, float | None]
    notes: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """The one line said at start."""
        head = f"workflow.placement auto: {self.chosen}"
        if self.source == "default":
            why = next((n for k, n in self.notes.items() if k in self.candidates), NO_PROFILE)
            return f"{head} (the default: {why})"
        rates = ", ".join(
            f"{k} {'-' if v is None else f'{v:.3g}'}"
            for k, v in sorted(self.candidates.items(), key=lambda kv: -(kv[1] or 0.0))
        )
        return f"{head} (predicted samples/s, {self.run_mode}: {rates})"


def candidates(cfg: ExperimentConfig) -> tuple[dict[str, ExperimentConfig], dict[str, str]]:
    """(placement -> the config the run would run in it, placement -> why it cannot)."""
    data = cfg.model_dump(mode="json")
    valid: dict[str, ExperimentConfig] = {}
    refused: dict[str, str] = {}
    for placement in PLACEMENT_MODES:
        d = json.loads(json.dumps(data))  # a deep copy of plain data
        d["workflow"]["placement"] = placement
        if placement == "hybrid":
            listed = [k for k in ("server_urls", "gpu_kinds") if d["inference"][k]]
            if listed:
                refused[placement] = (
                    f"inference.{listed[0]} lists the servers one by one: no lent servers "
                    "can come on top"
                )
                continue
            d["inference"]["num_servers"] += cfg.workflow.lent_servers
        try:
            valid[placement] = build(ExperimentConfig, d, f"workflow.placement auto ({placement})")
        except ConfigError as exc:
            refused[placement] = str(exc).splitlines()[-1].strip().removeprefix("<root>: ")
    return valid, refused


def choose(cfg: ExperimentConfig, price: Price | None) -> tuple[PlacementChoice, ExperimentConfig]:
    """The fastest valid placement by `price` (None: none priced) and its config."""
    valid, notes = candidates(cfg)
    rates: dict[str, float | None] = {}
    for name, c in valid.items():
        got = price(c) if price is not None else NO_PROFILE
        rates[name] = None if isinstance(got, str) else float(got)
        if isinstance(got, str):
            notes[name] = got
    priced = {k: v for k, v in rates.items() if v is not None}
    source: Literal["profile", "default"] = "profile" if priced else "default"
    chosen = max(priced, key=lambda k: priced[k], default=DEFAULT_PLACEMENT)
    if DEFAULT_PLACEMENT in priced and priced[chosen] <= priced[DEFAULT_PLACEMENT] * (1 + _TIE):
        chosen = DEFAULT_PLACEMENT  # a tie keeps the default
    choice = PlacementChoice(chosen, source, cfg.run.mode, rates, notes)
    return choice, valid[chosen]


def resolve_placement(
    cfg: ExperimentConfig, price: Price | None, say: Callable[[str], None]
) -> tuple[ExperimentConfig, PlacementChoice | None]:
    """`cfg` with `workflow.placement: auto` made concrete (and the choice, said);
    any other placement as it is (no choice)."""
    if cfg.workflow.placement != AUTO_PLACEMENT:
        return cfg, None
    choice, chosen = choose(cfg, price)
    say(choice.line())
    return chosen, choice


def write_choice(path: Path, choice: PlacementChoice) -> None:
    path.write_text(json.dumps(choice.as_dict(), indent=2, sort_keys=True))
