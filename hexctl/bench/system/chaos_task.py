"""The `task_kill` fault of bench chaos: SIGKILL of one instance of a workflow task (a
`worker` service: a reference worker, a reward model, any custom task), which the
launcher must start again while the job goes on. The instances are read from the run's
resolved config, whatever their role. A job whose config has no task gets a harmless
`custom` one for the fault (`NOOP_TASK`: a process that sleeps), so the fault always
strikes a real process the launcher supervises. Repeated `task_kill` faults go through
the instances in turn (the n-th strikes instance n modulo their number), so a job with a
reference worker and a reward model has each struck by two faults.
"""

from __future__ import annotations

import sys
from pathlib import Path

from areal_hex.config import load_config
from areal_hex.config.base import load_yaml_text

NOOP_TASK = "chaos-noop"


def noop_task_override() -> str:
    """`workflow.tasks=[...]` with one custom task that only sleeps."""
    argv = f"['{sys.executable}', '-c', 'import time; time.sleep(86400)']"
    return f"workflow.tasks=[{{name: {NOOP_TASK}, role: custom, command: {argv}}}]"


def task_overrides(config: str, overrides: list[str]) -> list[str]:
    """The override that gives the job a task to strike, when its config has none."""
    cfg = load_config(config, overrides)
    return [] if cfg.workflow.tasks else [noop_task_override()]


def task_instances(run_dir: Path) -> list[str]:
    """The service names of every workflow task's instances (`<task>-<i>`), in the
    config's order, from the run's resolved config."""
    cfg = load_yaml_text((run_dir / "config.yaml").read_text(), str(run_dir / "config.yaml"))
    tasks = (cfg.get("workflow") or {}).get("tasks") or []
    return [f"{t['name']}-{i}" for t in tasks for i in range(int(t.get("instances", 1)))]


def task_target(run_dir: Path, nth: int) -> str:
    """The instance the `nth` (from 0) `task_kill` fault of the job strikes."""
    names = task_instances(run_dir)
    return names[nth % len(names)]
