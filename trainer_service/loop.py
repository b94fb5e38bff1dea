"""The training loop: fetch, optimize, publish, checkpoint-then-acknowledge, log.

Exactly-once: rank 0 acknowledges a group only after a COMPLETE checkpoint containing
its update exists, and (but at the last step and at a stop) only once the next
checkpoint commits too: the groups of the newest checkpoint stay pending, so if that
checkpoint turns out corrupt on resume (checkpoint.choose_resume sets it aside), the
run falls back to the previous one and trains them once more. The ids are stored in
the markers and acknowledged again on resume (XACK is idempotent), which covers a crash
between commit and ack. Groups trained after the last commit stay pending in the
buffer: a restarted trainer rolls the weights back to the checkpoint and receives them
again, so each group ends up in the committed weights exactly once. Within a run, a
pending group delivered a second time (reclaimed while waiting for a commit) is skipped.

A trainer with no checkpoint to resume from (killed before its first) whose buffer is
past version 0 rejoins the run the same way at version 0: the buffer's version and gate
are restored and the servers reload v0, so groups made by the lost weights' versions
are dropped (counted, and owed to the controller) rather than trained into the fresh
model.

Stopping (SIGTERM / Ctrl-C, `request_stop`): rank 0 stops waiting for a batch, every
rank leaves the loop after the step under way, and a checkpoint of the last completed
step is written (its groups acknowledged), so a resume loses no work.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_hex.api import Batch, TrajectorySource
from areal_hex.config.algo import AlgoConfig
from areal_hex.config.trainer import TrainerConfig
from areal_hex.heap import trim_heap
from areal_hex.run_files import RunPaths, TrainerRow, append_row, version_dir
from trainer_service import checkpoint
from trainer_service.critic import CHECKPOINT_TAG as CRITIC_TAG
from trainer_service.publish import AsyncPublisher, NetworkSink, Redelivery, full_state_dict
from trainer_service.step import StepContext, StepResult, optimize


@dataclass
class TrainerPaths:
    model_dir: Path  # initial HF model dir: config and tokenizer files are copied from it
    run_dir: Path
    weights_dir: Path
    checkpoint_dir: Path


@dataclass
class Totals:
    groups_trained_total: int = 0
    groups_dropped_stale_total: int = 0
    dead_letter_total: int = 0
    degenerate_groups_total: int = 0
    tokens_total: int = 0


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    totals: Totals = field(default_factory=Totals)
    unacked: list[str] = field(default_factory=list)  # trained since the last commit
    # in the newest commit, acknowledged once the next one commits (a fallback target)
    committed_pending: list[str] = field(default_factory=list)


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        algo: AlgoConfig,
        paths: TrainerPaths,
        ctx: StepContext,
        groups_per_step: int,
        consumer: TrajectorySource | None,
        seed: int = 0,
        network: NetworkSink | None = None,
        trim_heap: bool = False,
    ) -> None:
        """`network`: rank 0 publishes each version over the network instead of to disk.
        `trim_heap`: give the freed heap back to the OS after each step (the trainer shares
        its devices with generation, which runs next)."""
        self.cfg, self.algo, self.paths, self.ctx = cfg, algo, paths, ctx
        self.trim_heap = trim_heap
        self.groups_per_step = groups_per_step
        self.seed = seed
        self.consumer = consumer  # rank 0 only
        self.rank = ctx.rank
        self.state = TrainerState()
        self.publisher: AsyncPublisher | None = None
        if self.rank == 0:
            paths.weights_dir.mkdir(parents=True, exist_ok=True)
            self.publisher = AsyncPublisher(
                paths.weights_dir, paths.model_dir, cfg.keep_versions, self._announce, network
            )
        self.metrics_path = RunPaths.at(paths.run_dir).metrics
        # called with every step row rank 0 writes (e.g. the Prometheus collector)
        self.row_observers: list[Callable[[TrainerRow], None]] = []
        if self.publisher is not None:
            ctx.before_update = self.publisher.wait
        self._stop = threading.Event()
        self.committed_log = RunPaths.at(paths.run_dir).committed
        self.redelivery = Redelivery()

    def request_stop(self) -> None:
        """Finish the step under way, checkpoint it and return from `run` (signal-safe)."""
        self._stop.set()

    @property
    def stopped_early(self) -> bool:
        return self.state.step < self.cfg.total_steps

    # ------------------------------------------------------------ lifecycle
    def run(self) -> TrainerState:
        self.resume()
        while self.state.step < self.cfg.total_steps:
            if self.train_step() is None:
                break
        if self.stopped_early:
            self._checkpoint()  # the last completed step, so a resume loses nothing
        if self.publisher is not None:
            self.publisher.wait()
        return self.state

    def resume(self) -> None:
        """Restore the newest intact checkpoint, or start at version 0 without one; either
        way the buffer is brought back to this version (`_republish`)."""
        path = self._choose_checkpoint()
        if path is None:
            if self._versions_lost():
                if self.consumer is not None:
                    checkpoint.rollback(self.committed_log, 0)  # every commit was lost
                self._republish()
            return
        saved = checkpoint.load(self.ctx.engine, path, self._extra_engines())
        self.state.step, self.state.version = saved["step"], saved["version"]
        self.state.totals = Totals(**saved["totals"])
        if self.rank == 0:
            print(f"trainer: resumed from {path} (step {self.state.step})", flush=True)
        if self.consumer is not None:
            # verified just now and holding these updates: they may leave the buffer
            # (re-read, they would be dropped as stale while counted as trained)
            checkpoint.record_committed(self.committed_log, saved["step"], saved["ack_ids"])
            self.consumer.ack([*saved.get("held_ids", []), *saved["ack_ids"]])
            position = saved.get("data_position", saved.get("replay_position"))
            if position is not None:
                self.consumer.seek(position)
        self._republish()

    def _extra_engines(self) -> dict[str, Any]:
        """Engines checkpointed beside the policy's: the critic's, with GAE."""
        if self.ctx.critic is None:
            return {}
        return {CRITIC_TAG: self.ctx.critic}

    def _versions_lost(self) -> bool:
        """No checkpoint, yet the buffer is past version 0: a trainer before this one
        published versions that died with it (a fresh run has nothing to rejoin)."""
        import torch.distributed as dist

        lost = [self.consumer is not None and self.consumer.version() > 0]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(lost, src=0)
        return bool(lost[0])

    def _choose_checkpoint(self) -> Path | None:
        """Rank 0 verifies the checkpoints (setting a corrupt newest one aside) and tells
        every rank which one to load."""
        import torch.distributed as dist

        chosen: list[str | None] = [None]
        if self.rank == 0:
            found = checkpoint.choose_resume(
                self.cfg.resume, self.paths.checkpoint_dir, lambda m: print(m, flush=True)
            )
            chosen[0] = None if found is None else str(found)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(chosen, src=0)
        return None if chosen[0] is None else Path(chosen[0])

    def _republish(self) -> None:
        """Announce the restored weights as the current version: written first if missing
        (disk; v0 without a checkpoint is the initial model), or broadcast to the servers
        once the version is restored (network)."""
        import torch.distributed as dist

        v = self.state.version
        target = version_dir(self.paths.weights_dir, v)
        if v == 0 and not (target / "config.json").is_file():
            target = self.paths.model_dir
        network = self.publisher is not None and self.publisher.network is not None
        missing = [network or not (target / "config.json").is_file()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(missing, src=0)
        tensors = None
        if missing[0]:
            tensors = full_state_dict(self.ctx.engine, self.cfg.zero_stage, self.rank)
        if self.publisher is not None and tensors is not None and not network:
            self.publisher.publish_now(v, tensors, announce=False)
        if self.rank == 0 and self.consumer is not None and not network:
            # also restores the gate's admission count
            self.consumer.restore(v, str(target.resolve()))
        if self.publisher is not None and tensors is not None and network:
            # restored once the new manifest is left: the controller reads the new group,
            # never the manifest of a trainer before this one
            consumer = self.consumer
            restore = None if consumer is None else consumer.restore
            self.publisher.publish_now(v, tensors, via=restore)

    def _maybe_redeliver(self) -> None:
        """Rank 0, waiting for a batch with network weight sync: send the current version
        again over a new group when it is due (`Redelivery`); the buffer's version is
        restored to it once the new manifest is left (a new lineage), so that the
        controller has every server join the new group and load it, the restarted ones
        included. Under ZeRO-3 the
        weights are gathered collectively, which rank 0 cannot do alone: not there."""
        pub = self.publisher
        sink = pub.network if pub is not None else None
        now = time.monotonic()
        if sink is None or self.consumer is None or not self.redelivery.due(sink, now):
            return
        if self.cfg.zero_stage == 3:
            return
        assert pub is not None
        pub.wait()  # a publication under way may deliver it yet
        if not self.redelivery.due(sink, time.monotonic()):
            return
        tensors = full_state_dict(self.ctx.engine, self.cfg.zero_stage, self.rank)
        if tensors is None:
            return
        v = self.state.version
        why = (
            "not delivered"
            if sink.undelivered is not None
            else "a server is not in the group"
            if sink.regroup_wanted()
            else "no group for long"
        )
        print(f"trainer: sending weights v{v} again over the network ({why})", flush=True)
        sink.regroup()  # never the group the servers may hold it from already
        pub.publish_now(v, tensors, via=self.consumer.restore)
        self.redelivery.sent(time.monotonic())

    def _announce(self, version: int, path: str) -> None:
        if self.consumer is not None:
            self.consumer.set_version(version, path)

    # ------------------------------------------------------------ one step
    def train_step(self) -> dict[str, Any] | None:
        """One optimizer step; None (nothing done) when a stop came while waiting."""
        t0 = time.perf_counter()
        batch = self._fetch()
        if batch is None:
            return None
        t1 = time.perf_counter()
        self.ctx.version = self.state.version
        self.ctx.step = self.state.step
        result = optimize(self.ctx, batch.groups)
        t2 = time.perf_counter()
        st = self.state
        st.step += 1
        st.version = st.step
        tot = st.totals
        tot.groups_trained_total += len(batch.groups)
        tot.groups_dropped_stale_total += batch.groups_dropped_stale
        tot.dead_letter_total += batch.dead_lettered
        tot.degenerate_groups_total += result.degenerate_groups
        tot.tokens_total += result.num_tokens
        st.unacked.extend(batch.entry_ids)
        publish_s = self._maybe_publish()
        t3 = time.perf_counter()
        ckpt_s = self._maybe_checkpoint()
        t4 = time.perf_counter()
        if self.trim_heap:
            trim_heap()
        compute_s = t2 - t1 + time.perf_counter() - t4  # the heap given back is the step's work
        row = self._metrics(batch, result, wait_s=t1 - t0, compute_s=compute_s, publish_s=t3 - t2)
        # time the step waited for the previous weight write (before its optimizer step)
        row.publish_wait_s = publish_s + result.extra.get("publish_fence_s", 0.0)
        after = result.extra.get("after_fence_s")
        if after is not None and self.publisher is not None:
            row.write_s = self.publisher.last_write_s or None  # the write it waited on
            row.write_delay_s = self.publisher.last_start_delay_s
            # with this step's state dict and the hand-on of its own write
            row.after_fence_s = after + max(0.0, t3 - t2 - publish_s)
        row.checkpoint_s = ckpt_s
        if self.rank == 0:
            append_row(self.metrics_path, row)
            for observe in self.row_observers:
                observe(row)
        return row.model_dump()

    def _fetch(self) -> Batch | None:
        """Rank 0 takes B fresh groups from the consumer; every rank gets the batch, or
        None when rank 0 was asked to stop while waiting for it."""
        import torch.distributed as dist

        payload: list[Batch | None] = [None]
        if self.rank == 0 and not self._stop.is_set():
            taken = self._take(self.groups_per_step)
            payload[0] = None if taken is None else self._canonical_order(taken)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def _canonical_order(self, b: Batch) -> Batch:
        """Stream order, then a shuffle seeded by the step: the same groups give the same
        minibatches after a restart (the buffer's own shuffle is not reproducible)."""
        import random

        def key(i: int) -> tuple[int, ...]:
            return tuple(int(x) for x in b.entry_ids[i].split("-") if x.isdigit())

        order = sorted(range(len(b.groups)), key=key)
        random.Random(self.seed * 1_000_003 + self.state.step).shuffle(order)
        return Batch(
            entry_ids=[b.entry_ids[i] for i in order],
            groups=[b.groups[i] for i in order],
            groups_dropped_stale=b.groups_dropped_stale,
            dead_lettered=b.dead_lettered,
            version_lags=[b.version_lags[i] for i in order],
        )

    def _take(self, n: int) -> Batch | None:
        """B fresh groups not trained since the last commit; None if a stop came first.
        Waits in short reads so a stop is noticed; `batch_timeout_s` bounds the wait."""
        assert self.consumer is not None
        seen = set(self.state.unacked) | set(self.state.committed_pending)
        out = Batch(entry_ids=[], groups=[])
        limit = self.cfg.batch_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        while len(out.groups) < n:
            if self._stop.is_set():
                return None
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            try:
                # the lags count from the weights this batch trains: their publication
                # may still be being written, the version it announces behind them
                b = self.consumer.get_batch(
                    n - len(out.groups), timeout_s=max(wait, 0.0), version=self.state.version
                )
            except TimeoutError as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"trainer: no batch for step {self.state.step + 1} after {limit:g} s "
                        f"(trainer.batch_timeout_s): {exc}"
                    ) from None
                self._maybe_redeliver()
                continue  # what was read so far is kept by the consumer
            if b.groups:
                self.redelivery.group_arrived(time.monotonic())
            out.groups_dropped_stale += b.groups_dropped_stale
            out.dead_lettered += b.dead_lettered
            stal = b.version_lags or [self.state.version - g.version for g in b.groups]
            for eid, g, s in zip(b.entry_ids, b.groups, stal, strict=True):
                if eid in seen:  # trained already, waiting for its commit
                    continue
                seen.add(eid)
                out.entry_ids.append(eid)
                out.groups.append(g)
                out.version_lags.append(int(s))
        return out

    def _maybe_publish(self) -> float:
        if self.state.step % self.cfg.publish_every and self.state.step != self.cfg.total_steps:
            return 0.0
        tensors = full_state_dict(self.ctx.engine, self.cfg.zero_stage, self.rank)
        if self.publisher is None or tensors is None:
            return 0.0
        return self.publisher.submit(self.state.version, tensors)

    def _maybe_checkpoint(self) -> float:
        st = self.state
        if st.step % self.cfg.checkpoint_every and st.step != self.cfg.total_steps:
            return 0.0
        return self._checkpoint()

    def _checkpoint(self) -> float:
        """Commit the current step (collective), then acknowledge the groups of the commit
        before (and, at the last step or a stop, its own). Nothing is written when no
        group was trained since the last commit (or the resume)."""
        st = self.state
        if not st.unacked and st.step != self.cfg.total_steps:
            return 0.0
        t0 = time.perf_counter()
        saved = {
            "step": st.step,
            "version": st.version,
            "totals": st.totals.__dict__,
            "ack_ids": list(st.unacked),
            "held_ids": list(st.committed_pending),  # acknowledged right after this commit
        }
        if self.consumer is not None and self.consumer.position() is not None:
            saved["data_position"] = self.consumer.position()
        checkpoint.save(
            self.ctx.engine,
            self.paths.checkpoint_dir,
            st.step,
            saved,
            self.cfg.keep_checkpoints,
            self._extra_engines(),
        )
        if self.consumer is not None:
            checkpoint.record_committed(self.committed_log, st.step, st.unacked)
            # in two commits now (or the run ends): they may leave the buffer
            last = st.step == self.cfg.total_steps or self._stop.is_set()
            done = st.committed_pending + (st.unacked if last else [])
            self.consumer.ack(done)
            st.committed_pending = [] if last else list(st.unacked)
        st.unacked = []
        return time.perf_counter() - t0

    # ------------------------------------------------------------ metrics
    def _metrics(
        self, batch: Batch, r: StepResult, wait_s: float, compute_s: float, publish_s: float
    ) -> TrainerRow:
        import numpy as np

        rewards = np.concatenate([g.rewards for g in batch.groups]) if batch.groups else []
        tokens = max(r.sums["tokens"], 1.0)
        hist = Counter(str(s) for s in batch.version_lags)
        return TrainerRow(
            step=self.state.step,
            version=self.state.version,
            time=time.time(),
            loss=r.sums["loss"],
            reward_mean=float(np.mean(rewards)) if len(rewards) else 0.0,
            adv_mean=float(r.advantages.mean()) if r.advantages.size else 0.0,
            adv_std=float(r.advantages.std()) if r.advantages.size else 0.0,
            clip_frac=r.sums["clipped"] / tokens,
            dual_clip_frac=r.sums["dual_clipped"] / tokens,
            behav_weight_mean=r.sums["behav_w"] / tokens,
            behav_weight_max=r.maxima["behav_w_max"],
            behav_masked_frac=r.sums["behav_masked"] / tokens,
            entropy=r.sums["entropy"] / tokens,
            kl=r.sums["kl"] / tokens,
            grad_norm=r.grad_norm,
            lr=float(self.ctx.engine.get_lr()[0]),
            version_lag_hist=dict(hist),
            mismatch=r.extra.get("mismatch", {}),
            drift_by_lag=r.extra.get("drift_by_lag", {}),
            max_version_lag=max(batch.version_lags, default=0),
            degenerate_groups=r.degenerate_groups,
            sequences=r.num_sequences,
            completion_tokens=int(r.sums["tokens"]),
            tokens=r.num_tokens,
            tokens_per_s=r.num_tokens / max(compute_s, 1e-9),
            wait_s=wait_s,
            compute_s=compute_s,
            own_tokens_per_s=r.extra.get("own_tokens_per_s", 0.0),
            publish_s=publish_s,
            **r.extra.get("critic", {}),
            **self.state.totals.__dict__,
        )
