"""Rewards from a reward model, with real parts on loopback: a built-in generation server
(tiny Qwen3), the built-in server in reward-model mode (a tiny sequence classifier) on
a port of its own, an embedded Valkey, the controller, and the consumer the trainer
reads batches with. The reward the trainer sees is the reward model's score of prompt +
completion; a reward model that is down when groups need it makes them wait, not fail."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from areal_hex.buffer import (
    EmbeddedValkey,
    RedisEndpoint,
    RedisTrajectoryConsumer,
    RedisTrajectoryProducer,
)
from areal_hex.config import (
    BufferConfig,
    DataConfig,
    InferenceConfig,
    ModelConfig,
    RolloutConfig,
    TinyModelConfig,
)
from areal_hex.config.reward import RewardModelConfig
from areal_hex.data import build_prompts, generate_arithmetic
from areal_hex.models import build_tokenizer, materialize
from areal_hex.net import free_port
from areal_hex.record import GroupRecord
from areal_hex.reward_model import build_tiny_reward_model, load_reward_model
from areal_hex.rewards import RewardPool, math_reward
from rollout_service.client import InferenceClient
from rollout_service.controller.reward_model import (
    RewardModelClient,
    RewardModelUnavailable,
    WeightedRewards,
)
from rollout_service.controller.rollout import RolloutController
from rollout_service.server.main import ServerThread, build_reward_app, build_server_app

pytestmark = pytest.mark.timeout(120)
TINY = TinyModelConfig(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2)


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("rm")
    policy = materialize(ModelConfig(tiny=TINY, seed=0), root / "policy")
    tok = build_tokenizer()
    rm = build_tiny_reward_model(TINY, tok, seed=1)
    with torch.no_grad():  # scores that differ from text to text
        rm.score.weight.normal_(0, 1.0)
    rm.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    valkey = EmbeddedValkey(appendonly=False).start()
    gen = ServerThread(build_server_app(ModelConfig(path=str(policy)), InferenceConfig()))
    try:
        with gen as gen_url:
            yield {"rm": root / "rm", "tok": tok, "valkey": valkey, "gen_url": gen_url}
    finally:
        valkey.stop()


def rm_server(path: Path, port: int = 0) -> ServerThread:
    app = build_reward_app(RewardModelConfig(max_batch=3), str(path), InferenceConfig())
    return ServerThread(app, port=port)


def own_scores(path: Path, tok, texts: list[str]) -> list[float]:
    """The reward model's outputs from its own forward, one text at a time."""
    model = load_reward_model(path)
    out = []
    with torch.no_grad():
        for t in texts:
            ids = torch.tensor([tok(t, add_special_tokens=False)["input_ids"]])
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


async def produce(parts: dict, scorer: WeightedRewards, n: int) -> list[GroupRecord]:
    """`n` groups through the controller into the buffer, read back as the trainer does."""
    tok, run_id = parts["tok"], f"rm{uuid.uuid4().hex[:8]}"
    buf = BufferConfig(groups_per_step=n, max_staleness=4, gate_timeout_s=60)
    ep = RedisEndpoint(parts["valkey"].url, server=parts["valkey"])
    producer = RedisTrajectoryProducer(ep.async_client(), run_id, buf)
    prompts = build_prompts(generate_arithmetic(8, "train"), tok, DataConfig()).prompts
    client = InferenceClient(parts["gen_url"], timeout_s=None)
    cfg = RolloutConfig(group_size=3, max_new_tokens=8, metrics_interval_s=0.5)
    ctl = RolloutController(
        [client],
        producer,
        prompts,
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        cfg,
        max_groups=n,
        stop_token_ids=[tok.eos_token_id],
        rewards=scorer,
    )
    await scorer.start()
    try:
        await asyncio.wait_for(ctl.run(), 90)
    finally:
        await scorer.aclose()
        await producer.aclose()
        await producer.r.aclose()
        await client.close()
    consumer = RedisTrajectoryConsumer(ep.sync_client(), run_id, buf)
    batch = consumer.get_batch(n, timeout_s=10)
    consumer.ack(batch.entry_ids)
    prompt_text = {p.id: p.text for p in prompts}
    for g in batch.groups:
        g.metadata["prompt_text"] = prompt_text[g.prompt_id]
    return batch.groups


async def test_the_reward_the_trainer_sees_is_the_models_score(parts: dict) -> None:
    with rm_server(parts["rm"]) as url:
        client = RewardModelClient([url], None, timeout_s=30, wait_s=30)
        groups = await produce(parts, WeightedRewards({"model": 1.0}, None, client), 3)
    assert len(groups) == 3 and client.stats.calls == 3 and client.stats.retries == 0
    texts = [g.metadata["prompt_text"] + c.text for g in groups for c in g.completions]
    seen = [float(r) for g in groups for r in g.rewards]  # what the trainer's batch holds
    expected = own_scores(parts["rm"], parts["tok"], texts)
    assert seen == pytest.approx(expected, abs=1e-5)
    assert len({round(s, 5) for s in seen}) > 1  # not one constant score


async def test_groups_wait_for_a_reward_model_that_is_down(parts: dict) -> None:
    """The reward model comes up only after the first groups want it: they wait
    (retries counted) and are scored with rule + 0.5 x model, none dropped."""
    port = free_port()
    server = rm_server(parts["rm"], port)
    client = RewardModelClient([f"http://127.0.0.1:{port}"], None, timeout_s=30, wait_s=60)

    async def start_when_wanted() -> None:
        while client.stats.retries < 2:  # groups already wait for it
            await asyncio.sleep(0.05)
        await asyncio.to_thread(server.__enter__)

    starter = asyncio.create_task(start_when_wanted())
    try:
        scorer = WeightedRewards({"rule": 1.0, "model": 0.5}, RewardPool(1, 5.0), client)
        groups = await produce(parts, scorer, 2)
    finally:
        starter.cancel()
        server.__exit__(None, None, None)
    assert len(groups) == 2 and client.stats.retries > 0
    texts = [g.metadata["prompt_text"] + c.text for g in groups for c in g.completions]
    model = own_scores(parts["rm"], parts["tok"], texts)
    rule_scores = [math_reward(c.text, g.metadata["answer"]) for g in groups for c in g.completions]
    seen = [float(r) for g in groups for r in g.rewards]
    expected = [r + 0.5 * m for r, m in zip(rule_scores, model, strict=True)]
    assert seen == pytest.approx(expected, abs=1e-5)


async def test_no_instance_within_wait_s_is_an_error_naming_the_setting() -> None:
    client = RewardModelClient([f"http://127.0.0.1:{free_port()}"], None, 5.0, wait_s=0.5)
    await client.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardModelUnavailable, match="rollout.reward_model.wait_s"):
            await client.score(["a"])
    finally:
        await client.aclose()
    assert client.stats.retries >= 2 and time.monotonic() - t0 < 10
