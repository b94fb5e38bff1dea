"""`profile --local` / `--box`, scoring: the rate a reference or reward-model task scores
at, timed with as many requests in flight as the run's controller keeps there.

The controller scores each finished group in its own request (a reference task: the
group's G sequences on `/generate` with no token generated; a reward model: their
texts in one `/classify` call) while the group still holds its slot, so at most
`rollout.max_concurrent_groups` scoring requests are in flight, and an engine batches
at most its batch limit of sequences at once: the requests it can score together are
min(max_concurrent_groups, batch limit // G), at least one. A task that binds the run
has them all waiting, so the rate it is priced at is the rate at that concurrency; one
request at a time (the earlier measure, still written as `score_tokens_per_s`) underprices
a kind whose engine batches concurrent requests.

The reward model is timed on its own server (`areal-hex serve --reward-model`, the job's
reward model, not the actor), started where the generation server ran (a box node's
namespace and quota, or the inference cores).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig
from hexctl.profile.devices import REPEATS, LocalDevices, Say, pinned, quiet

# server.server_process's shape, passed in (the profile's server starts there)
ServeProcess = Callable[
    [Path, LocalDevices, Path, list[str] | None], AbstractContextManager[tuple[str, int]]
]

ROUND_REQUESTS = 4  # requests of a round, at least; at least two per slot in flight


def scoring_concurrency(max_concurrent_groups: int, batch_limit: int, group_size: int) -> int:
    """Scoring requests an engine serves together in a run: one per group in flight
    (the controller's slots), no more than its batch limit holds whole groups of."""
    return max(1, min(max_concurrent_groups, batch_limit // max(1, group_size)))


def scoring_window_s(dev: LocalDevices) -> float:
    """Seconds a round of scoring lasts at least: a box node's load window (its quota is
    granted in periods); none on this machine's own cores."""
    return dev.min_window_s if dev.cgroup is not None else 0.0


async def timed_rounds(
    send: Callable[[int], Awaitable[int]],
    concurrency: int,
    repeats: int = REPEATS,
    min_window_s: float = 0.0,
) -> float:
    """Tokens/s of `send` (request k -> tokens it scored) with `concurrency` requests in
    flight, over `repeats` rounds, each of at least max(ROUND_REQUESTS, 2 x concurrency)
    requests and `min_window_s` seconds (a box node's quota is granted in periods: a
    short round catches a burst); the median round's. Each of `concurrency` senders
    starts its next request when its last one ends."""
    per_round = max(ROUND_REQUESTS, 2 * concurrency)
    sent = 0

    async def one_round() -> float:
        nonlocal sent
        t0, started, tokens = time.perf_counter(), 0, 0

        async def sender() -> None:
            nonlocal started, tokens, sent
            while started < per_round or time.perf_counter() - t0 < min_window_s:
                started, sent = started + 1, sent + 1
                got = await send(sent)  # not `tokens += await ...`: that reads it before
                tokens += got

        await asyncio.gather(*(sender() for _ in range(concurrency)))
        return tokens / (time.perf_counter() - t0)

    return statistics.median([await one_round() for _ in range(repeats)])


def _texts(
    tok: Any, prompts: list[list[int]], response: int, g: int, rng: random.Random
) -> tuple[list[str], int]:
    """One group's texts as the controller sends them (prompt text + completion text),
    a completion of `response` tokens, and the tokens they hold in the actor's count."""
    prompt = rng.choice(prompts)
    head = tok.decode(prompt, skip_special_tokens=True)
    texts = []
    for _ in range(g):
        ids = [rng.randrange(5, min(100, tok.vocab_size)) for _ in range(response)]
        texts.append(head + tok.decode(ids, skip_special_tokens=True))
    return texts, g * (len(prompt) + response)


async def _classify_rate(
    url: str, tok: Any, prompts: list[list[int]], response: int, g: int, concurrency: int,
    dev: LocalDevices,
) -> float:  # fmt: skip
    from rollout_service.client import InferenceClient
    from rollout_service.controller.reward_model import RewardModelClient

    async with InferenceClient(url, timeout_s=60.0) as health:  # its /health, as SGLang's
        await health.wait_healthy(timeout_s=180, interval_s=0.2)
    rng = random.Random(0)
    client = RewardModelClient([url], None, timeout_s=600.0, wait_s=180.0)
    await client.start()
    try:

        async def send(_k: int) -> int:
            texts, tokens = _texts(tok, prompts, response, g, rng)
            await client.score(texts)
            return tokens

        await timed_rounds(send, concurrency, 1)  # warm-up: the first forwards' allocations
        return await timed_rounds(send, concurrency, dev.repeats, scoring_window_s(dev))
    finally:
        await client.aclose()


def rm_config(cfg: ExperimentConfig) -> ExperimentConfig | None:
    """`cfg` with its reward model's path resolved (the job's tiny one built first if it
    is not in the cache), or None where the job scores with no reward model."""
    from areal_hex.reward_model import reward_model_path

    if cfg.workflow.task_with_role("reward_model") is None:
        return None
    out = cfg.model_copy(deep=True)
    if out.rollout.reward_model.path is None:
        tiny = cfg.model_copy(deep=True)
        tiny.model.path = None  # the tiny reward model is built from the tiny model's shape
        out.rollout.reward_model.path = reward_model_path(tiny)
    return out


def measure_classify(
    cfg: ExperimentConfig,
    dev: LocalDevices,
    prompts: list[list[int]],
    response: float,
    tok: Any,
    serve: ServeProcess,
    say: Say = quiet,
) -> tuple[float, int] | None:
    """(prompt + completion tokens/s, requests in flight) of the job's reward model on
    `dev`, groups scored as the controller scores them; None without a reward model.
    `serve(config, dev, log, extra)`: starts `areal-hex serve` on `dev`, yields (url, pid)
    (`server.server_process`)."""
    import tempfile

    from areal_hex.config import save_config

    rm_cfg = rm_config(cfg)
    if rm_cfg is None:
        return None
    rm = rm_cfg.rollout.reward_model
    rm.num_threads = dev.inference_threads
    rm_cfg.inference.host = dev.address
    g = cfg.rollout.group_size
    concurrency = scoring_concurrency(cfg.rollout.max_concurrent_groups, rm.max_batch, g)
    say(f"the reward model's /classify, {concurrency} group(s) in flight")
    with tempfile.TemporaryDirectory(prefix="areal-hex-profile-rm-") as tmp:
        path = save_config(rm_cfg, Path(tmp) / "rm.yaml")
        with serve(path, dev, Path(tmp) / "rm.log", ["--reward-model"]) as (url, _):
            with pinned(dev.trainer_cores, 1):
                rate = asyncio.run(
                    _classify_rate(url, tok, prompts, round(response), g, concurrency, dev)
                )
    return rate, concurrency
