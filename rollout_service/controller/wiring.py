"""Wiring of `areal-hex rollout`: build the tokenizer, prompts, clients, producer and
controller from the config and run until done or signalled.

    summary = asyncio.run(run_rollout(cfg))
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING, Any

from areal_hex.config import ExperimentConfig
from areal_hex.data import PromptSet, build_prompts, load_problems
from areal_hex.gc_freeze import freeze_startup
from areal_hex.prom import MetricsServer, RolloutCollector, registry_with
from areal_hex.run_files import STATUS_MARK, RunPaths
from areal_hex.trackers import open_run_trackers

if TYPE_CHECKING:
    from areal_hex.buffer import RedisTrajectoryProducer
    from areal_hex.config.rollout import RolloutConfig
    from rollout_service.controller.dispatch import Dispatcher
    from rollout_service.controller.reference import ReferenceScorer
    from rollout_service.controller.rollout import RolloutController
    from rollout_service.controller.weight_sync import NetworkSource

log = logging.getLogger(__name__)


def load_rollout_tokenizer(cfg: ExperimentConfig):  # -> PreTrainedTokenizerBase
    """The tokenizer of `model.tokenizer_path`, else `model.path`, else the tiny one
    (without torch, or transformers, where it is not needed: areal_hex/tokenizer_files.py)."""
    from areal_hex import models
    from areal_hex.tokenizer_files import load_controller_tokenizer

    path = cfg.model.tokenizer_path or cfg.model.path
    if path is None:
        if cfg.model.tiny is None:
            raise ValueError("model: set model.path (or model.tokenizer_path) or model.tiny")
        return models.build_tokenizer()
    return load_controller_tokenizer(path)


def load_prompt_set(cfg: ExperimentConfig, tokenizer: Any) -> PromptSet:
    problems = load_problems(cfg.data, cfg.data.split)
    prompts = build_prompts(problems, tokenizer, cfg.data)
    log.info(
        "%d prompts from %s/%s (%d skipped: longer than data.max_prompt_tokens=%d)",
        len(prompts.prompts),
        cfg.data.dataset,
        cfg.data.split,
        prompts.skipped_overlong,
        cfg.data.max_prompt_tokens,
    )
    return prompts


class SamplingExhausted(RuntimeError):
    """The controller stopped short of the run's groups: dynamic sampling filtered too many."""


def target_groups(cfg: ExperimentConfig) -> int:
    """`rollout.max_groups`, else the groups the trainer's steps take:
    trainer.total_steps * buffer.groups_per_step, so that the last step's groups are the
    last made (the gate would admit max_staleness + 1 steps' worth more, which no step
    trains). Groups owed (never made, or dropped by the trainer) come on top
    (`final_version`)."""
    if cfg.rollout.max_groups is not None:
        return cfg.rollout.max_groups
    return cfg.trainer.total_steps * cfg.buffer.groups_per_step


def final_version(cfg: ExperimentConfig) -> int | None:
    """The version the trainer publishes at its last step, until which a controller at
    its target keeps making the groups owed to the run; None with `rollout.max_groups`
    (a fixed number of groups, then done)."""
    return cfg.trainer.total_steps if cfg.rollout.max_groups is None else None


def serve_metrics(cfg: ExperimentConfig, ctl: RolloutController) -> MetricsServer | None:
    """The controller's /metrics (`rollout.metrics_port`), behind the service token."""
    if cfg.rollout.metrics_port is None:
        return None
    rows = RolloutCollector(ctl.dispatcher.servers, cfg.inference.gpu_kinds)
    ctl.row_observers.append(rows.observe)
    ctl.gate_wait_observers.append(rows.observe_gate_wait)
    ctl.dispatcher.request_observers.append(rows.observe_request)
    server = MetricsServer(
        registry_with(rows), cfg.rollout.metrics_port, token=cfg.inference.api_key
    )
    log.info("controller metrics on port %d", server.port)
    return server


