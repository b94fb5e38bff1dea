"""`areal-hex bench NAME --json` prints the JSON object alone on stdout: what the bench
and the libraries it imports print there meanwhile goes to stderr."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import pytest

from hexctl.bench import BenchFailed
from hexctl.cli.bench_cmd import _runner


def _noisy(args: argparse.Namespace) -> dict[str, int]:
    # as DeepSpeed's logger does at import: a handler on the stdout of that moment
    log = logging.getLogger("test-bench-noisy")
    log.propagate = False
    handler = logging.StreamHandler(sys.stdout)
    log.addHandler(handler)
    try:
        log.warning("Setting accelerator to CPU")
        print("progress line")
    finally:
        log.removeHandler(handler)
    if args.fail:
        raise BenchFailed("the run failed")
    return {"ratio": 2}


@pytest.mark.parametrize("fail", [False, True])
def test_json_mode_keeps_stdout_to_the_object(
    capsys: pytest.CaptureFixture[str], fail: bool
) -> None:
    rc = _runner(_noisy)(argparse.Namespace(json=True, bench="noisy", fail=fail))
    out, err = capsys.readouterr()
    assert json.loads(out) == (
        {"bench": "noisy", "error": "the run failed"} if fail else {"ratio": 2}
    )
    assert rc == (1 if fail else 0)
    assert "Setting accelerator to CPU" in err and "progress line" in err


def test_without_json_the_bench_prints_as_it_goes(capsys: pytest.CaptureFixture[str]) -> None:
    assert _runner(_noisy)(argparse.Namespace(json=False, bench="noisy", fail=False)) == 0
    out, _ = capsys.readouterr()
    assert "progress line" in out and '"ratio": 2' in out
