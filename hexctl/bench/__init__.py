"""`areal-hex bench NAME --json`: one module per benchmark; each measures its baseline in
the same run and returns one JSON object. Two rooms:

- `hexctl.bench.system`: the whole system run as a user runs it (`run`, a plan, a box):
  e2e, algos, chaos, fidelity, hetero, trl, gpu, and host (the machine's own steadiness
  under such runs);
- `hexctl.bench.micro`: one service's internals against a bare baseline, with no
  launcher: buffer, controller, rollout, trainer, weight-sync, plan (the planner).
"""

from __future__ import annotations


class BenchFailed(RuntimeError):
    """A run or part the benchmark needs failed: `areal-hex bench` prints one JSON object
    with `error` (what failed, and where its log is) and exits 1, without a traceback."""
