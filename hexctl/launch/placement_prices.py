"""The prices `workflow.placement: auto` chooses by (`hexctl/job/placement_choice.py`):
each candidate's predicted samples/s from this machine's cached profile of the job
(`hexctl/profile/cache.py`: every placement of a job keys the same profile), priced by
the cost model as the run's own prediction is (`hexctl/job/predict.py:host_side`).

Only `run.profile_first: true` measures a profile the cache lacks (and times the rates on
every core a colocated candidate is priced from); otherwise a candidate without a profile
has no price, and the choice falls to the default. Nothing here is imported, and no
scheduler module loaded, unless a placement is `auto`; the cost model only once a
profile is found.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from areal_hex.config import ConfigError, ExperimentConfig
from hexctl.job.placement_choice import Price

Say = Callable[[str], None]
_ABSENT = "no profile of this machine for this job; run.profile_first=true measures one"


def profile_prices(say: Say, profile_dir: Path | None = None) -> Price:
    """A `Price` over the profile cache (each profile looked up, or measured, once); or
    over the local profile in `profile_dir` (`run --profile DIR`), read as it is."""
    entries: dict[str, Path | str] = {}

    def price(cfg: ExperimentConfig) -> float | str:
        from hexctl.profile import cache

        key, parts = ("given", {}) if profile_dir is not None else cache.key_of(cfg)
        if key not in entries:
            found = profile_dir or cache.lookup(key)
            measure = cfg.run.profile_first is True
            entries[key] = found or (_measure(cfg, key, parts, say) if measure else _ABSENT)
        entry = entries[key]
        if isinstance(entry, str):
            return entry
        if cfg.workflow.placement == "colocated":
            lacking = _every_core(cfg, entry, say, add=profile_dir is None)
            if lacking is not None:
                return lacking
        return _predicted(cfg, entry)

    return price


def _measure(cfg: ExperimentConfig, key: str, parts: dict, say: Say) -> Path | str:
    """This machine measured for the job (with the rates on every core where the run is
    synchronous, for a colocated candidate) and kept in the cache."""
    from hexctl.profile import cache
    from hexctl.profile.local import profile_local

    say("measuring this machine for workflow.placement auto (run.profile_first)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="areal-hex-placement-") as tmp:
        out = Path(tmp) / "profile"
        try:
            with contextlib.redirect_stdout(sys.stderr):
                profile_local(
                    cache.profiled_job(cfg), out, say=say, every_core=cfg.run.mode == "sync"
                )
        except Exception as exc:  # the run goes on in the default placement
            return f"profiling failed: {exc}"
        stored = cache.store(key, parts, out, time.monotonic() - t0)
    return stored or "the profile cache cannot be written"


def _every_core(cfg: ExperimentConfig, entry: Path, say: Say, add: bool) -> str | None:
    """None when the profile prices a colocated run (its phases' rates on every core,
    timed now into the kept profile where `run.profile_first: true` and `add`); else why
    not."""
    from hexctl.profile import cache
    from hexctl.profile.every_core import add_every_core, lacks_every_core

    job = cache.profiled_job(cfg)
    if not lacks_every_core(job, entry):
        return None
    if cfg.run.profile_first is not True or not add:
        how = "; run.profile_first=true times them" if add else ""
        return f"the profile has no rates on every core (a colocated run's phases){how}"
    say("timing the colocated phases on every core into the kept profile (run.profile_first)")
    with tempfile.TemporaryDirectory(prefix="areal-hex-placement-") as tmp:
        out = Path(tmp)
        cache.restore(entry, out)
        try:
            add_every_core(job, out, say)
        except Exception as exc:  # the run goes on without a colocated price
            return f"profiling failed: {exc}"
        cache.refresh(entry, out, "profile.yaml")
    return None


def _predicted(cfg: ExperimentConfig, entry: Path) -> float | str:
    """The cost model's pipeline rate for `cfg`'s layout in its run mode."""
    from hexctl.job.predict import host_side

    try:
        _, pred = host_side(cfg, None, entry)
    except ConfigError as exc:
        return f"the cost model cannot price it: {exc}"
    if "unavailable" in pred:
        return str(pred["unavailable"])
    side = "synchronous" if cfg.run.mode == "sync" else "asynchronous"
    return float(pred[side]["pipeline_samples_per_s"])
