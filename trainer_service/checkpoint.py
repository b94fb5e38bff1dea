"""Checkpoints: engine, optimizer, LR schedule, step, version, RNG, data position.

A checkpoint `step<N>/` counts only once its `COMPLETE` marker exists; the marker is
written last (after every rank's files, via temp file + rename), so a checkpoint cut
short by a crash is never resumed from. The marker also holds the trainer state,
including the entry ids whose updates the checkpoint contains, and a manifest (size and
SHA-256 of every file, computed from the files as written): a checkpoint damaged later
(a truncated shard) fails `verify` and is set aside by `choose_resume`, which then takes
the newest intact one.

Rank 0 also appends those ids to the run's `committed.jsonl` (one line per commit, kept
when old checkpoints are removed): the record of which groups the weights were trained
on, across every attempt, from which a group trained twice can be found. A resume from
an older checkpoint than the last recorded (the newer one was corrupt) appends a
`{"rollback_to": step}` line: the commits after that step no longer count.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"
MANIFEST_KEY = "manifest"  # in the marker: {relative path: [size, sha256]}
_STEP_DIR = re.compile(r"^step(\d+)$")


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files do not match its manifest (or whose marker is unreadable)."""


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def manifest(path: Path) -> dict[str, list[Any]]:
    """{relative path: [size, sha256]} of every file of a checkpoint but its marker."""
    out: dict[str, list[Any]] = {}
    for f in sorted(path.rglob("*")):
        if f.is_file() and f.name not in (MARKER, f".{MARKER}.tmp"):
            out[str(f.relative_to(path))] = [f.stat().st_size, _sha256(f)]
    return out


def verify(path: str | Path) -> dict[str, Any]:
    """The marker's trainer state, after checking every file against the manifest;
    raises CorruptCheckpoint saying what does not match. A marker without a manifest
    (written before manifests existed) is taken as it is."""
    p = Path(path)
    try:
        state = json.loads((p / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"{p}: unreadable {MARKER} marker ({exc})") from None
    for rel, (size, digest) in state.get(MANIFEST_KEY, {}).items():
        f = p / rel
        if not f.is_file():
            raise CorruptCheckpoint(f"{p}: {rel} is missing")
        if f.stat().st_size != size:
            raise CorruptCheckpoint(f"{p}: {rel} has {f.stat().st_size} bytes, {size} written")
        if _sha256(f) != digest:
            raise CorruptCheckpoint(f"{p}: {rel} does not match its checksum")
    return state


def set_aside(path: Path) -> Path:
    """Rename a corrupt checkpoint out of the way (`step<N>.corrupt`, numbered if taken),
    so that neither a resume nor the ledger takes it again, and it is kept to look at."""
    target = path.with_name(f"{path.name}.corrupt")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt{n}")
    path.rename(target)
    return target


def choose_resume(resume: str, root: str | Path, say: Any = print) -> Path | None:
    """`resolve_resume`, verified: with `auto`, a corrupt newest checkpoint is set aside
    (one line through `say` names it) and the next newest intact one is taken; an
    explicit checkpoint that is corrupt raises CorruptCheckpoint. Rank 0 only."""
    if resume != "auto":
        path = resolve_resume(resume, root)
        if path is not None:
            verify(path)
        return path
    for _, path in reversed(complete_checkpoints(root)):
        try:
            verify(path)
            return path
        except CorruptCheckpoint as exc:
            moved = set_aside(path)
            say(f"trainer: checkpoint {path} is corrupt ({exc}); set aside as {moved.name}")
    return None


def save(
    engine: Any,
    root: str | Path,
    step: int,
    state: dict[str, Any],
    keep: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Collective: every rank writes its shard and RNG; rank 0 then commits the marker.
    `extra` engines (e.g. the critic) are saved inside the checkpoint, each under its
    name, and covered by the same marker."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    tag = f"step{step}"
    path = Path(root) / tag
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # a stale incomplete attempt at the same step
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state={}, save_latest=False)
    for name, other in (extra or {}).items():
        other.save_checkpoint(str(path), tag=name, client_state={}, save_latest=False)
    torch.save(_rng_state(), path / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        # the checksums are taken from the files as written, so any later damage shows
        state = {**state, MANIFEST_KEY: manifest(path)}
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


def load(engine: Any, path: str | Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restore engine, optimizer and LR schedule from `path` (verified by rank 0 before),
    and those of the `extra` engines saved with it; returns the trainer state."""
    import torch
    import torch.distributed as dist

    p = Path(path)
    state = json.loads((p / MARKER).read_text())
    state.pop(MANIFEST_KEY, None)
    load_path, _ = engine.load_checkpoint(
        str(p.parent), tag=p.name, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {p}")
    for name, other in (extra or {}).items():
        if not (p / name).is_dir():
            raise RuntimeError(f"{p} holds no {name} (saved by a run without one)")
        got, _ = other.load_checkpoint(
            str(p), tag=name, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if got is None:
            raise RuntimeError(f"DeepSpeed could not load the {name} in {p}")
    rng = p / f"rng_rank{dist.get_rank()}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return state


def record_committed(log: Path, step: int, ids: list[str]) -> None:
    """Append `{"step", "ids"}` for a commit, unless that step is the last one recorded
    (a resume from the checkpoint written just before a crash records it once). Commits
    recorded after `step` are rolled back first (a resume from an older checkpoint)."""
    records = rollback(log, step)
    if records and records[-1]["step"] == step:
        return
    _append(log, {"step": int(step), "ids": list(ids)})


def rollback(log: Path, step: int) -> list[dict[str, Any]]:
    """The weights are back at `step`: when later commits are recorded, append
    `{"rollback_to": step}` so that they no longer count. Returns the commits that do."""
    records = read_committed(log)
    if records and records[-1]["step"] > step:
        _append(log, {"rollback_to": int(step)})
        records = [r for r in records if r["step"] <= step]
    return records


def _append(log: Path, record: dict[str, Any]) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_committed(log: Path) -> list[dict[str, Any]]:
    """The commits of `committed.jsonl` that count: the weights' lineage, with those
    undone by a later `rollback_to` left out (a torn last line is skipped)."""
    out: list[dict[str, Any]] = []
    for rec in _records(log):
        if "rollback_to" in rec:
            out = [r for r in out if r["step"] <= int(rec["rollback_to"])]
        elif "step" in rec:
            out.append(rec)
    return out


def _records(log: Path) -> list[dict[str, Any]]:
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
