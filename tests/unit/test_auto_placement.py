"""`workflow.placement: auto`: every placement the run's mode allows priced from this
machine's cached profile of the job, the fastest run; without a profile, the default.
Profiles with fixed rates, each shaped so that one placement wins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from areal_hex.config import ConfigError, ExperimentConfig, load_config
from hexctl.job.placement_choice import candidates, choose
from hexctl.launch.placement_prices import profile_prices
from hexctl.profile import cache

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples/tiny_cpu.yaml"
DATA = ROOT / "tests/data/box_thin_profile"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_HEX_CACHE_DIR", str(tmp_path / "cache"))


def _cfg(*extra: str) -> ExperimentConfig:
    return load_config(TINY, ["run.host_cores=trainer", *extra])


def _side(decode_s: float, train_tps: float) -> dict:
    steps = {1: decode_s, 8: 1.5 * decode_s, 64: 6 * decode_s}
    return {"decode_step_s": steps, "prefill_tokens_per_s": 3000.0, "train_tokens_per_s": train_tps}


def _cache_profile(
    cfg: ExperimentConfig,
    decode_s: float,
    train_tps: float,
    every_core: float | None = None,
    switch_s: float = 0.02,
) -> Path:
    """A profile of a 2-core host kept in the cache for `cfg`'s job (`_write_profile`)."""
    entry = cache.cache_root() / "profiles" / cache.key_of(cfg)[0]
    _write_profile(entry, decode_s, train_tps, every_core, switch_s)
    (entry / "seconds").write_text("1.0\n")
    return entry


def _write_profile(
    entry: Path, decode_s: float, train_tps: float, every_core: float | None, switch_s: float
) -> None:
    """The files of a local profile of a 2-core host: each side on its own core and (with
    `every_core`) both sides that much faster on every core."""
    shutil.copytree(DATA / "model", entry / "model")
    group = yaml.safe_load((DATA / "cluster.yaml").read_text())["node_groups"][0]
    group.update(name="here", gpu="CPU", gpus_per_node=2, nodes=1, zone="here")
    cluster = {
        "name": "here",
        "zones": [{"name": "here", "region": "here", "inter_node_bandwidth_gbs": 100.0}],
        "node_groups": [group],
        "gpu_overrides": {"CPU": {"bf16_tflops": 0.01, "hbm_gb": 4.0, "hbm_gbs": 0.06}},
    }
    # the box profile's measured overheads, this host's rates
    kind = yaml.safe_load((DATA / "profile.yaml").read_text())["kinds"]["fast"]
    kind.update(device="cpu", context_switch_s=switch_s, **_side(decode_s, train_tps))
    if every_core is not None:
        shared = _side(decode_s / every_core, train_tps * every_core)
        kind["every_core"] = {**shared, "inference_threads": 2, "trainer_threads": 2}
    prof = {"model": str(entry / "model"), "params": 80704, "kinds": {"CPU": kind}}
    work = yaml.safe_load((DATA / "workload.yaml").read_text())
    work.update(weight_sync="disk", max_trainer_nodes=1)
    for name, data in (("cluster", cluster), ("profile", prof), ("workload", work)):
        (entry / f"{name}.yaml").write_text(yaml.safe_dump(data))


# (run.mode, decode step s, training tokens/s, every-core speed-up, switch s) -> winner
FAVOURS = {
    # generation binds: the trainer's idle core lent to a server pays, its wait longer
    # than a lent server's first group
    "hybrid": ("async", 0.016, 60000.0, None, 0.02),
    # training binds, both phases almost twice as fast on both cores
    "colocated": ("sync", 0.0005, 2000.0, 1.9, 0.02),
    # a switch of seconds: sharing devices costs more than it gives
    "disaggregated": ("sync", 0.004, 30000.0, 1.9, 5.0),
}