async def give_back(producer: RedisTrajectoryProducer) -> None:
    """A stopping controller gives back what it still holds, rather than leaving it for
    the lease to expire."""
    from areal_hex.buffer.errors import BUFFER_ERRORS

    try:
        n = await producer.give_back_all()
    except BUFFER_ERRORS as exc:
        log.error("could not give back admissions (the lease expiry will): %s", exc)
        return
    if n:
        log.info("gave back %d admission(s)", n)


def network_source(cfg: ExperimentConfig, redis_client: Any) -> NetworkSource | None:
    """rollout.weight_sync=network: the manifests the trainer leaves in Redis, and each
    group's members recorded there for it (set once: the first record stands)."""
    if cfg.rollout.weight_sync != "network":
        return None
    import json

    from areal_hex.config.checks import weight_sync_ranks_per_server
    from areal_hex.weight_net import (
        MANIFEST_TTL_S,
        Manifest,
        manifest_key,
        members_key,
        regroup_key,
    )
    from rollout_service.controller.weight_sync import NetworkSource

    run_id = cfg.run.run_id
    assert run_id is not None

    async def read(version: int) -> Manifest | None:
        raw = await redis_client.get(manifest_key(run_id, version))
        return None if raw is None else Manifest.from_json(raw)

    async def record(group_name: str, urls: list[str]) -> list[str]:
        key = members_key(run_id, group_name)
        await redis_client.set(key, json.dumps(urls), nx=True, ex=MANIFEST_TTL_S)
        raw = await redis_client.get(key)
        return [] if raw is None else list(json.loads(raw))

    async def ask_regroup(group_name: str) -> None:
        await redis_client.set(regroup_key(run_id), group_name, ex=MANIFEST_TTL_S)

    return NetworkSource(
        read,
        weight_sync_ranks_per_server(cfg),
        timeout_s=cfg.rollout.weight_sync_timeout_s,
        record=record,
        ask_regroup=ask_regroup,
    )


def reference_scorer(cfg: ExperimentConfig) -> ReferenceScorer | None:
    """The scorer of the workflow's reference task, when the objective has a KL term;
    the worker may restart for up to `rollout.startup_timeout_s` before a group fails."""
    task = cfg.workflow.task_with_role("reference")
    if task is None or cfg.algo.kl_coef <= 0:
        return None
    from rollout_service.controller.reference import build_reference_scorer

    r = cfg.rollout
    urls = task.instance_urls()
    log.info("π_ref log-probs from reference task %r at %s", task.name, ", ".join(urls))
    return build_reference_scorer(
        urls, cfg.inference.api_key, r.request_timeout_s, r.startup_timeout_s
    )


async def wait_for_servers(dispatcher: Dispatcher, rollout: RolloutConfig) -> int:
    """The servers `rollout.wait_for_servers` names, healthy: the first one, or every one
    configured (`all`). A server counts once its probe's recovery has run
    (`WeightSync.recover`: one behind the weights the controller serves loads them, or
    asks for the next weight group), so with `all` the first group starts with every
    planned server up and on the weights the others hold (a version published before
    the controller started reaches them all at once: `WeightSync.follow`). Past
    `rollout.startup_timeout_s`, TimeoutError naming the servers that never came up.
    Returns how many are healthy."""
    need = len(dispatcher.servers) if rollout.wait_for_servers == "all" else 1
    try:
        return await dispatcher.wait_healthy(rollout.startup_timeout_s, min_servers=need)
    except TimeoutError as exc:
        raise TimeoutError(f"rollout.wait_for_servers={rollout.wait_for_servers}: {exc}") from None


