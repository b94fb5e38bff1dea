"""A local run's fork server started before the run is prepared (fork_services.py), so
that its imports run beside the launcher's own preparation."""

from __future__ import annotations

from areal_hex.config import ExperimentConfig
from areal_hex.errors import UsageError
from areal_hex.plan import Plan
from hexctl.job.layout import build_layout
from hexctl.launch.fork_services import start_fork_server
from hexctl.launch.forkserver import ForkServer
from hexctl.launch.run import process_specs


def early_fork_server(cfg: ExperimentConfig, plan: Plan | None) -> ForkServer | None:
    """A local run's fork server started before the run is prepared (its directory, v0,
    ports: `prepare_run`), so that its imports (the start's critical path, seconds on one
    core) run beside the launcher's own preparation on another core; its services as the
    config says before preparation. `attach_fork_server` keeps it if the prepared run
    forks the same way, else starts another. None: a box run, the switch off, a run that
    may measure this machine first (`run.profile_first`: its imports would share the
    cores with the measurement), or a config whose services are only known once prepared."""
    measures = cfg.run.profile_first is True or (
        cfg.run.profile_first == "cached" and cfg.workflow.placement == "colocated"
    )  # colocated: a cached profile may lack the rates on every core, then measured
    if cfg.run.box is not None or not cfg.run.fork_services or measures:
        return None
    try:
        specs = process_specs(cfg, build_layout(cfg, plan), cfg.run.run_dir() / "config.yaml")
        return start_fork_server(cfg, specs)
    except (UsageError, ValueError, KeyError, OSError):  # the prepared run will say, or start
        return None
