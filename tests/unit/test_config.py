from __future__ import annotations

import pytest
import yaml

from areal_hex.config import ConfigError, load_config, save_config
from hexctl.cli import main


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"lr": 0.01}, "buffer": {"max_staleness": 3}}))
    cfg = load_config(path, ["trainer.lr=2e-5", "rollout.group_size=8"])
    assert cfg.trainer.lr == pytest.approx(2e-5)
    assert cfg.buffer.max_staleness == 3
    assert cfg.rollout.group_size == 8
    assert cfg.inference.num_servers == 1


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("trainer.lrr=1", "trainer.lrr: unknown key"),
        ("trainer.lr=fast", "trainer.lr:"),
        ("buffer.groups_per_step=0", "buffer.groups_per_step: Input should be greater than 0"),
        ("redis.url=http://x", "redis.url:"),
        ("algo.advantage=ppo", "algo.advantage:"),
    ],
)
def test_bad_values_name_the_field(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_override_into_value_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match="trainer.lr is a value"):
        load_config(path, ["trainer.lr.x=1"])


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["run.name=abc", "inference.num_servers=3"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(path) == cfg


def test_cli_exit_code_2_on_bad_config(capsys):
    assert main(["config", "trainer.nope=1"]) == 2
    assert "trainer.nope: unknown key" in capsys.readouterr().err


def test_publishing_less_often_than_the_gate_allows_is_refused(tmp_path):
    from areal_hex.config.checks import check_run

    ok = load_config(None, ["buffer.max_staleness=2", "trainer.publish_every=3"])
    check_run(ok)  # the trainer may run eta + 1 = 3 steps past a publish
    bad = load_config(None, ["buffer.max_staleness=1", "trainer.publish_every=3"])
    with pytest.raises(ConfigError, match=r"trainer.publish_every \(3\).*max_staleness"):
        check_run(bad)
    replay = tmp_path / "replay.jsonl"
    replay.write_text("")
    bad.trainer.replay_path = str(replay)
    check_run(bad)  # no gate when the trainer replays a file
