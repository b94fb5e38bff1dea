"""Health probes for containers, with only the standard library (every image has Python,
not every image has curl).

    python -m hexctl.runtime.probe http http://127.0.0.1:30000/health
    python -m hexctl.runtime.probe fresh /data/runs/r1/rollout.jsonl 600
    python -m hexctl.runtime.probe wait /data/runs/r1/weights/v0/config.json 7200
    python -m hexctl.runtime.probe newest /data/runs metrics.jsonl 1800
    python -m hexctl.runtime.probe alive /data/runs/r1/metrics.jsonl 1800

`http` passes on a 2xx answer; `fresh` passes while the file was modified within the last
N seconds, or does not exist yet (a service that has not written its first line is
starting, not stuck); `wait` blocks until the file exists (init containers: start after
the initial weights are written); `newest` applies `fresh` to the most recently written
`<DIR>/<run>/<NAME>` (image HEALTHCHECKs, which do not know the run id); `alive` passes
while the file was modified, or the container's first process started, within the last
N seconds (a liveness heartbeat: a file left by an earlier attempt does not fail a
restarted one before its first step). Exit 0 = healthy, 1 = not.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from areal_hex.net import wait_until


def http_ok(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (local URL)
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def file_fresh(path: Path, max_age_s: float, now: float | None = None) -> bool:
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return True
    return (now if now is not None else time.time()) - mtime <= max_age_s


def newest_fresh(runs: Path, name: str, max_age_s: float, now: float | None = None) -> bool:
    """`file_fresh` on the newest `runs/*/name`; True while no run has written one."""
    found = [p for p in runs.glob(f"*/{name}") if p.is_file()]
    if not found:
        return True
    return file_fresh(max(found, key=lambda p: p.stat().st_mtime), max_age_s, now)


def process_age_s(pid: int = 1) -> float:
    """Seconds since process `pid` started (the container's first process: PID 1)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start, ticks after boot
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - started


def alive(path: Path, max_age_s: float, now: float | None = None, pid: int = 1) -> bool:
    """The heartbeat `path` was written, or the container started, within `max_age_s`."""
    if process_age_s(pid) <= max_age_s:
        return True
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return False
    return (now if now is not None else time.time()) - mtime <= max_age_s


def wait_for_file(path: Path, timeout_s: float, poll_s: float = 2.0) -> bool:
    return wait_until(path.exists, timeout_s, interval_s=poll_s)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 2 and args[0] == "http":
        return 0 if http_ok(args[1]) else 1
    if len(args) == 3 and args[0] == "fresh":
        return 0 if file_fresh(Path(args[1]), float(args[2])) else 1
    if len(args) == 3 and args[0] == "alive":
        return 0 if alive(Path(args[1]), float(args[2])) else 1
    if len(args) == 4 and args[0] == "newest":
        return 0 if newest_fresh(Path(args[1]), args[2], float(args[3])) else 1
    if len(args) == 3 and args[0] == "wait":
        return 0 if wait_for_file(Path(args[1]), float(args[2])) else 1
    usage = (
        "http URL | fresh PATH MAX_AGE_S | alive PATH MAX_AGE_S | wait PATH TIMEOUT_S | "
        "newest DIR NAME MAX_AGE_S"
    )
    print(f"usage: probe {usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
