"""One context switch on the real built-in server, as the controller makes it, loses no
request: colocated (release and resume, nothing in flight; requests before and after
answered in full) and hybrid (the lent server paused in place with requests in flight,
which finish once it continues)."""

from __future__ import annotations

import asyncio

import pytest

from areal_hex.api import SamplingParams
from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import materialize
from rollout_service.server.main import ServerThread, build_server_app

pytestmark = pytest.mark.timeout(120)
LONG = SamplingParams(max_new_tokens=56, ignore_eos=True)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("switching")
    materialize(ModelConfig(tiny=TinyModelConfig(), seed=5), root / "v0")
    inf = InferenceConfig(weights_dir=str(root), context_length=64, num_threads=1)
    with ServerThread(build_server_app(ModelConfig(path=str(root / "v0")), inf)) as u:
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


def test_a_lend_holds_requests_in_flight_and_answers_them(url: str) -> None:
    """The lent server (the same server seen twice: one of its own, one lent) pauses in
    place as six requests reach it; none ends while the trainer steps, all end in full
    once the update's continue and the lend's settle let it go."""
    from rollout_service.controller.lend import Lending

    async def go() -> None:
        weights = await _weights([url, url])
        lent = weights.dispatcher.servers[1]
        lending = Lending(weights, set, lent=1, groups_per_step=1)
        running = asyncio.ensure_future(_all_answered(lent.client, 6))
        await asyncio.sleep(0)  # sent: in flight, or held at the paused server's door
        await lending.after_put()  # the trainer's batch is in: the lent server pauses
        assert lending.away and lent.lent_away
        await asyncio.sleep(0.3)
        assert not running.done()  # held, not ended
        weights.serving = 1  # the trainer published: it waits for its next batch
        await lending.after_update()
        assert await asyncio.wait_for(running, 60) == ["length"] * 6
        assert not lending.away and lending.switches_total == 1
        await weights.dispatcher.aclose()
        for s in weights.dispatcher.servers:
            await s.client.close()

    asyncio.run(go())
