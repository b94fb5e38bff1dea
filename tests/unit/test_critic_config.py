"""`algo.advantage: gae` and its keys: accepted together, refused where they do nothing."""

from __future__ import annotations

import pytest

from areal_hex.config import ConfigError, load_config, save_config


def test_gae_keys_load() -> None:
    cfg = load_config(
        None,
        ["algo.advantage=gae", "algo.gamma=0.99", "algo.lam=0.95", "algo.value_clip=null",
         "algo.critic_lr=1e-4", "algo.critic_warmup_steps=2"],
    )  # fmt: skip
    a = cfg.algo
    assert (a.advantage, a.gamma, a.lam, a.value_clip) == ("gae", 0.99, 0.95, None)
    assert (a.critic_lr, a.critic_warmup_steps, a.whiten_advantages) == (1e-4, 2, True)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["algo.gamma=0.9"], "gamma applies to advantage gae only (advantage is 'grpo')"),
        (["algo.value_clip=0.2", "algo.critic_lr=1e-4"], "critic_lr, value_clip apply to"),
        (["algo.advantage=gae", "algo.batch_normalize=true"], "whitened over the step"),
        (["algo.advantage=gae", "algo.std_normalize=false"], "std_normalize does not apply"),
        (["algo.advantage=gae", "algo.denominator=informative"], "use denominator all"),
        (["algo.advantage=gae", "algo.gamma=1.5"], "algo.gamma: Input should be less than"),
        (["algo.advantage=gae", "algo.value_clip=0"], "algo.value_clip: Input should be greater"),
        (
            ["algo.advantage=gae", "algo.critic_warmup_steps=5", "trainer.total_steps=5"],
            "algo.critic_warmup_steps 5 leaves no step of trainer.total_steps 5",
        ),
    ],
)
def test_combinations_that_do_nothing_are_refused(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_a_saved_config_loads_again(tmp_path) -> None:
    # a resolved config holds every key at its value: defaults never count as "set"
    for overrides in ([], ["algo.advantage=gae", "algo.gamma=0.9"]):
        path = save_config(load_config(None, overrides), tmp_path / "c.yaml")
        assert load_config(path).algo == load_config(None, overrides).algo
