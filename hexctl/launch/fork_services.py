"""`run.fork_services`: which services of a local run are forked, which modules the fork
server imports for them, and its start beside the supervisor (forkserver.py, zygote.py)."""

from __future__ import annotations

import os
import sys
import time

from areal_hex.config import ExperimentConfig
from areal_hex.run_files import RunPaths
from hexctl.job.layout import ServiceSpec
from hexctl.launch.forkserver import ForkServer, loadtime_env
from hexctl.launch.supervisor import ProcessSpec, Supervisor


def forkable(svc: ServiceSpec) -> bool:
    """Forked from the fork server (launch/forkserver.py): the servers, the trainer and
    `areal-hex` workflow tasks, which import torch and transformers. Valkey and the
    controller need neither: started as plain processes at once, they run on the core the
    fork server's imports leave idle."""
    return svc.role in ("inference", "trainer", "worker") and svc.command[:1] == ["areal-hex"]


# Optional packages the fork server's imports would load that no service uses (zygote.py
# `preload`: `-PACKAGE`): transformers' model module imports scipy.optimize only for the
# Hungarian matching of its object-detection losses (about 0.25 s of CPU, 380 modules).
# A forked service can still import it; transformers, asked before, says it is absent.
NOT_PRELOADED = ("scipy",)


def preload_modules(cfg: ExperimentConfig) -> list[str]:
    """What the fork server imports for the services (zygote.py `groups`): first what
    they all need (torch, transformers' model modules); then, in a branch for the trainer
    (`@train`), its entry modules and DeepSpeed with its ops' probe for a CPU trainer (on
    a GPU its accelerator would be chosen before the trainer's settings), beside the
    others' own (`@`: FastAPI, uvicorn, the server's entry modules) in the first; and,
    as `-PACKAGE`, what it keeps out of those imports (`NOT_PRELOADED`)."""
    trainer = ["hexctl.cli.train_cmd", "trainer_service.main"]
    if cfg.trainer.device == "cpu" and os.environ.get("DS_ACCELERATOR", "cpu") == "cpu":
        # and its probe of which ops can build, made at the trainer's `init_distributed`
        # otherwise: a test program compiled and linked against libaio each start
        trainer += ["deepspeed", "deepspeed.ops:__compatible_ops__"]
    return [
        *(f"-{name}" for name in NOT_PRELOADED),
        "torch", "transformers", "transformers.modeling_utils",
        "transformers.models.qwen3.modeling_qwen3", "hexctl.cli",
        "@train", *trainer,
        "@", "fastapi", "uvicorn", "hexctl.cli.serve_cmd", "rollout_service.server.main",
    ]  # fmt: skip


def start_fork_server(cfg: ExperimentConfig, specs: list[ProcessSpec]) -> ForkServer | None:
    """The run's fork server, importing from now on, with the load-time settings of the
    first service it will fork; None where nothing is forked or not on Linux. OSError if
    it cannot start."""
    forked = [s for s in specs if s.fork]
    if not forked or not sys.platform.startswith("linux"):
        return None
    env = {**os.environ, **loadtime_env(forked[0].env)}
    if "deepspeed" in (modules := preload_modules(cfg)):
        env["DS_ACCELERATOR"] = "cpu"
    run_dir = cfg.run.run_dir().resolve()
    return ForkServer(run_dir, modules, env, RunPaths.at(run_dir).log("fork-server"))


def serves(forker: ForkServer, cfg: ExperimentConfig, specs: list[ProcessSpec]) -> bool:
    """Whether `forker` (started early) forks the prepared run's services as one started
    now would: the same run directory, modules and load-time settings."""
    forked = [s for s in specs if s.fork]
    return (
        bool(forked)
        and forker.run_dir == cfg.run.run_dir().resolve()
        and forker.modules == preload_modules(cfg)
        and not forker.differs({**os.environ, **forked[0].env})
    )


def attach_fork_server(
    sup: Supervisor,
    cfg: ExperimentConfig,
    specs: list[ProcessSpec],
    early: ForkServer | None = None,
) -> None:
    """With `run.fork_services` on Linux: the fork server `early` if it `serves` the run,
    else one started now (it imports while the launcher goes on)."""
    if early is not None and serves(early, cfg, specs):
        sup.attach(early)
        sup.events.append((early.started_at, "launcher", "fork server started"))
        return
    if early is not None:
        early.close()
    try:
        forker = start_fork_server(cfg, specs)
    except OSError as exc:
        sup.events.append((time.time(), "launcher", f"no fork server: {exc}"))
        return
    if forker is not None:
        sup.attach(forker)
        sup.events.append((time.time(), "launcher", "fork server started"))
