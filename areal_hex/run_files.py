"""A run directory: every path in it (`RunPaths`) and the typed rows of its metric files.

    runs/<run_id>/
      launch.lock          held (flock) by the launcher serving the run; holds its pid
      config.yaml          resolved config every service reads
      metrics.jsonl        one `TrainerRow` per optimizer step (trainer, rank 0)
      rollout.jsonl        one `RolloutRow` per metrics interval (controller; last: final)
      events.json          launcher: start/ready/end times, restarts (every attempt)
      prediction.json      the cost model's rates for the run's layout (launcher)
      placement.json       how `workflow.placement: auto` was resolved (launcher)
      summary.json         the report's summary (the ledger over every attempt)
      attempts/<n>/        each `areal-hex run` attempt's own events.json and summary.json
      committed.jsonl      trainer: the group ids of each committed checkpoint
      report/*.png         the report's plots
      logs/<service>.log   one log per process
      weights/v<N>/        published weights (HF format); `inference.weights_dir` may move it
      checkpoints/         trainer checkpoints; `trainer.checkpoint_dir` may move it
      valkey/              the embedded Valkey's data (append-only file)

Rows are written and read through the same pydantic type: a writer that sets an unknown
key fails at once (`extra="forbid"`), and readers use attributes, so a renamed field
cannot silently turn into a missing value. Fields default so that a partial row (a run
that died mid-write, or an older row) still reads; a field an older version wrote under
another name (`RENAMED`) is read under its new one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, model_validator

if TYPE_CHECKING:
    from areal_hex.config import ExperimentConfig


# A service's log line saying what it is doing before it has any metric to show
# (`[status] loading the model`); the launcher's progress display reads the last one.
STATUS_MARK = "[status] "


@dataclass(frozen=True)
class RunPaths:
    root: Path
    weights_dir: Path
    checkpoint_dir: Path

    @classmethod
    def at(
        cls, root: str | Path, weights_dir: str | None = None, checkpoint_dir: str | None = None
    ) -> RunPaths:
        r = Path(root)
        return cls(
            r,
            Path(weights_dir) if weights_dir else r / "weights",
            Path(checkpoint_dir) if checkpoint_dir else r / "checkpoints",
        )

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> RunPaths:
        """The run directory of a config whose `run.run_id` is set."""
        return cls.at(cfg.run.run_dir(), cfg.inference.weights_dir, cfg.trainer.checkpoint_dir)

    @property
    def lock(self) -> Path:
        return self.root / "launch.lock"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def rollout(self) -> Path:
        return self.root / "rollout.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events.json"

    @property
    def prediction(self) -> Path:
        return self.root / "prediction.json"

    @property
    def placement_choice(self) -> Path:
        return self.root / "placement.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def committed(self) -> Path:
        return self.root / "committed.jsonl"

    def attempt(self, n: int) -> Path:
        return self.root / "attempts" / str(n)

    def attempts(self) -> list[int]:
        """Numbers of the attempts recorded so far, in order."""
        root = self.root / "attempts"
        return sorted(int(p.name) for p in root.glob("*") if p.name.isdigit())

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, service: str) -> Path:
        return self.logs / f"{service}.log"

    @property
    def valkey(self) -> Path:
        return self.root / "valkey"

    def version_dir(self, version: int) -> Path:
        return version_dir(self.weights_dir, version)

    def versions_on_disk(self) -> list[int]:
        return versions_in(self.weights_dir)


def remove_stale_tmp(weights_dir: str | Path) -> list[Path]:
    """Remove the `.v<N>.tmp-<pid>` folders of publications whose writer is gone (a
    process killed mid-write leaves one; a live writer's is kept). Returns those removed."""
    import os
    import shutil

    removed = []
    for p in sorted(Path(weights_dir).glob(".v*.tmp-*")):
        pid = p.name.rsplit("-", 1)[1]
        if pid.isdigit() and Path(f"/proc/{pid}").exists() and int(pid) != os.getpid():
            continue  # still being written
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def version_dir(weights_dir: str | Path, version: int) -> Path:
    """The one rule for where version N's weights live: `<weights_dir>/v<N>`."""
    return Path(weights_dir) / f"v{int(version)}"


def versions_in(weights_dir: str | Path, complete_only: bool = False) -> list[int]:
    """Versions with a `v<N>` directory (with `complete_only`, holding a config.json)."""
    root = Path(weights_dir)
    return sorted(
        int(p.name[1:])
        for p in root.glob("v*")
        if p.name[1:].isdigit()
        and p.is_dir()
        and (not complete_only or (p / "config.json").is_file())
    )


# ---------------------------------------------------------------- metric rows
class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # old field name -> new, for rows an older version wrote (docs/observability.md)
    RENAMED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _read_old_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.RENAMED.keys() & data.keys():
            return {cls.RENAMED.get(k, k): v for k, v in data.items()}
        return data

    def to_line(self) -> str:
        return self.model_dump_json() + "\n"


class TrainerRow(_Row):
    """One optimizer step (metrics.jsonl)."""

    RENAMED: ClassVar[dict[str, str]] = {
        "dropped_stale_total": "groups_dropped_stale_total",
        "staleness_hist": "version_lag_hist",
    }

    step: int = 0
    version: int = 0
    time: float = 0.0
    loss: float = 0.0
    reward_mean: float | None = None
    adv_mean: float = 0.0
    adv_std: float = 0.0
    clip_frac: float = 0.0
    dual_clip_frac: float = 0.0
    behav_weight_mean: float = 0.0
    behav_weight_max: float = 0.0
    behav_masked_frac: float = 0.0
    entropy: float = 0.0
    kl: float = 0.0
    grad_norm: float | None = None  # None when the engine does not report it
    lr: float = 0.0
    version_lag_hist: dict[str, int] = {}  # versions behind -> groups in this batch
    # train-inference mismatch on tokens of the trained version: {"server"|"gpu_kind":
    # {name: {"abs_dlogp": mean |dlog p|, "k3": mean KL(infer || train), "tokens": n}}}
    mismatch: dict[str, dict[str, dict[str, float]]] = {}
    # pi_prox against pi_behav by the tokens' version lag (the behaviour weights' spread):
    # {lag: {"abs_dlogp": mean |log w|, "k3": mean KL(behav || prox), "tokens": n}}
    drift_by_lag: dict[str, dict[str, float]] = {}
    max_version_lag: int = 0  # the largest version lag of a group in this batch
    degenerate_groups: int = 0
    sequences: int = 0
    completion_tokens: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    wait_s: float = 0.0  # waiting for the batch
    compute_s: float = 0.0  # log-prob recompute + optimizer step
    # rank 0's tokens per second of its own passes, without its waits for other ranks
    # (with several ranks, tokens_per_s over own_tokens_per_s shows how long it waited)
    own_tokens_per_s: float = 0.0
    publish_s: float = 0.0
    publish_wait_s: float = 0.0  # waiting for the previous weight write
    # after that wait, to this step's weight write handed on (the optimizer update, the
    # state dict): the step's part that follows a send and so adds to its cycle; None in a
    # step that did not wait on a write (no publisher, or the critic's warm-up)
    after_fence_s: float | None = None
    # the last weight write finished before this step's update: from its start to its end
    # (over the network: the announcement, the servers' pause and every bucket sent)
    write_s: float | None = None
    write_delay_s: float | None = None  # from that write's hand-on to its start on its thread
    checkpoint_s: float = 0.0
    # the critic (algo.advantage gae; None without one): mean value loss, fraction of
    # tokens whose value was clipped, mean value and return at the step start, and the
    # explained variance 1 - Var(R - V) / Var(R) of those values
    value_loss: float | None = None
    value_clip_frac: float | None = None
    value_mean: float | None = None
    return_mean: float | None = None
    explained_var: float | None = None
    # running totals since the run began (restored from checkpoints)
    groups_trained_total: int = 0
    groups_dropped_stale_total: int = 0
    dead_letter_total: int = 0
    degenerate_groups_total: int = 0
    tokens_total: int = 0


class RolloutRow(_Row):
    """One metrics interval of the controller (rollout.jsonl); rates over the interval."""

    RENAMED: ClassVar[dict[str, str]] = {
        "weight_updates_total": "weight_syncs_total",
        "weight_update_s_total": "weight_sync_s_total",
    }

    time: float = 0.0
    elapsed_s: float = 0.0
    version: int = 0
    groups_produced_total: int = 0
    groups_filtered_total: int = 0  # dynamic sampling: all-equal rewards, never buffered
    groups_in_flight: int = 0
    groups_failed_total: int = 0
    groups_abandoned_total: int = 0
    samples_total: int = 0
    samples_per_s: float = 0.0
    tokens_total: int = 0
    tokens_per_s: float = 0.0
    reward_mean: float | None = None
    reward_mean_total: float | None = None
    reward_failures_total: int = 0
    reward_timeouts_total: int = 0
    reward_cached_total: int = 0  # answers scored without a worker call (rewards.py)
    requests_total: int = 0
    requests_retried_total: int = 0
    requests_aborted_total: int = 0
    weight_syncs_total: int = 0
    weight_sync_s_total: float = 0.0
    gen_busy_s: float = 0.0  # seconds any server had work, since start
    # colocated: memory releases and resumes of the servers (one switch: both), and the
    # seconds they took, since start
    context_switches_total: int = 0
    context_switch_s_total: float = 0.0
    # hybrid: weight loads the lent servers made as they continued, tokens they generated
    lent_loads_total: int = 0
    lent_tokens_total: int = 0
    servers_healthy: int = 0
    finish_reasons: dict[str, int] = {}
    # the last line of a controller's run only
    final: bool = False
    admissions_released_total: int = 0


R = TypeVar("R", bound=_Row)


def iter_rows(path: Path, row: type[R]) -> Iterator[R]:
    """The complete rows of a JSONL file (a torn last line, being written, is skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        yield row.model_validate(data)


def read_rows(path: Path, row: type[R]) -> list[R]:
    return list(iter_rows(path, row))


class RowTail(Generic[R]):
    """The complete rows appended to a JSONL file since the last `read()` (a line still
    being written waits for the next call)."""

    def __init__(self, path: Path, row: type[R]) -> None:
        self.path, self.row = path, row
        self.offset = 0
        self.partial = b""

    def read(self) -> list[R]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            if line.strip():
                try:
                    out.append(self.row.model_validate(json.loads(line)))
                except json.JSONDecodeError:
                    continue
        return out


def append_row(path: Path, row: _Row) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(row.to_line())
