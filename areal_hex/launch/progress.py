"""Live progress of a run from its metrics files: one refreshing line on a terminal,
plain log lines otherwise."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All complete JSON lines of `path` (a line being written is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class JsonlTail:
    """Reads only what was appended since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.last: dict[str, Any] | None = None

    def poll(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with self.path.open() as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind("\n") + 1  # keep a partial last line for the next call
        self.offset += len(chunk[:end].encode())
        rows = [json.loads(x) for x in chunk[:end].splitlines() if x.strip()]
        if rows:
            self.last = rows[-1]
        return rows


class Progress:
    def __init__(
        self, run_dir: Path, total_steps: int, mode: str = "auto", out: TextIO | None = None
    ) -> None:
        self.out = out or sys.stderr
        self.live = mode == "live" or (mode == "auto" and self.out.isatty())
        self.total = total_steps
        self.trainer = JsonlTail(run_dir / "metrics.jsonl")
        self.rollout = JsonlTail(run_dir / "rollout.jsonl")
        self.t0 = time.time()
        self.max_staleness = 0
        self._last_step = -1

    def update(self) -> None:
        for row in self.trainer.poll():
            self.max_staleness = max(self.max_staleness, int(row.get("max_staleness", 0)))
        self.rollout.poll()
        line = self.line()
        step = (self.trainer.last or {}).get("step", 0)
        if self.live:
            self.out.write("\r\x1b[2K" + line)
            self.out.flush()
        elif step != self._last_step:
            self.out.write(line + "\n")
            self.out.flush()
        self._last_step = step

    def line(self) -> str:
        t = self.trainer.last or {}
        r = self.rollout.last or {}
        step = int(t.get("step", 0))
        elapsed = time.time() - self.t0
        eta = elapsed / step * (self.total - step) if step else float("nan")
        return (
            f"step {step}/{self.total}  v{t.get('version', 0)}  "
            f"reward {t.get('reward_mean', float('nan')):.3f}  "
            f"staleness max {self.max_staleness}  "
            f"samples/s {r.get('samples_per_s', 0.0):.1f}  "
            f"groups {r.get('groups_produced_total', 0)}  "
            f"elapsed {elapsed:.0f}s  ETA {eta:.0f}s"
        )

    def close(self) -> None:
        if self.live:
            self.out.write("\n")
            self.out.flush()