@pytest.mark.parametrize("winner", list(FAVOURS))
def test_auto_runs_the_placement_its_profile_prices_fastest(winner: str) -> None:
    mode, decode_s, train_tps, every, switch_s = FAVOURS[winner]
    cfg = _cfg(f"run.mode={mode}")
    assert cfg.workflow.placement == "auto"
    _cache_profile(cfg, decode_s, train_tps, every, switch_s)
    said: list[str] = []
    choice, chosen = choose(cfg, profile_prices(said.append))
    assert choice.source == "profile" and choice.chosen == winner, choice
    rates = choice.candidates
    assert all(r is not None and r > 0 for r in rates.values()), choice
    others = [r for k, r in rates.items() if k != winner]
    assert rates[winner] > max(others)  # type: ignore[type-var]
    assert chosen.workflow.placement == winner and chosen.run.mode == mode
    if winner == "hybrid":  # the config's server of its own, plus the lent one
        assert chosen.inference.num_servers == cfg.inference.num_servers + 1
    else:
        assert chosen.inference.num_servers == cfg.inference.num_servers
    assert said == []  # a cached profile is read, never measured
    assert winner in choice.line() and "predicted samples/s" in choice.line()


def test_the_candidates_are_those_the_run_mode_allows() -> None:
    valid, refused = candidates(_cfg("run.mode=async"))
    assert list(valid) == ["disaggregated", "hybrid"]
    assert "workflow.placement colocated with run.mode async" in refused["colocated"]
    valid, refused = candidates(_cfg("run.mode=sync"))
    assert list(valid) == ["disaggregated", "colocated", "hybrid"] and refused == {}
    # hybrid follows the trainer's steps by the version each one publishes
    valid, refused = candidates(_cfg("trainer.publish_every=2"))
    assert list(valid) == ["disaggregated"]
    assert "expected trainer.publish_every=1" in refused["hybrid"]
    urls = "inference.server_urls=[http://127.0.0.1:21001]"
    valid, refused = candidates(_cfg("run.mode=sync", urls))
    assert "hybrid" not in valid and "inference.server_urls" in refused["hybrid"]


def test_without_a_profile_auto_is_the_default_and_says_so() -> None:
    cfg = _cfg()
    said: list[str] = []
    choice, chosen = choose(cfg, profile_prices(said.append))
    assert (choice.chosen, choice.source) == ("disaggregated", "default")
    assert chosen.workflow.placement == "disaggregated"
    assert set(choice.candidates) == {"disaggregated", "hybrid"}
    assert all(r is None for r in choice.candidates.values())
    assert "no profile of this machine" in choice.notes["hybrid"]
    line = choice.line()
    assert "the default" in line and "run.profile_first=true measures one" in line
    assert said == [] and not (cache.cache_root() / "profiles").exists()  # nothing measured
    assert choose(cfg, None)[0].source == "default"  # no price at all (a bench's run)


