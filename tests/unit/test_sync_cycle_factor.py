"""A kind's `sync_cycle_factor` is its timed synchronous cycle over the replay's of the
same cycle; `sync_cycle` times it with the update from disk (its controller has no
network source), so the replay it is divided by prices that update too, whatever the
run's `weight_sync`. The data is one box kind's profile (0.2 of a core; the trainer's
network send there took 0.081 s, the reload from disk 0.010 s)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from hexctl.job.predict import LocalProfileFiles
from hexctl.profile.controller import cycle_s_replayed, replayed_cycle_s
from scheduler.profile import Profile, load_profile
from scheduler.workload import load_workload

DATA = Path(__file__).resolve().parents[1] / "data" / "box_kind_profile"


def _files(tmp_path: Path, weight_sync: str) -> LocalProfileFiles:
    out = tmp_path / weight_sync
    shutil.copytree(DATA, out)
    w = yaml.safe_load((out / "workload.yaml").read_text())
    w["weight_sync"] = weight_sync
    (out / "workload.yaml").write_text(yaml.safe_dump(w))
    return LocalProfileFiles(out)


def _unfactored(files: LocalProfileFiles) -> Profile:
    prof = load_profile(files.profile)
    for rates in prof.kinds.values():
        rates.sync_cycle_factor = None  # as when the factor is computed
    return prof


def test_the_replay_prices_the_reload_the_cycle_made(tmp_path: Path) -> None:
    net, disk = _files(tmp_path, "network"), _files(tmp_path, "disk")
    over_network = replayed_cycle_s(net, _unfactored(net))
    # a network run's factor is divided by the same replay as a disk run's
    assert over_network == pytest.approx(replayed_cycle_s(disk, _unfactored(disk)), rel=1e-9)
    # and not by the one with the network update in it: that charged the trainer's
    # 0.081-s send where the cycle reloaded in 0.010 s
    with_network = cycle_s_replayed(net, _unfactored(net), load_workload(net.workload))
    assert with_network - over_network == pytest.approx(0.081 - 0.010, abs=0.01)
