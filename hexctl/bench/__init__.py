"""`areal-hex bench NAME --json`: one module per benchmark; each measures its baseline in
the same run and returns one JSON object."""

from __future__ import annotations

from typing import Any


class BenchFailed(RuntimeError):
    """A run or part the benchmark needs failed: `areal-hex bench` prints one JSON object
    with `error` (what failed, and where its log is) and exits 1, without a traceback."""


def check_run(result: Any, what: str) -> None:
    """Raise for a run (`launch.run.execute`'s result) that did not finish: an interrupted
    one (Ctrl-C, SIGTERM) as KeyboardInterrupt, so the benchmark's own clean-up runs and
    it ends as interrupted; a failed one as BenchFailed, naming `what`."""
    from hexctl.launch.run import failure_message

    if result.outcome.status == "interrupted":
        raise KeyboardInterrupt
    if not result.ok:
        raise BenchFailed(f"{what} failed: {failure_message(result)}")