def test_profile_first_true_measures_once_then_prices_from_the_kept_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only `run.profile_first: true` takes a profile to decide (profiling itself, ~100 s
    of real timing, is `profile_local`'s own test): taken once, kept in the cache, with
    the rates on every core for a synchronous run's colocated candidate."""
    from hexctl.profile import local

    taken: list[bool] = []

    def profile_local(job: ExperimentConfig, out: Path, say=None, every_core=False):  # noqa: ANN001, ANN202
        assert job.workflow.placement == "disaggregated"  # the job every placement keys
        taken.append(every_core)
        _write_profile(out, *FAVOURS["colocated"][1:])

    monkeypatch.setattr(local, "profile_local", profile_local)
    cfg = _cfg("run.mode=sync", "run.profile_first=true")
    said: list[str] = []
    choice, _ = choose(cfg, profile_prices(said.append))
    assert taken == [True] and choice.chosen == "colocated" and choice.source == "profile"
    assert "measuring this machine" in said[0]
    assert cache.lookup(cache.key_of(cfg)[0]) is not None  # kept for the run and later runs
    again, _ = choose(cfg, profile_prices(said.append))
    assert taken == [True] and again.candidates == choice.candidates


def test_colocated_without_rates_on_every_core_has_no_price() -> None:
    cfg = _cfg("run.mode=sync")  # profile_first cached: the missing rates are not timed
    _cache_profile(cfg, 0.0005, 2000.0, every_core=None)
    choice, _ = choose(cfg, profile_prices(lambda _: None))
    assert choice.candidates["colocated"] is None
    assert "no rates on every core" in choice.notes["colocated"]
    assert choice.chosen in ("disaggregated", "hybrid") and choice.source == "profile"


def test_a_tie_keeps_the_default() -> None:
    choice, _ = choose(_cfg("run.mode=sync"), lambda c: 10.0)
    assert choice.chosen == "disaggregated" and choice.source == "profile"
    faster = {"hybrid": 10.5}
    choice, _ = choose(_cfg(), lambda c: faster.get(c.workflow.placement, 10.0))
    assert choice.chosen == "hybrid"


def test_the_run_directory_keeps_the_concrete_placement_and_the_choice(tmp_path: Path) -> None:
    from areal_hex.net import free_port_block
    from hexctl.job.prepare import prepare_run
    from hexctl.report.summary import summarize

    run = ["model.tiny.sft_steps=0", f"run.output_dir={tmp_path}"]
    cfg = _cfg(*run, "run.run_id=auto", f"inference.base_port={free_port_block(2, 21000)}")
    prices = {"disaggregated": 5.0, "hybrid": 7.0}
    said: list[str] = []
    price = lambda c: prices[c.workflow.placement]  # noqa: E731
    cfg, path = prepare_run(cfg, None, None, say=said.append, price=price)
    assert said[0].startswith("workflow.placement auto: hybrid (predicted samples/s")
    saved = load_config(path)
    assert (saved.workflow.placement, saved.inference.num_servers) == ("hybrid", 2)
    kept = json.loads((tmp_path / "auto" / "placement.json").read_text())
    assert kept["chosen"] == "hybrid" and kept["candidates"] == prices
    assert summarize(tmp_path / "auto", saved)["placement_choice"] == kept
    # a placement that is not auto is run as it is, and nothing is said or kept
    fixed = _cfg(*run[:2], "run.run_id=fixed", "workflow.placement=disaggregated")
    said.clear()
    prepare_run(fixed, None, None, say=said.append, price=lambda c: 1.0)
    assert said == [] and not (tmp_path / "fixed" / "placement.json").exists()


def test_a_bad_placement_names_the_field_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"workflow.placement: .*'auto', 'disaggregated'"):
        _cfg("workflow.placement=fastest")
    # a service handed an unresolved config runs in the default placement
    assert _cfg().workflow.placement_in_effect() == "disaggregated"
    assert _cfg("run.mode=sync", "workflow.placement=colocated").workflow.placement_in_effect() == (
        "colocated"
    )


@pytest.mark.parametrize("nodes", ["local", "cluster"])
def test_a_plans_placement_replaces_auto(nodes: str) -> None:
    """`run --plan`, every deploy render and a box run read the config through the plan's
    projection: the plan's decision is the placement, never `auto`."""
    from areal_hex.plan import load_plan
    from hexctl.job.plan_config import project_plan

    plan = load_plan(ROOT / "examples/plans/local_cpu.yaml")
    got = project_plan(_cfg(), plan, nodes)  # type: ignore[arg-type]
    assert got.config.workflow.placement == plan.decisions.placement
    assert f"workflow.placement: 'auto' -> '{plan.decisions.placement}'" in "\n".join(got.changes)


def test_a_profile_given_to_run_prices_the_candidates(tmp_path: Path) -> None:
    """`run --profile DIR`: that profile, read as it is (never timed into)."""
    given = tmp_path / "local"
    _write_profile(given, *FAVOURS["hybrid"][1:])
    choice, _ = choose(_cfg(), profile_prices(lambda _: None, given))
    assert (choice.chosen, choice.source) == ("hybrid", "profile")
    sync = _cfg("run.mode=sync", "run.profile_first=true")
    choice, _ = choose(sync, profile_prices(lambda _: None, given))
    assert choice.candidates["colocated"] is None
    assert choice.notes["colocated"].endswith("(a colocated run's phases)")
    assert not (cache.cache_root() / "profiles").exists()
