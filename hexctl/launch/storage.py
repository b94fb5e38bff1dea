"""Damaged storage, named at the start of an attempt (a `--resume` above all).

- Valkey's append-only file cut short (a crash of the machine, a copy that lost its
  tail): Valkey loads what is whole (`aof-load-truncated`) and logs where it cut; the
  writes after that point are gone. `aof_damage` reads that from Valkey's log of this
  start, so the launcher can say so; the groups that went with them are counted as lost
  by the ledger (`groups_lost` in summary.json), which the launcher points to.
  An append-only file damaged inside (not at its end) makes Valkey refuse to start;
  `aof_refused` finds that in the log, and the launcher exits 2 naming the file.
- A checkpoint whose weights version is gone from disk (`weights/v<N>` removed or left
  without its config.json): the trainer writes that version again from the checkpoint
  when it resumes from it; `weights_missing` names them so the launcher can say so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig
from areal_hex.errors import UsageError
from areal_hex.run_files import RunPaths

_START = "is starting"  # Valkey's banner line at each start
_TRUNCATED = re.compile(r"Truncating the AOF (\S+) at offset (\d+)")
_REFUSED = re.compile(
    r"(Bad file format reading the append only file.*|Unrecoverable error reading the "
    r"append only file.*|Unexpected end of file reading the append only file.*)"
)


class DamagedStorage(UsageError):
    """Storage of the run that cannot be resumed from as it is (exit 2, naming it)."""


def _this_start(valkey_dir: Path) -> str:
    try:
        text = (valkey_dir / "valkey.log").read_text(errors="replace")
    except OSError:
        return ""
    return text[text.rfind(_START) :] if _START in text else text


def aof_damage(valkey_dir: Path) -> str | None:
    """What Valkey cut from its append-only file at this start, or None."""
    found = _TRUNCATED.findall(_this_start(valkey_dir))
    if not found:
        return None
    cuts = ", ".join(
        f"{valkey_dir / 'appendonlydir' / name} at byte {offset}" for name, offset in found
    )
    return (
        f"Valkey's append-only file was cut short ({cuts}): it loaded what was whole and "
        "the writes after the cut are lost; the run resumes from what is consistent, and "
        "the ledger (groups_lost in summary.json) counts the groups lost with them"
    )


def aof_refused(valkey_dir: Path) -> DamagedStorage | None:
    """Valkey refused its append-only file at this start: the error naming it, or None."""
    found = _REFUSED.search(_this_start(valkey_dir))
    if found is None:
        return None
    return DamagedStorage(
        f"Valkey cannot load the append-only file in {valkey_dir / 'appendonlydir'} "
        f"({found.group(1).strip()}): it is damaged inside, not only at its end. Keep a "
        "copy, then cut it at the damage (`valkey-check-aof --fix`) to resume from what "
        "is before it, or start a new run"
    )


def weights_missing(checkpoint_dir: Path, weights_dir: Path) -> str | None:
    """`step<N> -> <weights_dir>/v<V>` when the newest complete checkpoint (the one a
    resume takes) refers to a weights version with no config.json on disk; older ones
    lose theirs to `trainer.keep_versions` as a matter of course."""

    def step_of(marker: Path) -> int:
        digits = marker.parent.name.removeprefix("step")
        return int(digits) if digits.isdigit() else -1

    markers = sorted(checkpoint_dir.glob("step*/COMPLETE"), key=step_of)
    if not markers or step_of(markers[-1]) < 0:
        return None
    try:
        version = int(json.loads(markers[-1].read_text()).get("version", -1))
    except (OSError, ValueError, json.JSONDecodeError):
        return None  # unreadable: the trainer's verification names it and sets it aside
    target = weights_dir / f"v{version}"
    if version > 0 and not (target / "config.json").is_file():
        return f"{markers[-1].parent.name} -> {target}"
    return None


def say_before_start(cfg: ExperimentConfig, say: Callable[[str], None]) -> None:
    """What the launcher finds on disk before any service starts."""
    paths = RunPaths.of(cfg)
    if cfg.rollout.weight_sync != "disk":
        return  # versions travel over the network: none but v0 is on disk
    gone = weights_missing(paths.checkpoint_dir, paths.weights_dir)
    if gone:
        say(
            f"the newest checkpoint's weights are gone from disk ({gone}: missing, or "
            "without config.json); the trainer writes them again from the checkpoint"
        )


def valkey_dir(cfg: ExperimentConfig) -> Path | None:
    """The embedded Valkey's data directory (None: an external Redis)."""
    return Path(cfg.redis.data_dir) if cfg.run.embedded_redis and cfg.redis.data_dir else None


def forget_weight_groups(client: Any, run_id: str) -> int:
    """Network weight sync, before any trainer or controller starts: the manifests left
    in the buffer name weight groups of trainers now gone, which a controller would
    have its servers join and wait in until the timeout; removed (the trainer leaves a
    new one for the version it resumes at). Returns how many."""
    keys = list(client.scan_iter(match=f"{run_id}:weights_manifest:*", count=1000))
    return int(client.delete(*keys)) if keys else 0
