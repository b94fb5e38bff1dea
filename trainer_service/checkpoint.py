"""Checkpoints: engine, optimizer, LR schedule, step, version, RNG, data position.

A checkpoint `step<N>/` counts only once its `COMPLETE` marker exists; the marker is
written last (after every rank's files, via temp file + rename), so a checkpoint cut
short by a crash is never resumed from. The marker also holds the trainer state,
including the entry ids whose updates the checkpoint contains (acked after the commit).

Rank 0 also appends those ids to the run's `committed.jsonl` (one line per commit, kept
when old checkpoints are removed): the record of which groups the weights were trained
on, across every attempt, from which a group trained twice can be found.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step(\d+)$")


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint under `root`, oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = []
    for p in r.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MARKER).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def resolve_resume(resume: str, root: str | Path) -> Path | None:
    """`auto`: newest complete checkpoint (or None); `none`: None; else that directory,
    which must be complete."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        return found[-1][1] if found else None
    p = Path(resume)
    if not (p / MARKER).is_file():
        raise ValueError(f"trainer.resume: {p} is not a complete checkpoint (no {MARKER})")
    return p


def save(engine: Any, root: str | Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Collective: every rank writes its shard and RNG; rank 0 then commits the marker."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    tag = f"step{step}"
    path = Path(root) / tag
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # a stale incomplete attempt at the same step
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state={}, save_latest=False)
    torch.save(_rng_state(), path / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        tmp = path / f".{MARKER}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(path / MARKER)
        _collect(root, keep)
    dist.barrier()
    return path


def _collect(root: str | Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints; drop incomplete ones older than them."""
    done = complete_checkpoints(root)
    if not done:
        return
    for _, p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    oldest_kept = done[-keep:][0][0]
    for p in Path(root).iterdir():
        m = _STEP_DIR.match(p.name)
        if m and int(m.group(1)) < oldest_kept and not (p / MARKER).is_file():
            shutil.rmtree(p, ignore_errors=True)


def load(engine: Any, path: str | Path) -> dict[str, Any]:
    """Restore engine, optimizer and LR schedule from `path`; returns the trainer state."""
    import torch
    import torch.distributed as dist

    p = Path(path)
    state = json.loads((p / MARKER).read_text())
    load_path, _ = engine.load_checkpoint(
        str(p.parent), tag=p.name, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {p}")
    rng = p / f"rng_rank{dist.get_rank()}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return state


def record_committed(log: Path, step: int, ids: list[str]) -> None:
    """Append `{"step", "ids"}` for a commit, unless that step is the last one recorded
    (a resume from the checkpoint written just before a crash records it once)."""
    records = read_committed(log)
    if records and records[-1]["step"] == step:
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(json.dumps({"step": int(step), "ids": list(ids)}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_committed(log: Path) -> list[dict[str, Any]]:
    """The commit records of `committed.jsonl` (a torn last line is skipped)."""
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
