"""`profile --local`, generation: an `areal-hex serve` process on the inference cores,
driven over HTTP as the run's controller drives it: decode step time at several batches
(from two answer lengths, so the prefill cancels), prefill tokens/s, the answer lengths
the initial policy really produces on the dataset's prompts with the run's sampling
parameters, a weight update's pause, and the rate the run's own controller keeps the
server at (beside the trainer and beside it, `controller.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from areal_hex.config import ExperimentConfig
from hexctl.profile.controller import (
    Reloads,
    broadcaster,
    continuous_load,
    filled,
    idle_updates,
    load_batch,
    round_overlaps,
    sync_cycle,
)
from hexctl.profile.devices import REPEATS, LocalDevices, Say, pinned, quiet
from hexctl.profile.lengths import Scorer, rewarded_mean, rule_scorer
from hexctl.profile.scoring import measure_classify, scoring_concurrency, scoring_window_s
from hexctl.profile.server import serve_config, server_process

WAVE_TIMEOUT_S = 600.0  # one timed call to the server, at most
IDLE_UPDATES = 9  # a synchronous run's network updates timed on a box node
MAX_DECODE_PAIRS = 60  # pairs of waves per decode step, at most, with a min_decode_s
ANSWERED_PROMPTS = 16  # prompts whose G answers' lengths (and rewards) the profile takes


@dataclass
class GenerationRates:
    decode_step_s: dict[int, float]
    prefill_tokens_per_s: float
    prompt_tokens: float  # mean over the dataset's prompts
    response_tokens: float  # mean answer length of the initial policy
    reload_s: float  # pause -> load -> resume of a server with requests in flight
    reload_idle_s: float  # the same with nothing in flight (a synchronous run's case)
    # The run's own controller keeping the server full (an asynchronous run's load):
    continuous_samples_per_s: float  # samples/s generated
    host_cpu_s_per_sample: float  # the controller's CPU (HTTP, decoding, rewards, records; Valkey)
    # ... with the controller, its Valkey and reward workers on the server's cores
    # (None without pinning: they share every core anyway)
    continuous_shared_samples_per_s: float | None
    reload_shared_s: float | None  # a weight update's pause under that load
    # ... and as a synchronous run drives it: a trainer that only publishes a version and
    # takes the next batch; seconds from the publish to the whole batch (median)
    sync_cycle_s: float
    # seconds of an update's pause in which the load still generated (`reload_overlap_s`;
    # measured on a box node only): the median, and each round's; and each round's
    # median pause (the controller's update under that load)
    reload_overlap_s: float | None = None
    reload_overlaps_s: list[float] | None = None
    reload_under_load_s: list[float] | None = None
    # prompt + completion tokens/s scored as the controller scores a group at a reference
    # task (`_Driver.score_rate`): one request at a time, and with as many in flight as
    # the run keeps there (`scoring.scoring_concurrency`)
    score_tokens_per_s: float | None = None
    score_concurrent_tokens_per_s: float | None = None
    score_concurrency: int | None = None
    # the same of the job's reward model on its `/classify` route (`scoring.py`); None
    # where the job has no reward-model task
    classify_tokens_per_s: float | None = None
    classify_concurrency: int | None = None
    # each round's samples/s without and with updates (the latter while generating)
    continuous_rounds_samples_per_s: list[float] | None = None
    # the batch those loads held the server at (`load_batch`); and where the kind's batch
    # limit is larger, the same load with the groups that fill it (`filled`): its
    # samples/s (the median of its rounds, each beside a plain round) and its batch
    continuous_batch: int | None = None
    continuous_full_samples_per_s: float | None = None
    continuous_full_batch: int | None = None
    reload_rounds_samples_per_s: list[float] | None = None
    reload_under_load_sync: str | None = None  # how those updates went: disk | network
    # over the network, the same updates with nothing in flight (a synchronous run's)
    reload_idle_network_s: list[float] | None = None
    # one context switch of a placement that shares devices, as the controller makes it
    # (colocate.py: pause, release, resume, continue), nothing in flight; the median
    context_switch_s: float | None = None
    # mean length of the initial policy's answers that the job's rule reward rewards
    # (`lengths.py`); None where none is, or the reward is not the rule
    rewarded_response_tokens: float | None = None


def measure_generation(
    cfg: ExperimentConfig,
    model_dir: Path,
    dev: LocalDevices,
    batches: list[int],
    say: Say = quiet,
) -> GenerationRates:
    """An `areal-hex serve` process on the inference cores, driven over HTTP from this
    process on the trainer cores, where `run` puts the controller: the server's HTTP
    handling and the client's work are in the figures, as they are in a run."""
    from rollout_service.controller.wiring import load_prompt_set

    cfg, tok, prompts = job_prompts(cfg, model_dir)
    score = rule_scorer(cfg, tok, load_prompt_set(cfg, tok).prompts)
    serve = serve_config(cfg, model_dir, dev)
    with tempfile.TemporaryDirectory(prefix="areal-hex-profile-") as tmp:
        path = Path(tmp) / "serve.yaml"
        path.write_text(yaml.safe_dump(serve))
        say(f"starting an inference server; then decode steps at batches {batches}")
        with server_process(path, dev, Path(tmp) / "serve.log") as (url, pid):
            with pinned(dev.trainer_cores, 1):
                eos = tok.eos_token_id
                timing = (dev.repeats, dev.min_decode_s, scoring_window_s(dev))
                gen = asyncio.run(
                    _generation(url, cfg, prompts, eos, batches, model_dir, *timing, score)
                )
                say("decode, prefill and reload timed; a synchronous run's cycle")
                gen.sync_cycle_s = asyncio.run(sync_cycle(url, cfg, model_dir))
            # the controller beside the trainer, then beside the server, alternated: a
            # load that a neighbour slows moves one median, not the choice between them
            alone, shared, updated, full = [], [], [], []
            full_cfg = filled(cfg)
            window = dev.min_window_s
            # a box node's updates go as the run's will: from disk or over the network
            # (a rank 0 in the node's namespace, so no shaped link is in the pause)
            updates = Reloads(
                sync=cfg.rollout.weight_sync,
                netns=dev.netns,
                address=dev.address,
                bucket_mb=cfg.rollout.weight_sync_bucket_mb,
            )
            networked = dev.cgroup is not None and updates.sync == "network"
            rank0 = broadcaster(model_dir, updates) if networked else contextlib.nullcontext()
            n = dev.repeats
            with rank0 as sender:  # one rank 0 for every round
                for k in range(n):
                    say(f"the run's controller keeping the server busy, round {k + 1}/{n}")
                    with pinned(dev.trainer_cores, 1):
                        load = continuous_load(url, cfg, model_dir, {pid}, min_window_s=window)
                        alone.append(asyncio.run(load))
                        if full_cfg is not None:
                            load = continuous_load(
                                url, full_cfg, model_dir, {pid}, min_window_s=window
                            )
                            full.append(asyncio.run(load)[0])
                    if dev.cgroup is not None:  # a box node: the same with updates, right after
                        load = continuous_load(
                            url, cfg, model_dir, {pid}, updates, window, rank0=sender
                        )
                        rate, _, pause = asyncio.run(load)
                        updated.append((rate, pause))
                    if dev.inference_cores is not None:
                        with pinned(dev.inference_cores, 1):
                            load = continuous_load(
                                url, cfg, model_dir, {pid}, reloads=Reloads(), min_window_s=window
                            )
                            shared.append(asyncio.run(load))
                if networked:
                    say("a synchronous run's updates over the network, nothing in flight")
                    idle = idle_updates(url, cfg, model_dir, sender, IDLE_UPDATES)
                    gen.reload_idle_network_s = asyncio.run(idle)
            gen.continuous_samples_per_s = statistics.median(r for r, _, _ in alone)
            gen.continuous_batch = load_batch(cfg)
            if full_cfg is not None and full:
                gen.continuous_full_samples_per_s = statistics.median(full)
                gen.continuous_full_batch = load_batch(full_cfg)
            overlaps = round_overlaps([r for r, _, _ in alone], updated)
            if overlaps:
                gen.reload_overlap_s = statistics.median(overlaps)
                gen.reload_overlaps_s = overlaps
                gen.reload_under_load_s = [p for _, p in updated if p is not None]
                gen.reload_under_load_sync = updates.sync
                gen.continuous_rounds_samples_per_s = [r for r, _, _ in alone]
                gen.reload_rounds_samples_per_s = [r for r, _ in updated]
            # the least of the rounds: a neighbour's load only adds to a round's CPU a
            # sample (the controller's timers and polls at a lower rate, its caches
            # taken), never takes from it
            gen.host_cpu_s_per_sample = min(c for _, c, _ in alone)
            if shared:
                gen.continuous_shared_samples_per_s = statistics.median(r for r, _, _ in shared)
                pauses = [p for _, _, p in shared if p is not None]
                gen.reload_shared_s = statistics.median(pauses) if pauses else None
    # the reward model on its own server, once the generation server has stopped
    classify = measure_classify(cfg, dev, prompts, gen.response_tokens, tok, server_process, say)
    if classify is not None:
        gen.classify_tokens_per_s, gen.classify_concurrency = classify
    return gen


