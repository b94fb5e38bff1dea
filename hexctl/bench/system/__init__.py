"""Benchmarks of the whole system: each runs the job as `areal-hex run` does (services,
launcher, a plan, a box) and holds it against a baseline run in the same invocation."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hexctl.bench import BenchFailed

# the benchmarks' job when no --config is given: the README's tiny CPU run
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[3] / "examples" / "tiny_cpu.yaml")


def check_run(result: Any, what: str) -> None:
    """Raise for a run (`launch.run.execute`'s result) that did not finish: an interrupted
    one (Ctrl-C, SIGTERM) as KeyboardInterrupt, so the benchmark's own clean-up runs and
    it ends as interrupted; a failed one as BenchFailed, naming `what`."""
    from hexctl.launch.run import failure_message

    if result.outcome.status == "interrupted":
        raise KeyboardInterrupt
    if not result.ok:
        raise BenchFailed(f"{what} failed: {failure_message(result)}")


@contextlib.contextmanager
def scratch_dir(prefix: str, given: str | Path | None = None) -> Iterator[str]:
    """The directory for a benchmark's runs: `given` (its `--output-dir`), left as it is;
    else a new one, removed when the benchmark ends, except when it ends in BenchFailed,
    whose message names the failed run's log in it (the directory is then kept, and the
    message says where)."""
    if given:
        yield str(given)
        return
    path = tempfile.mkdtemp(prefix=prefix)
    keep = False
    try:
        yield path
    except BenchFailed as exc:
        keep = True
        raise BenchFailed(f"{exc}\n(the runs are kept in {path})") from None
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
