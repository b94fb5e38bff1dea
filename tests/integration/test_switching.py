"""One context switch on the real built-in server, as the controller makes it, loses no
request: colocated (release and resume, nothing in flight; requests before and after
answered in full) and hybrid (the lent server paused in place with requests in flight,
left out of the weight updates while it is paused: what it holds ends once it stays
paused through an update, and it loads the version served as it continues)."""

from __future__ import annotations

import asyncio

import pytest

from areal_hex.api import SamplingParams
from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import materialize
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(120)
LONG = SamplingParams(max_new_tokens=56, ignore_eos=True)
# requests a pause must catch under way: long enough that none ends before it, on a busy
# machine too (the server decodes in a thread of the test's own process)
HELD = SamplingParams(max_new_tokens=480, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("switching")
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=5), root / "v0")
    return root


def _server(root):
    inf = InferenceConfig(weights_dir=str(root), context_length=512, num_threads=1)
    return ServerThread(build_server_app(ModelConfig(path=str(root / "v0")), inf))


@pytest.fixture(scope="module")
def url(root):
    with _server(root) as u:
        yield u


@pytest.fixture(scope="module")
def lent_url(root):
    with _server(root) as u:
        yield u


async def _weights(urls: list[str]):
    from fakes import MemoryProducer

    from rollout_service.client import InferenceClient
    from rollout_service.controller.dispatch import Dispatcher
    from rollout_service.controller.weight_sync import UpdateGate, WeightSync

    dispatcher = Dispatcher([InferenceClient(u) for u in urls], 0.05)
    await dispatcher.probe_all()
    return WeightSync(dispatcher, MemoryProducer(), UpdateGate())


async def _all_answered(client, n: int) -> list[str]:
    outs = await asyncio.gather(*[client.generate([20 + i, 21], LONG) for i in range(n)])
    assert [len(o.output_ids) for o in outs] == [LONG.max_new_tokens] * n
    return [o.finish_reason for o in outs]


def test_a_colocated_switch_loses_no_request(url: str) -> None:
    from rollout_service.client import GenerationError
    from rollout_service.controller.colocate import Colocation

    async def go() -> None:
        weights = await _weights([url])
        client = weights.dispatcher.servers[0].client
        col = Colocation(weights, set)
        assert await _all_answered(client, 6) == ["length"] * 6
        await col.release()
        with pytest.raises(GenerationError, match="resume_memory_occupation"):
            await client.generate([20, 21], LONG)  # what the gate keeps from happening
        await col.resume()
        assert await _all_answered(client, 6) == ["length"] * 6
        assert col.switches_total == 1 and col.switch_s_total > 0
        await weights.dispatcher.aclose()
        await client.close()

    asyncio.run(go())


def test_a_lend_holds_its_requests_then_ends_them_and_loads_as_it_continues(
    url, lent_url, root
) -> None:
    """Lent after two updates in a row, the lent server pauses in place as six requests
    run on it: none ends while the trainer steps. The trainer has its next batch already
    at the update: the update leaves the lent server out, and what it held ends (in
    full, or aborted with the tokens it had). At the next update the trainer waits: the
    lent server loads the version served as the lend continues it, and answers a
    request in full."""
    from rollout_service.controller.lend import Lending

    async def go() -> None:
        weights = await _weights([url, lent_url])
        own, lent = weights.dispatcher.servers
        lending = Lending(weights, set, lent=1, groups_per_step=1)
        path = str(root / "v0")
        for v in (1, 2):  # the trainer waits: the lent server generates
            await weights.update(v, path)
        assert lending.lent_updates == 2 and not lending.away
        running = asyncio.ensure_future(
            asyncio.gather(*[lent.client.generate([20 + i, 21], HELD) for i in range(6)])
        )
        await asyncio.sleep(0.05)  # under way on the lent server
        await lending.after_put()  # the trainer's batch is in: the lent server pauses
        assert lending.away and lent.lent_away
        await asyncio.sleep(0.3)
        assert not running.done()  # held, not ended
        await lending.after_put()  # and the batch after
        await weights.update(3, path)  # still not needed: what it held ends
        outs = await asyncio.wait_for(running, 30)
        for o in outs:
            ended = "length" if len(o.output_ids) == HELD.max_new_tokens else "abort"
            assert o.finish_reason == ended
        assert lending.away and lending.loads_total == 0
        assert await own.client.weight_version() == 3
        assert await lent.client.weight_version() == 2  # left out
        await weights.update(4, path)  # the trainer waits: the lend continues
        assert not lending.away and lending.loads_total == 1
        assert await lent.client.weight_version() == 4
        assert await _all_answered(lent.client, 1) == ["length"]
        assert lending.switches_total == 1
        await weights.dispatcher.aclose()
        for s in weights.dispatcher.servers:
            await s.client.close()

    asyncio.run(go())
