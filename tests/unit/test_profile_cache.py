"""The profile cache: keyed by machine, the job fields a profile reads, and the code."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from areal_hex.config import ExperimentConfig
from hexctl.launch import first_profile as launch_run
from hexctl.profile import cache


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_HEX_CACHE_DIR", str(tmp_path / "cache"))


def _cfg(**sections: dict) -> ExperimentConfig:
    return ExperimentConfig(**sections)


def test_key_ignores_names_ports_and_lengths_but_not_what_is_measured() -> None:
    base, _ = cache.key_of(_cfg())
    same = _cfg(
        run={"run_id": "other", "output_dir": "/elsewhere"},
        inference={"base_port": 40123},
        trainer={"total_steps": 7, "checkpoint_every": 3},
    )
    assert cache.key_of(same)[0] == base
    for changed in (
        _cfg(rollout={"group_size": 6}),
        _cfg(inference={"max_running_requests": 8}),
        _cfg(buffer={"groups_per_step": 2}),
        _cfg(run={"pin_cores": True}),
    ):
        assert cache.key_of(changed)[0] != base


def test_key_follows_the_machine_and_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    base, _ = cache.key_of(_cfg())
    real = cache.machine
    monkeypatch.setattr(cache, "machine", lambda cfg: {**real(cfg), "cores": 999})
    assert cache.key_of(_cfg())[0] != base
    monkeypatch.setattr(cache, "machine", real)
    monkeypatch.setattr(cache, "code_version", lambda: "changed")
    assert cache.key_of(_cfg())[0] != base


def _fake_profile(calls: list[Path]):  # type: ignore[no-untyped-def]
    def profile_local(cfg: ExperimentConfig, out: Path, say=None, **_: bool) -> None:  # noqa: ANN001
        calls.append(out)
        out.mkdir(parents=True)
        (out / "profile.yaml").write_text("measured: 1\n")
        if say is not None:
            say("a stage")

    return profile_local


def test_profile_first_measures_once_then_reuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hexctl.profile.local as local

    calls: list[Path] = []
    monkeypatch.setattr(local, "profile_local", _fake_profile(calls))
    cfg = _cfg()
    first, log1 = io.StringIO(), io.StringIO()
    out1, failed = launch_run.profile_first(cfg, tmp_path / "run1", first)
    assert failed is None and len(calls) == 1
    text = first.getvalue()
    assert "several minutes" in text and "a stage" in text and "profiled in" in text

    out2, failed = launch_run.profile_first(cfg, tmp_path / "run2", log1)
    assert failed is None and len(calls) == 1  # not measured again
    assert (out2 / "profile.yaml").read_text() == "measured: 1\n"
    assert "reusing" in log1.getvalue()

    other = _cfg(rollout={"group_size": 6})
    log2 = io.StringIO()
    launch_run.profile_first(other, tmp_path / "run3", log2)
    assert len(calls) == 2  # another job: measured, and the last duration is said
    assert "the last one here took" in log2.getvalue()


def test_an_unwritable_cache_leaves_the_run_its_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hexctl.profile.local as local

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("AREAL_HEX_CACHE_DIR", str(blocker))
    calls: list[Path] = []
    monkeypatch.setattr(local, "profile_local", _fake_profile(calls))
    out, failed = launch_run.profile_first(_cfg(), tmp_path / "run", io.StringIO())
    assert failed is None and out is not None and (out / "profile.yaml").is_file()


def test_cached_uses_a_kept_profile_and_never_takes_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run.profile_first: cached` (the README's example): no profile kept, the run starts
    at once without a prediction and says how to get one; once one is kept, it is used."""
    import hexctl.profile.local as local

    calls: list[Path] = []
    monkeypatch.setattr(local, "profile_local", _fake_profile(calls))
    log = io.StringIO()
    out, failed = launch_run.profile_first(
        _cfg(run={"profile_first": "cached"}), tmp_path / "r1", log
    )
    assert out is None and calls == []
    assert failed is not None and "run.profile_first=true" in failed["unavailable"]
    assert "no prediction" in log.getvalue() and "run.profile_first=true" in log.getvalue()

    launch_run.profile_first(_cfg(run={"profile_first": True}), tmp_path / "r2", io.StringIO())
    assert len(calls) == 1
    log = io.StringIO()
    out, failed = launch_run.profile_first(
        _cfg(run={"profile_first": "cached"}), tmp_path / "r3", log
    )
    assert failed is None and out is not None and len(calls) == 1
    assert (out / "profile.yaml").read_text() == "measured: 1\n" and "reusing" in log.getvalue()