async def run_rollout(cfg: ExperimentConfig) -> dict[str, Any]:
    """Run the controller for `cfg`; SIGTERM/SIGINT stop it cleanly. Returns the final
    metrics line (also appended to `<run_dir>/rollout.jsonl`)."""
    from areal_hex.buffer import RedisTrajectoryProducer, open_redis
    from areal_hex.rewards import RewardPool
    from rollout_service.client import InferenceClient
    from rollout_service.controller.lend import phases_for, server_requests
    from rollout_service.controller.reference import ScoredProducer
    from rollout_service.controller.reward_model import build_scorer
    from rollout_service.controller.rollout import RolloutController

    tokenizer = load_rollout_tokenizer(cfg)
    prompts = load_prompt_set(cfg, tokenizer)
    run_id = cfg.run.run_id
    if run_id is None:
        raise ValueError("run.run_id is not set (the launcher sets it; or pass run.run_id=...)")
    clients = [
        InferenceClient(
            url,
            api_key=cfg.inference.api_key,
            timeout_s=None,
            # enough queued at each server to refill its batch as requests finish
            max_inflight=2 * cfg.inference.max_running_requests,
        )
        for url in cfg.inference.urls()
    ]
    endpoint = open_redis(cfg.redis)
    redis_client = endpoint.async_client()
    producer = RedisTrajectoryProducer(redis_client, run_id, cfg.buffer)
    eos = tokenizer.eos_token_id
    # the rule alone (math-verify in its worker processes), or weighted with a reward model
    scorer = build_scorer(cfg) or RewardPool(
        cfg.rollout.reward_workers, cfg.rollout.reward_timeout_s
    )
    ref_scorer = reference_scorer(cfg)  # π_ref log-probs of each group, on its way to the buffer
    ctl = RolloutController(
        clients,
        producer if ref_scorer is None else ScoredProducer(producer, ref_scorer),
        prompts.prompts,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        cfg.rollout,
        max_groups=target_groups(cfg),
        buffer_retry_s=cfg.buffer.retry_s,
        metrics_path=RunPaths.of(cfg).rollout,
        stop_token_ids=[eos] if eos is not None else [],
        weights_dir=cfg.inference.weights_dir,
        seed=cfg.data.seed,
        gpu_kinds=cfg.inference.gpu_kinds,
        # a killed predecessor's admissions come back once its lease expires
        settle_s=cfg.buffer.lease_ttl_s + 1.0,
        network=network_source(cfg, redis_client),
        final_version=final_version(cfg),
        phases=phases_for(
            cfg.workflow.placement,
            cfg.workflow.lent_servers,
            cfg.buffer.groups_per_step,
            server_requests(
                cfg.inference.max_running_requests,
                cfg.rollout.group_size,
                cfg.buffer.max_staleness > 0,
            ),
        ),
        rewards=scorer,
    )
    metrics = serve_metrics(cfg, ctl)
    freeze_startup()  # tokenizer, prompts, imports: out of every later collection
    trackers = open_run_trackers(cfg, "rollout")
    if trackers is not None:
        ctl.row_observers.append(trackers.observe)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctl.request_stop)
    try:
        log.info("%swaiting for the inference servers", STATUS_MARK)
        # the reward workers start (a spawn, math-verify's import) while the servers do
        n, _ = await asyncio.gather(wait_for_servers(ctl.dispatcher, cfg.rollout), scorer.start())
        log.info(
            "%s%d/%d inference servers healthy; producing %d groups of %d",
            STATUS_MARK,
            n,
            len(clients),
            ctl.max_groups,
            cfg.rollout.group_size,
        )
        final = await ctl.run()
        if ctl.sampling_exhausted and ctl.final_version is not None:
            raise SamplingExhausted(
                "dynamic sampling: rollout.dynamic_sampling_max_factor x the run's groups "
                "were produced and too few were kept (all rewards equal); the trainer cannot "
                "get its steps' worth: raise the factor, or warm-start the model further"
            )
        return final
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if metrics is not None:
            metrics.stop()
        if trackers is not None:
            trackers.close()
        await scorer.aclose()
        await give_back(producer)
        await producer.aclose()
        await redis_client.aclose()
        endpoint.close()
        await asyncio.gather(*[c.close() for c in clients], return_exceptions=True)
        if ref_scorer is not None:
            await ref_scorer.aclose()
