"""Profiles kept across runs: `run.profile_first` measures a machine for a job once.

A local profile (`hexctl/profile/local.py`) depends on three things, and its cache key is
a hash of exactly those:

- the machine: CPU model, cores this process may use, memory, and the GPUs' names and
  count where the job runs on CUDA;
- the job's fields the measurement reads (of `profiled_job`: one profile for every
  placement and staleness of a job): the model (architecture, dtype, warm start),
  data, sampling, inference, buffer, algorithm and trainer settings, and the run's core
  pinning; not names, paths, ports, step counts or tracking, which change from run to
  run but not what is measured;
- the code that is timed and that times it: the sources of the packages involved.

Entries live under `$AREAL_HEX_CACHE_DIR/profiles/<key>` (default
`$XDG_CACHE_HOME/areal-hex`, else `~/.cache/areal-hex`), each with `key.json` (what the
key was made of, readable) and `seconds` (how long measuring took, to say so next time).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig
from hexctl.job.v0_cache import cache_root

# Fields that name, place or bound a run without changing what a profile measures.
_RUN_FIELDS = ("seed", "pin_cores", "host_cores")  # not mode: its staleness is in buffer
_RUN_WARM_START = ("warm_start_fraction", "warm_start_answer_fraction")
_SKIP = {
    "inference": {"base_port", "server_urls", "api_key", "weights_dir", "log_level"},
    "trainer": {
        "master_port",
        "metrics_port",
        "total_steps",
        "checkpoint_every",
        "keep_checkpoints",
        "checkpoint_dir",
        "resume",
        "replay_path",
        "keep_versions",
    },
    "rollout": {"metrics_port", "metrics_interval_s", "max_groups"},
    # η: the profile's controller runs at staleness of its own (`controller.py`)
    "buffer": {"consumer_name", "max_staleness"},
}
_SECTIONS = ("model", "data", "inference", "rollout", "buffer", "algo", "trainer")
# The packages whose code is timed (server, controller, trainer) or times it.
_CODE_ROOTS = ("areal_hex", "rollout_service", "trainer_service", "scheduler", "hexctl/profile")


def machine(cfg: ExperimentConfig) -> dict[str, Any]:
    """What about this machine the figures depend on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass  # not Linux: the platform's own name stays
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    out: dict[str, Any] = {
        "cpu": cpu,
        "cores": cores,
        "cpu_count": os.cpu_count(),
        "memory_gib": round(pages * page / 2**30),
    }
    if cfg.inference.device.startswith("cuda") or cfg.trainer.device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            out["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
    return out


def job_fields(cfg: ExperimentConfig) -> dict[str, Any]:
    """The config fields a profile reads (everything but names, paths, ports, lengths)."""
    data = cfg.model_dump(mode="json")
    out = {s: {k: v for k, v in data[s].items() if k not in _SKIP.get(s, ())} for s in _SECTIONS}
    out["run"] = {k: data["run"][k] for k in _RUN_FIELDS + _RUN_WARM_START}
    if cfg.workflow.task_with_role("reward_model") is not None:  # its /classify is timed
        out["reward_model_task"] = True
    # The initial model: a path is named by its files (v0 of each run is a new directory
    # holding the same weights when the rest of the config is the same).
    out["model"].pop("path", None)
    out["model"].pop("tokenizer_path", None)
    if cfg.model.path is not None and cfg.model.tiny is None:
        out["model"]["weights"] = _tree_digest(Path(cfg.model.path))
    return out


def code_version() -> str:
    """A digest of the sources of the code a profile times and the code that times it."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for sub in _CODE_ROOTS:
        for path in sorted((root / sub).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(path)}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def profiled_job(cfg: ExperimentConfig) -> ExperimentConfig:
    """The job a profile for `cfg` measures: the disaggregated split with its servers of
    their own, whatever `cfg`'s placement and staleness. One profile prices every mode:
    the split's rates the disaggregated and hybrid runs (a lent server priced as one of
    its own on the trainer's cores), the rates on every core it also takes
    (`every_core.py`) the colocated run."""
    if cfg.workflow.placement == "disaggregated":
        return cfg
    job = cfg.model_copy(deep=True)
    if cfg.workflow.placement == "hybrid":
        job.inference.num_servers -= cfg.workflow.lent_servers
    job.workflow.placement = "disaggregated"
    return job


def key_of(cfg: ExperimentConfig) -> tuple[str, dict[str, Any]]:
    """The cache key of `cfg`'s profile (that of `profiled_job(cfg)`), and its parts."""
    job = profiled_job(cfg)
    parts = {"machine": machine(job), "job": job_fields(job), "code": code_version()}
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:24], parts


def lookup(key: str) -> Path | None:
    """The cached profile directory for `key`, if one was stored whole."""
    entry = cache_root() / "profiles" / key
    return entry if (entry / "seconds").is_file() else None


def store(key: str, parts: dict[str, Any], profile_dir: Path, seconds: float) -> Path | None:
    """Copy a finished profile into the cache (atomically: a rename); None if the cache
    directory cannot be written (the run goes on without it)."""
    base = cache_root() / "profiles"
    try:
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=base))
        shutil.copytree(profile_dir, tmp, dirs_exist_ok=True)
        (tmp / "key.json").write_text(json.dumps(parts, indent=2, sort_keys=True))
        (tmp / "seconds").write_text(f"{seconds:.1f}\n")
        try:
            tmp.rename(base / key)
        except OSError:  # stored meanwhile by another run: keep that one
            shutil.rmtree(tmp, ignore_errors=True)
        return base / key
    except OSError:
        return None


def last_seconds(parts: dict[str, Any]) -> float | None:
    """How long the latest profile of this machine took (any job), to say what to expect."""
    base = cache_root() / "profiles"
    best: tuple[float, float] | None = None
    for entry in base.glob("*/key.json") if base.is_dir() else []:
        try:
            same = json.loads(entry.read_text()).get("machine") == parts["machine"]
            secs = float((entry.parent / "seconds").read_text())
        except (OSError, ValueError):
            continue
        if same and (best is None or entry.stat().st_mtime > best[0]):
            best = (entry.stat().st_mtime, secs)
    return None if best is None else best[1]


def restore(entry: Path, out: Path) -> None:
    """The cached profile's files into `out` (a run's profile directory)."""
    shutil.copytree(entry, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("seconds"))


def refresh(entry: Path, out: Path, name: str) -> None:
    """The cache entry's file `name` replaced by the run's (atomically: a rename); left as
    it was if the cache cannot be written."""
    tmp = entry / f".{name}.tmp"
    try:
        shutil.copy(out / name, tmp)
        os.replace(tmp, entry / name)
    except OSError:
        tmp.unlink(missing_ok=True)
