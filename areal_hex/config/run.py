"""Run-wide settings: identity, output directory, mode, process placement."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from areal_hex.config.base import Section

RUN_ID_MAX = 128


class RunConfig(Section):
    name: str = "areal-hex"
    # Namespaces Redis keys and names the run directory; None: derived from name + time.
    run_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", max_length=RUN_ID_MAX)
    output_dir: str = "runs"
    mode: Literal["async", "sync"] = "async"
    seed: int = 0
    # Pin processes to cores so rollout and training really run apart on small machines.
    pin_cores: bool = False
    # With pin_cores: where Valkey, the rollout controller and its reward workers run:
    # beside the trainer, beside the inference servers, or "auto": the side the cost
    # model predicts the faster pipeline for, from the run's profile (the trainer's side
    # without one, and always in sync mode, where the trainer waits while they work).
    host_cores: Literal["auto", "trainer", "inference"] = "auto"
    # No plan and no `run --profile DIR`: first measure this machine for the job
    # (`profile --local` into <run_dir>/profile: minutes for the tiny example on 2 cores,
    # more the larger inference.max_running_requests, whose batches it times; kept
    # in ~/.cache/areal-hex for later runs of the job), so that the run is held against the
    # cost model's prediction for its layout. "cached": only a profile this machine already
    # has for the job (from an earlier `run.profile_first=true`); without one the run goes
    # on at once, with no prediction, and says how to get one.
    profile_first: bool | Literal["cached"] = False
    # A box that is up (`areal-hex box up BOX.yaml`; its name): `run --plan` starts each
    # service in its planned node (the node's namespace and CPU cgroup), bound to the
    # node's address, with Valkey and the controller on the box's spine (the launcher's
    # namespace), reached over the links. None: this machine's own devices.
    box: str | None = Field(None, pattern=r"^[a-z0-9]{1,6}$")
    # A local `areal-hex run` starts its inference servers and trainer forked from one
    # parent that has imported torch, transformers' model modules and FastAPI (the
    # trainer from a branch of it with DeepSpeed) once, instead of each importing them
    # (seconds of CPU each; docs/running.md); any failure starts plain processes.
    # false: plain processes always.
    fork_services: bool = True
    # Restarts allowed per crashed inference server before the run fails.
    max_restarts: int = Field(3, ge=0)
    # Seconds a service may take to become healthy.
    start_timeout_s: float = Field(300.0, gt=0)
    # Seconds an inference server that answered /health before may go without answering
    # (hung, e.g. SIGSTOPped) before the launcher kills it and starts it again.
    hung_after_s: float = Field(30.0, gt=0)
    # Seconds the trainer may go without completing an optimizer step, while every
    # process of the run is alive, before the run counts as stalled: the launcher then
    # reports which side waits for what (and the progress line shows the wait from half
    # this on). The clock starts again at each step and at each (re)start of a process.
    stall_after_s: float = Field(300.0, gt=0)
    # A stalled run is stopped (exit 1, with the resume hint); false: only reported.
    stop_on_stall: bool = True
    # Share of the training split used for the tiny model's supervised warm start.
    warm_start_fraction: float = Field(0.5, gt=0, le=1)
    # Share of those warm-start solutions that keep their final `#### answer` line (the
    # others stop after the working). Below 1 the initial policy states its answer in the
    # format the reward checks only some of the time, like a base model not yet tuned to
    # the answer format; chosen by `run.seed`.
    warm_start_answer_fraction: float = Field(1.0, ge=0, le=1)
    # Progress display: "auto" (live on a terminal, log lines otherwise), "live", "log".
    progress: Literal["auto", "live", "log"] = "auto"
    # Set by `areal-hex run` when it started the embedded Valkey that `redis.url` names
    # (so the resolved config still lays out a `redis` service).
    embedded_redis: bool = False
    # Experiment trackers the trainer and the controller log their metric rows to (any
    # subset; each needs its extra: pip install areal-hex[tensorboard|wandb|mlflow]).
    # TensorBoard and MLflow write under the run directory; W&B offline unless told.
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = []
    wandb_project: str = "areal-hex"
    wandb_mode: Literal["online", "offline"] = "offline"

    @field_validator("run_id")
    @classmethod
    def _a_name_not_a_path(cls, v: str | None) -> str | None:
        # `..` would put the run directory beside output_dir, `.x` hides it
        if v is not None and v.startswith("."):
            raise ValueError(
                f"run_id {v!r} starts with '.': expected a name that starts with a letter, "
                "digit, '_' or '-'"
            )
        return v

    def run_dir(self) -> Path:
        """`output_dir/run_id`; the launcher fills in `run_id` before any process starts."""
        if self.run_id is None:
            raise ValueError("run.run_id is not set (the launcher sets it; or pass run.run_id=...)")
        return Path(self.output_dir) / self.run_id
