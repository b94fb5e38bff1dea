"""A box kind's rates at the mean of two sittings (`hexctl/box/second_sitting.py`): the
first sitting's files (one box kind's profile: 0.2 of a core) and a second sitting's
figures give the geometric mean of both in the profile and the inventory, and both
sittings stay readable in `measured.json`. And a box kind's synchronous cycle is not
stretched by its `sync_cycle_factor`, where a kind of the host's own cores still is."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from hexctl.box.second_sitting import Sitting, combine, mean_factor
from hexctl.job.predict import LocalProfileFiles
from scheduler.profile import BOX_DEVICE, load_profile, save_profile

DATA = Path(__file__).resolve().parents[1] / "data" / "box_kind_profile"


def _first_sitting(tmp_path: Path) -> LocalProfileFiles:
    shutil.copytree(DATA, tmp_path / "k0")
    files = LocalProfileFiles(tmp_path / "k0")
    prof = load_profile(files.profile)
    measured = {
        "generation": {"continuous_samples_per_s": 263.0, "prompt_tokens": 34.0},
        "train_tokens_per_s": prof.kinds["CPU"].train_tokens_per_s,
        "train_sync_tokens_per_s": prof.kinds["CPU"].train_sync_tokens_per_s,
        "node_speed": {"node": "k0-0", "samples": [345.3, 335.1]},
    }
    files.measured.write_text(json.dumps(measured))
    return files


def test_the_rates_are_the_geometric_mean_of_both_sittings(tmp_path: Path) -> None:
    files = _first_sitting(tmp_path)
    before = load_profile(files.profile).kinds["CPU"]
    tflops = yaml.safe_load(files.cluster.read_text())["gpu_overrides"]["CPU"]["bf16_tflops"]
    # generation's median round 300 against 263; training a quarter faster; quiet the same
    again = Sitting([250.0, 300.0, 330.0], before.train_tokens_per_s * 1.25,
                    before.train_sync_tokens_per_s)  # fmt: skip
    factors = combine(files, again)
    assert factors["generation"] == pytest.approx(math.sqrt(300.0 / 263.0))
    assert factors["train"] == pytest.approx(math.sqrt(1.25))
    assert factors["train_quiet"] == pytest.approx(1.0)
    after = load_profile(files.profile).kinds["CPU"]
    # the continuous rate is priced through the efficiency: 263 -> sqrt(263 * 300)
    assert after.generation_efficiency * 263.0 / before.generation_efficiency == pytest.approx(
        math.sqrt(263.0 * 300.0)
    )
    assert after.train_tokens_per_s == pytest.approx(before.train_tokens_per_s * math.sqrt(1.25))
    # the trimmed rate is the plain one over a ratio: it moves with it
    assert after.train_trim_tokens_per_s / after.train_tokens_per_s == pytest.approx(
        before.train_trim_tokens_per_s / before.train_tokens_per_s
    )
    assert after.train_sync_tokens_per_s == pytest.approx(before.train_sync_tokens_per_s)
    # what the first sitting did not move stays
    assert after.decode_step_s == before.decode_step_s
    assert after.reload_overlap_s == before.reload_overlap_s
    over = yaml.safe_load(files.cluster.read_text())["gpu_overrides"]["CPU"]
    assert over["bf16_tflops"] == pytest.approx(tflops * math.sqrt(1.25), rel=1e-4)
    kept = json.loads(files.measured.read_text())
    assert kept["generation"]["continuous_samples_per_s"] == 263.0  # the first sitting's
    assert kept["second_sitting"]["continuous_samples_per_s"] == 300.0
    assert kept["second_sitting"]["continuous_rounds_samples_per_s"] == [250.0, 300.0, 330.0]
    assert kept["second_sitting"]["factors"] == factors
    assert kept["node_speed"]["samples"] == [345.3, 335.1]


def test_a_figure_one_sitting_lacks_is_left_as_the_other_has_it() -> None:
    assert mean_factor(100.0, None) == 1.0
    assert mean_factor(None, 100.0) == 1.0
    assert mean_factor(0.0, 100.0) == 1.0
    assert mean_factor(100.0, 400.0) == pytest.approx(2.0)


def test_a_box_kinds_cycle_factor_is_a_reading_not_a_price(tmp_path: Path) -> None:
    """The same profile with its factor at 1.5: a kind of the host's cores stretches its
    synchronous cycle by it; a box kind (`device: box`) does not."""
    from scheduler.profile import load_profile

    prof = load_profile(DATA / "profile.yaml")
    prof.kinds["CPU"].sync_cycle_factor = 1.5
    assert prof.sync_cycle_factor("CPU") == 1.5
    prof.kinds["CPU"].device = BOX_DEVICE
    assert prof.sync_cycle_factor("CPU") == 1.0
    assert prof.sync_cycle_factor("absent") == 1.0
    save_profile(prof, tmp_path / "profile.yaml")  # and it is kept in the profile
    assert load_profile(tmp_path / "profile.yaml").kinds["CPU"].sync_cycle_factor == 1.5