def test_every_mode_of_a_job_shares_one_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The five modes of `bench modes` (placement x staleness, a hybrid with its lent
    servers on top) key one profile, of the disaggregated split; another server count of
    its own is another job. A colocated run has the rates on every core timed into it."""
    import hexctl.profile.every_core as every_core
    import hexctl.profile.local as local
    from areal_hex.config import load_config

    tiny = Path(__file__).resolve().parents[2] / "examples/tiny_cpu.yaml"
    modes = [
        [],
        ["run.mode=sync"],
        ["workflow.placement=colocated", "run.mode=sync"],
        ["workflow.placement=hybrid", "inference.num_servers=2"],
        ["workflow.placement=hybrid", "inference.num_servers=2", "run.mode=sync"],
    ]
    cfgs = [load_config(tiny, [*m, "run.profile_first=true"]) for m in modes]
    assert len({cache.key_of(c)[0] for c in cfgs}) == 1
    other = load_config(tiny, ["inference.num_servers=2"])
    assert cache.key_of(other)[0] != cache.key_of(cfgs[0])[0]
    seen: list[tuple[ExperimentConfig, bool]] = []
    added: list[ExperimentConfig] = []

    def profile_local(cfg: ExperimentConfig, out: Path, say=None, every_core=False) -> None:  # noqa: ANN001
        seen.append((cfg, every_core))
        out.mkdir(parents=True)
        (out / "profile.yaml").write_text("measured: 1\n")

    def add_every_core(cfg: ExperimentConfig, out: Path, say=None) -> None:  # noqa: ANN001
        added.append(cfg)
        (out / "profile.yaml").write_text("measured: 2\n")

    def lacks(cfg: ExperimentConfig, out: Path) -> bool:
        return "2" not in (out / "profile.yaml").read_text()

    monkeypatch.setattr(local, "profile_local", profile_local)
    monkeypatch.setattr(every_core, "add_every_core", add_every_core)
    monkeypatch.setattr(every_core, "lacks_every_core", lacks)
    launch_run.profile_first(cfgs[3], tmp_path / "hybrid", io.StringIO())
    assert [(c.workflow.placement, c.inference.num_servers, e) for c, e in seen] == [
        ("disaggregated", 1, False)
    ]
    for i, cfg in enumerate(cfgs[:2] + cfgs[3:]):
        out, failed = launch_run.profile_first(cfg, tmp_path / f"run{i}", io.StringIO())
        assert failed is None and out is not None
    assert len(seen) == 1 and not added
    # colocated: the kept profile lacks the rates on every core; `cached` will not time them
    cached = load_config(tiny, [*modes[2], "run.profile_first=cached"])
    out, failed = launch_run.profile_first(cached, tmp_path / "cached", io.StringIO())
    assert out is None and failed is not None and "every core" in failed["unavailable"]
    # `true` times them into the kept profile, once
    out, failed = launch_run.profile_first(cfgs[2], tmp_path / "colocated", io.StringIO())
    assert failed is None and out is not None and len(added) == 1
    assert added[0].workflow.placement == "disaggregated"
    again, failed = launch_run.profile_first(cached, tmp_path / "again", io.StringIO())
    assert failed is None and again is not None
    assert (again / "profile.yaml").read_text() == "measured: 2\n"
    assert len(seen) == 1 and len(added) == 1