class _Driver:
    """Sends work to the server as the controller does: one batched call per group."""

    def __init__(
        self,
        client: Any,
        cfg: ExperimentConfig,
        prompts: list[list[int]],
        min_decode_s: float = 0.0,
        min_window_s: float = 0.0,  # seconds a round of scoring requests lasts, at least
    ) -> None:
        import random

        self.client, self.r, self.prompts = client, cfg.rollout, prompts
        self.min_decode_s, self.min_window_s = min_decode_s, min_window_s
        self.g = cfg.rollout.group_size
        self.rng = random.Random(0)
        self.answered: list[tuple[list[int], list[int]]] = []  # by `answer_length`

    def groups(self, n: int) -> list[list[int]]:
        """`n` samples in groups of G sharing a prompt."""
        out: list[list[int]] = []
        while len(out) < n:
            out += [self.rng.choice(self.prompts)] * min(self.g, n - len(out))
        return out

    def fixed(self, n: int) -> Any:
        from areal_hex.api import SamplingParams

        return SamplingParams(max_new_tokens=n, temperature=self.r.temperature, ignore_eos=True)

    async def wave(self, work: list[list[int]], sp: Any) -> tuple[float, list]:
        t0 = time.perf_counter()
        chunks = [work[i : i + self.g] for i in range(0, len(work), self.g)]
        calls = [
            self.client.generate_batch(c, sp, [f"p{t0}-{i}-{j}" for j in range(len(c))])
            for i, c in enumerate(chunks)
        ]
        outs = await asyncio.gather(*calls)
        return time.perf_counter() - t0, [o for out in outs for o in out]

    async def answer_length(self, eos: int | None) -> float:
        """Mean answer length: G samples of a few prompts, sampled as the run samples."""
        from areal_hex.api import SamplingParams

        r = self.r
        sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=[eos] if eos is not None else [],
        )
        picked = self.rng.sample(self.prompts, min(ANSWERED_PROMPTS, len(self.prompts)))
        work = [p for p in picked for _ in range(self.g)]
        _, outs = await self.wave(work, sampling)
        self.answered = [(p, list(o.output_ids)) for p, o in zip(work, outs, strict=True)]
        return statistics.fmean(len(o.output_ids) for o in outs)

    async def decode_step(self, batch: int) -> float:
        """Seconds per decode step at `batch`: two answer lengths, the prefill cancels.
        A pair whose long wave was not longer than its short one (the machine stalled
        the short one) says nothing and is measured again, up to REPEATS more times;
        without any usable pair, the long wave's time per token (prefill included: an
        upper bound) stands in. With `min_decode_s`, pairs are timed until their steps
        add up to it (at most MAX_DECODE_PAIRS) and the step is their total over their
        steps: a quota's period shifts each pair's few steps, and cancels in the sum."""
        long_n = max(8, self.r.max_new_tokens)
        short_n = max(2, long_n // 4)
        diffs: list[float] = []
        per_token: list[float] = []
        tries = max(2 * REPEATS, MAX_DECODE_PAIRS if self.min_decode_s > 0 else 0)
        for _ in range(tries):
            work = self.groups(batch)
            t_long, _ = await self.wave(work, self.fixed(long_n))
            t_short, _ = await self.wave(work, self.fixed(short_n))
            per_token.append(t_long / long_n)
            # a step shorter than a tenth of the long wave's time per token is noise
            if t_long - t_short > 0.1 * t_long * (long_n - short_n) / long_n:
                diffs.append(t_long - t_short)
            if len(diffs) >= REPEATS and sum(diffs) >= self.min_decode_s:
                break
        if not diffs:
            return statistics.median(per_token)
        if self.min_decode_s > 0:
            return sum(diffs) / (len(diffs) * (long_n - short_n))
        return statistics.median(diffs) / (long_n - short_n)

    async def prefill_rate(self, batch: int, step_s: float) -> float:
        """Prompt tokens/s, one prompt per group (the group shares its prefill)."""
        rates = []
        for _ in range(REPEATS):
            work = self.groups(batch)
            t, _ = await self.wave(work, self.fixed(1))
            rates.append(sum(len(p) for p in work[:: self.g]) / max(1e-9, t - step_s))
        return statistics.median(rates)

    async def score_rate(self, response: int, concurrency: int = 1) -> float:
        """Prompt + completion tokens/s of groups scored one request each, as the
        controller scores a finished group at a reference task (`scoring_request`: G
        sequences of a prompt and `response` tokens, no token generated), with
        `concurrency` requests in flight (`scoring.timed_rounds`)."""
        from hexctl.profile.scoring import timed_rounds
        from rollout_service.controller.reference import scoring_request

        async def send(k: int) -> int:
            gid = f"score-{concurrency}-{k}"
            group, prompt = self.scoring_group(gid, response)
            await self.client.generate_raw(scoring_request(group, range(self.g), gid))
            return self.g * (len(prompt) + response)

        await timed_rounds(send, concurrency, 1)  # warm-up at this concurrency
        return await timed_rounds(send, concurrency, REPEATS, self.min_window_s)

    def scoring_group(self, gid: str, response: int) -> tuple[Any, list[int]]:
        """A finished group of G random completions of `response` tokens to one prompt."""
        import numpy as np

        from areal_hex.record import Completion, GroupRecord

        prompt = self.rng.choice(self.prompts)
        comps = [
            Completion(
                token_ids=np.array([self.rng.randrange(5, 100) for _ in range(response)]),
                logprobs=np.zeros(response),
                versions=np.zeros(response, dtype=np.int64),
                finish_reason="length",
                reward=0.0,
            )
            for _ in range(self.g)
        ]
        return GroupRecord(gid, np.array(prompt), comps, self.r.temperature), prompt

    async def reload(self, model_dir: Path, version: int, batch: int) -> float:
        """One weight update as the controller makes it (pause in the run's
        `rollout.update_pause` mode, retract for auto, load, resume), while `batch`
        samples generate (0: an idle server); the pause's length. An in-place pause
        keeps the requests' KV cache, so its length is not a retract's."""
        work = self.groups(batch)
        long_n = max(8, self.r.max_new_tokens)
        task = asyncio.create_task(self.wave(work, self.fixed(long_n))) if work else None
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        mode = self.r.update_pause if self.r.update_pause == "in_place" else "retract"
        await self.client.pause(mode)
        await self.client.update_weights_from_disk(
            str(model_dir), version, abort_all_requests=False
        )
        await self.client.resume()
        took = time.perf_counter() - t0
        if task is not None:
            await task
        return took

    async def context_switch(self) -> float:
        """One switch of a colocated step, as `colocate.py` makes it: the idle server
        pauses (abort), releases its memory, takes it back and continues; its length."""
        t0 = time.perf_counter()
        await self.client.pause("abort")
        await self.client.release_memory_occupation()
        await self.client.resume_memory_occupation()
        await self.client.resume()
        return time.perf_counter() - t0


async def _generation(
    url: str,
    cfg: ExperimentConfig,
    prompts: list[list[int]],
    eos: int | None,
    batches: list[int],
    model_dir: Path,
    repeats: int = REPEATS,
    min_decode_s: float = 0.0,
    min_window_s: float = 0.0,
    score: Scorer | None = None,
) -> GenerationRates:
    from rollout_service.client import InferenceClient

    # a request unanswered for WAVE_TIMEOUT_S is a stuck server: an error, not a wait
    async with InferenceClient(url, timeout_s=WAVE_TIMEOUT_S) as client:
        await client.wait_healthy(timeout_s=180, interval_s=0.2)
        d = _Driver(client, cfg, prompts, min_decode_s, min_window_s)
        await d.wave([prompts[0]], d.fixed(4))  # warm-up: first-call allocations
        response = await d.answer_length(eos)
        rewarded = rewarded_mean(d.answered, score)
        steps = {b: await d.decode_step(b) for b in batches}
        top = max(batches)
        prefill = await d.prefill_rate(top, steps[top])
        score = await d.score_rate(round(response))
        many = scoring_concurrency(
            cfg.rollout.max_concurrent_groups, cfg.inference.max_running_requests, d.g
        )
        score_many = await d.score_rate(round(response), many) if many > 1 else score
        versions = range(1, repeats + 1)
        busy = [await d.reload(model_dir, 2 * v, top) for v in versions]
        idle = [await d.reload(model_dir, 2 * v + 1, 0) for v in versions]
        switches = [await d.context_switch() for _ in range(max(5, repeats))]
    return GenerationRates(
        decode_step_s=steps,
        prefill_tokens_per_s=prefill,
        score_tokens_per_s=score,
        score_concurrent_tokens_per_s=score_many,
        score_concurrency=many,
        prompt_tokens=statistics.fmean(len(p) for p in prompts),
        response_tokens=response,
        reload_s=statistics.median(busy),
        reload_idle_s=statistics.median(idle),
        continuous_samples_per_s=0.0,
        continuous_shared_samples_per_s=None,
        reload_shared_s=None,
        host_cpu_s_per_sample=0.0,
        sync_cycle_s=0.0,
        context_switch_s=statistics.median(switches),
        rewarded_response_tokens=rewarded,
    )


def job_prompts(cfg: ExperimentConfig, model_dir: Path) -> tuple[ExperimentConfig, Any, list]:
    """(`cfg` on the model in `model_dir`, its tokenizer, the dataset's prompts' ids)."""
    from rollout_service.controller.wiring import load_prompt_set, load_rollout_tokenizer

    cfg = cfg.model_copy(deep=True)
    cfg.model.path = str(model_dir)
    cfg.model.tokenizer_path = None
    tok = load_rollout_tokenizer(cfg)
    return cfg, tok, [p.input_ids for p in load_prompt_set(cfg, tok).prompts]
