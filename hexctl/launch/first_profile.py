"""`run.profile_first`: the machine measured for the job before a run without a plan or a
profile, or (with `cached`) a profile kept from an earlier run reused; the run is then
held against the cost model's prediction for its layout."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from areal_hex.config import ExperimentConfig

Say = Callable[[str], None]


def profile_first(
    cfg: ExperimentConfig, run_dir: Path, stream: TextIO
) -> tuple[Path | None, dict[str, str] | None]:
    """`run.profile_first`: this machine measured for the job into <run_dir>/profile (kept
    by a resumed run; taken from the profile cache when this machine, job and code were
    measured before; with "cached", only from there). (the directory, None), or (None,
    why there is no prediction)."""
    from hexctl.job.predict import LocalProfileFiles
    from hexctl.profile import cache
    from hexctl.profile.every_core import lacks_every_core

    out = run_dir / "profile"
    if LocalProfileFiles(out).profile.is_file():
        return out, None

    def say(text: str) -> None:
        print(f"areal-hex run: {text}", file=stream, flush=True)

    job = cache.profiled_job(cfg)
    shared = cfg.workflow.placement == "colocated"  # priced from the rates on every core
    key, parts = cache.key_of(cfg)
    entry = cache.lookup(key)
    if entry is not None:
        cache.restore(entry, out)
        say(f"reusing this machine's profile for this job (run.profile_first; {entry})")
        if shared and lacks_every_core(job, out):
            return every_core_first(cfg, job, out, entry, say)
        return out, None
    last = cache.last_seconds(parts)
    took = "several minutes on 2 cores" if last is None else f"the last one here took {last:.0f} s"
    if cfg.run.profile_first == "cached":
        say(
            "no prediction for this run: this machine has no profile for this job yet "
            f"(run.profile_first=cached); run.profile_first=true measures it first ({took}) "
            "and keeps it for later runs"
        )
        return None, {"unavailable": "run.profile_first=cached: no profile of this machine "
                      "for this job yet; run.profile_first=true measures one"}  # fmt: skip
    say(
        f"measuring this machine for the run's prediction (run.profile_first; {took}; "
        "kept for later runs of this job)"
    )
    from hexctl.profile.local import profile_local  # its client and servers: a measurement only

    t0 = time.monotonic()
    try:
        with contextlib.redirect_stdout(stream):
            profile_local(job, out, say=say, every_core=shared)
    except Exception as exc:  # the run goes on; its report says why it has no prediction
        return None, {"unavailable": f"run.profile_first: profiling failed: {exc}"}
    seconds = time.monotonic() - t0
    stored = cache.store(key, parts, out, seconds)
    say(f"profiled in {seconds:.0f} s" + (f"; kept in {stored}" if stored else ""))
    return out, None


def every_core_first(
    cfg: ExperimentConfig, job: ExperimentConfig, out: Path, entry: Path, say: Say
) -> tuple[Path | None, dict[str, str] | None]:
    """A colocated run whose kept profile was taken for the other modes: its rates on
    every core timed into it (and kept), or with `cached`, no prediction."""
    from hexctl.profile import cache
    from hexctl.profile.every_core import add_every_core

    if cfg.run.profile_first == "cached":
        why = (
            "run.profile_first=cached: this machine's profile of the job has no rates on "
            "every core (a colocated run's phases); run.profile_first=true times them"
        )
        say(f"no prediction for this run: {why.split(': ', 1)[1]}")
        return None, {"unavailable": why}
    say("timing the colocated phases on every core into the kept profile (run.profile_first)")
    t0 = time.monotonic()
    try:
        add_every_core(job, out, say)
    except Exception as exc:  # the run goes on; its report says why it has no prediction
        return None, {"unavailable": f"run.profile_first: profiling failed: {exc}"}
    cache.refresh(entry, out, "profile.yaml")
    say(f"every core timed in {time.monotonic() - t0:.0f} s; kept in {entry}")
    return out, None
