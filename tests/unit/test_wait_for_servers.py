"""`rollout.wait_for_servers`: the controller's start waits for the first healthy server
or for every configured one, and past `rollout.startup_timeout_s` ends naming those
that never came up."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import FakeServer

from areal_hex.config import ConfigError, load_config
from rollout_service.controller.dispatch import Dispatcher
from rollout_service.controller.wiring import wait_for_servers


def test_the_option_parses_and_refuses_other_values() -> None:
    assert load_config(None, []).rollout.wait_for_servers == "first"
    assert load_config(None, ["rollout.wait_for_servers=all"]).rollout.wait_for_servers == "all"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.wait_for_servers=every"])
    assert "rollout.wait_for_servers:" in str(err.value) and "'first' or 'all'" in str(err.value)


def _rollout(wait: str, timeout_s: float):  # -> RolloutConfig
    overrides = [f"rollout.wait_for_servers={wait}", f"rollout.startup_timeout_s={timeout_s}"]
    return load_config(None, overrides).rollout


async def test_first_starts_with_the_server_that_is_up() -> None:
    up, late = FakeServer("http://up:1"), FakeServer("http://late:2")
    late.down = True
    d = Dispatcher([up, late])
    assert await wait_for_servers(d, _rollout("first", 5)) == 1
    assert [s.healthy for s in d.servers] == [True, False]


async def test_all_waits_for_the_late_server() -> None:
    up, late = FakeServer("http://up:1"), FakeServer("http://late:2")
    late.down = True

    async def comes_up() -> None:
        await asyncio.sleep(0.3)
        late.down = False

    d = Dispatcher([up, late])
    t0 = time.monotonic()
    n, _ = await asyncio.gather(wait_for_servers(d, _rollout("all", 5)), comes_up())
    assert n == 2 and all(s.healthy for s in d.servers)
    assert time.monotonic() - t0 >= 0.3  # not before the late one answered


async def test_all_ends_naming_the_servers_that_never_came_up() -> None:
    up, never = FakeServer("http://up:1"), FakeServer("http://never:2")
    never.down = True
    d = Dispatcher([up, never])
    with pytest.raises(TimeoutError) as err:
        await wait_for_servers(d, _rollout("all", 0.3))
    text = str(err.value)
    assert text.startswith("rollout.wait_for_servers=all: 1 of 2 inference servers healthy")
    assert "(need 2); down: http://never:2 (no answer to /health)" in text
    assert "http://up:1" not in text
