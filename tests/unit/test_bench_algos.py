"""`areal-hex bench algos`: the grid of runs it makes (the runs themselves are measured
in docs/running.md)."""

from __future__ import annotations

from areal_hex.config import load_config
from hexctl.bench.system.algos import variants


def test_grid_is_eta_by_objective_plus_gspo() -> None:
    grid = variants([0, 1, 2, 4, 8], gspo_eta=4)
    assert [(n, e) for n, e, _ in grid[:4]] == [
        ("naive", 0), ("decoupled", 0), ("naive", 1), ("decoupled", 1)
    ]  # fmt: skip
    assert len(grid) == 11 and grid[-1][:2] == ("gspo", 4)
    assert variants([2], gspo_eta=-1) == [
        ("naive", 2, ["algo.decoupled=false"]),
        ("decoupled", 2, ["algo.decoupled=true"]),
    ]
    # every variant's overrides make a valid config
    for _, eta, algo in grid:
        cfg = load_config(None, [*algo, f"buffer.max_staleness={eta}"])
        assert cfg.algo.decoupled == ("algo.decoupled=true" in algo)
    assert load_config(None, grid[-1][2]).algo.objective == "gspo"
