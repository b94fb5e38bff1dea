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
    """What the fork server imports for the services: torch, transformers' model modules,
    FastAPI and uvicorn, the services' entry modules, and DeepSpeed for a CPU trainer
    (on a GPU its accelerator would be chosen before the trainer's settings); and, as
    `-PACKAGE`, what it keeps out of those imports (`NOT_PRELOADED`)."""
    modules = [
        *(f"-{name}" for name in NOT_PRELOADED),
        "torch", "transformers", "transformers.modeling_utils",
        "transformers.models.qwen3.modeling_qwen3", "fastapi", "uvicorn",
        "hexctl.cli", "hexctl.cli.serve_cmd", "hexctl.cli.train_cmd",
        "rollout_service.server.main", "trainer_service.main",
    ]  # fmt: skip
    if cfg.trainer.device == "cpu" and os.environ.get("DS_ACCELERATOR", "cpu") == "cpu":
        modules.append("deepspeed")
    return modules


def attach_fork_server(sup: Supervisor, cfg: ExperimentConfig, specs: list[ProcessSpec]) -> None:
    """With `run.fork_services` on Linux: start the fork server now (it imports while the
    launcher goes on) with the load-time settings of the first service it will fork."""
    forked = [s for s in specs if s.fork]
    if not forked or not sys.platform.startswith("linux"):
        return
    env = {**os.environ, **loadtime_env(forked[0].env)}
    if "deepspeed" in (modules := preload_modules(cfg)):
        env["DS_ACCELERATOR"] = "cpu"
    log = RunPaths.of(cfg).log("fork-server")
    try:
        forker = ForkServer(cfg.run.run_dir(), modules, env, log)
    except OSError as exc:
        sup.events.append((time.time(), "launcher", f"no fork server: {exc}"))
        return
    sup.attach(forker)
    sup.events.append((time.time(), "launcher", "fork server started"))
