"""Measured rates (`areal-hex profile`) that replace the analytic estimates in `plan`.

A profile holds, per device kind, decode step times at several batch sizes, prefill
tokens/s and training tokens/s per device, all for one model. `plan --profile` uses them
for the matching GPU kind (the cluster spec names the kind, e.g. `H100`, or `CPU` with
its figures in `gpu_overrides`) and keeps the analytic model for kinds not measured.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field

from areal_hex.config import ConfigError
from areal_hex.config.base import Section, build, read_yaml

# `DeviceRates.device` of a kind profiled inside a box node (`profile --box`)
BOX_DEVICE = "box"


class EveryCore(Section):
    """Generation and training of one device kind timed on every core of the host, as a
    colocated run gives each phase (`hexctl/profile/every_core.py`)."""

    decode_step_s: dict[int, float]  # batch -> seconds per decode step, one server
    prefill_tokens_per_s: float = Field(gt=0)
    train_tokens_per_s: float = Field(gt=0)
    inference_threads: int = Field(ge=1)  # each server's, as the colocated run starts it
    trainer_threads: int = Field(ge=1)


class DeviceRates(Section):
    device: str  # what torch reported, e.g. "cpu" or "NVIDIA H100 80GB HBM3"; "box": a box node
    decode_step_s: dict[int, float]  # batch -> seconds per decode step (mean context)
    decode_context: int = Field(gt=0)  # context length the decode steps were timed at
    prefill_tokens_per_s: float = Field(gt=0)
    # Tokens/s of prompt + completion scored as a reference task scores them (`profile
    # --local`, `--box`): one request per group, its G sequences whole, no token generated.
    # Prices reference and reward-model tasks on this kind (`task_costs.instance_rate`).
    score_tokens_per_s: float | None = Field(None, gt=0)
    # ... with as many requests in flight as the run's controller keeps there
    # (`score_concurrency`: its groups in flight, no more than the engine's batch limit
    # holds whole): an engine that batches concurrent requests scores faster than one at
    # a time. Prices the tasks where measured (`scoring_tokens_per_s`).
    score_concurrent_tokens_per_s: float | None = Field(None, gt=0)
    score_concurrency: int | None = Field(None, gt=0)
    # The job's reward model (its own model, not the actor) on its `/classify` route,
    # prompt + completion tokens/s at `classify_concurrency` groups in flight: prices a
    # reward-model task on this kind as measured, with no scaling by FLOPs.
    classify_tokens_per_s: float | None = Field(None, gt=0)
    classify_concurrency: int | None = Field(None, gt=0)
    train_tokens_per_s: float = Field(gt=0)  # forward + backward + optimizer, one device
    # ... with no weight write beside the step (`profile --box`: rounds that publish
    # nothing, between the others): a synchronous run's step, whose write ends while it
    # waits for its next batch; unmeasured: `train_tokens_per_s`
    train_sync_tokens_per_s: float | None = Field(None, gt=0)
    # ... with each step giving its freed heap back to the OS after the publish, as a
    # trainer that shares its devices with generation does (`areal_hex/heap.py`:
    # the trim and the next step's taking the pages again; `profile --local` on a CPU
    # device). A hybrid run's trainer steps at it (`with_heap_trim`); unmeasured: as
    # `train_tokens_per_s`
    train_trim_tokens_per_s: float | None = Field(None, gt=0)
    # What a trainer step on this kind spends beyond its optimizer step, as the run's
    # trainer does it (`profile --local`): one weight publish's share of the step (the
    # gather and the hand-off to the writing thread, and the wait for the previous write),
    # s per publish; and one checkpoint, s. Replace the cluster's storage estimate.
    train_publish_s: float | None = Field(None, ge=0)
    # Over the network (`profile --box` with network sync): seconds of one version's
    # broadcast as the trainer's rank 0 sent it while training, to a receiver outside
    # the node's quota. No server's update pause ends before the sender is done.
    train_broadcast_s: float | None = Field(None, ge=0)
    # ... to two receivers, each on a quota of the node's size: rank 0 sends two copies
    # (gloo's tree, to two servers or more), each at the pace of a receiver on a quota.
    # A reading, not priced: held against runs, pricing a busy sender's pause by it did
    # not price their plans better than `train_broadcast_s` (docs/fidelity.md)
    train_broadcast_pair_s: float | None = Field(None, ge=0)
    # ... and the step's work after its wait for the last send (the optimizer update,
    # the state dict, the next send handed on), s: serial with the sends, so a trainer
    # whose send outlasts its passes publishes once per send plus this
    train_after_send_s: float | None = Field(None, ge=0)
    train_checkpoint_s: float | None = Field(None, ge=0)
    # Weight reload of an idle server, s (`profile --local`): the pause of a synchronous
    # run, where nothing is generating when new weights arrive. The pause with requests
    # in flight is the cluster link's latency.
    reload_idle_s: float | None = Field(None, ge=0)
    # Samples/s with the server kept full by the run's controller (`profile --local`) over
    # what the decode and prefill timings compose to: admissions, KV merges, HTTP and
    # sampling that the piecewise timings leave out. Multiplies the kind's h_psi.
    generation_efficiency: float | None = Field(None, gt=0)
    # ... at each batch the load held the server at (the requests its groups keep in
    # flight, at most the kind's batch limit), over what the timings compose to at that
    # batch: the run keeps one server as full as its plan's batch for it, and a server
    # kept half full loses more of its timings' rate than a full one (on a box kind of
    # batch 128, 0.55 at 64 against 0.69 at 128 over the rate at 128). Read at an
    # instance's batch (`Profile.generation_efficiency`); None: the single figure above
    generation_efficiency_at: dict[int, float] | None = None
    # The same with the controller, its reward workers and Valkey on the server's own
    # cores (`run.host_cores: inference`): what generation keeps when it shares them.
    generation_efficiency_shared: float | None = Field(None, gt=0)
    # ... and a weight update's pause under that load, s: the reload then contends with
    # the controller for the server's cores. Replaces the link's pause on this kind.
    reload_shared_s: float | None = Field(None, ge=0)
    # CPU seconds the controller spends per sample (HTTP, detokenising, rewards, the
    # record), with the Valkey the run starts beside it (storing the record). Where the
    # kind's devices are the host's own cores (`device: cpu`), the controller runs beside
    # the trainer and an asynchronous step pays for them.
    host_cpu_s_per_sample: float | None = Field(None, ge=0)
    # A synchronous step's generation and weight reload as the run's controller and
    # buffer take them (from the trainer's publish to its whole next batch, measured by
    # `profile --local`) over the replay's figure for the same layout: the hand-offs
    # between them. Multiplies that part of a synchronous step on this kind.
    sync_cycle_factor: float | None = Field(None, gt=0)
    # Seconds of a weight update's pause (requests in flight) in which the server still
    # generates: the controller's pause reaches a busy server late, and the server
    # resumes before the controller's call returns. Measured (`profile --box`) as the
    # run's controller keeping the server full without and with an update every
    # `RELOAD_EVERY_S`, made as `reload_overlap_sync` says (from disk, or over the
    # network from a rank 0 beside the server): the pause's length less the seconds of
    # samples the load lost per update. Taken off each pause of that mode in the
    # generation charge (not in the staleness window, which waits the whole pause; not
    # off the other mode's, where it was not measured); unmeasured: 0.
    reload_overlap_s: float | None = Field(None, ge=0)
    reload_overlap_sync: Literal["disk", "network"] = "disk"
    # The same rounds' pause (their median), less the fixed seconds the cost model adds
    # for that mode (`sync_cost.sync_terms` at no latency): what an update of this kind
    # costs on a link within its zone, in place of the link's latency (the zone's is the
    # slowest kind's). Measured in `reload_overlap_sync`'s mode only; None: the link's.
    update_pause_s: float | None = Field(None, ge=0)
    # ... and over the network with nothing in flight (a synchronous run's update: the
    # controller's pause, each bucket from a rank 0 beside the server, the resume), less
    # the same fixed seconds. None: the idle reload from disk stands for it.
    update_pause_idle_s: float | None = Field(None, ge=0)
    # One context switch of a placement that shares devices (`profile --local`): the
    # server's pause, its memory's release and resume and its continue, as the controller
    # calls them, plus what the trainer gives back and takes again (on a CPU: nothing,
    # its threads sleep while it waits), s; the median of several. None: the workload's
    # `constants.context_switch_s`.
    context_switch_s: float | None = Field(None, ge=0)
    # The same device's rates when one task takes every core in turn (`profile --local`
    # on a CPU host whose run pins the two sides apart): a colocated phase's generation
    # (each server its share of every core) and training (every core). None: not
    # measured (a GPU, or the profile already ran each side on every core).
    every_core: EveryCore | None = None

    def on_every_core(self) -> DeviceRates:
        """These rates as a colocated phase sees them: generation and training measured
        on every core, where they were; the ratios and the switch as measured."""
        e = self.every_core
        if e is None:
            return self
        train = e.train_tokens_per_s / self.train_tokens_per_s
        upd: dict[str, object] = {
            "decode_step_s": dict(e.decode_step_s),
            "prefill_tokens_per_s": e.prefill_tokens_per_s,
            "train_tokens_per_s": e.train_tokens_per_s,
            "every_core": None,
        }
        if self.train_sync_tokens_per_s is not None:
            upd["train_sync_tokens_per_s"] = self.train_sync_tokens_per_s * train
        if self.train_trim_tokens_per_s is not None:
            upd["train_trim_tokens_per_s"] = self.train_trim_tokens_per_s * train
        return self.model_copy(update=upd)

    def with_heap_trim(self) -> DeviceRates:
        """These rates for a trainer that trims its heap after every step: its step at
        the trimmed rate where measured (a synchronous step's rate by the same ratio)."""
        trimmed = self.train_trim_tokens_per_s
        if trimmed is None:
            return self
        ratio = trimmed / self.train_tokens_per_s
        upd: dict[str, object] = {"train_tokens_per_s": trimmed}
        if self.train_sync_tokens_per_s is not None:
            upd["train_sync_tokens_per_s"] = self.train_sync_tokens_per_s * ratio
        return self.model_copy(update=upd)

    def scoring_tokens_per_s(self) -> float:
        """The actor's scoring rate a task is priced at: at the run's concurrency where
        measured; else one request at a time (a profile made before that was measured);
        else the prefill rate (before scoring was measured at all)."""
        return (
            self.score_concurrent_tokens_per_s
            or self.score_tokens_per_s
            or self.prefill_tokens_per_s
        )

    def at_speed(self, factor: float) -> DeviceRates:
        """These rates on the kind running `factor` times as fast as when they were
        measured: every rate times it, every time over it. The ratios (the generation
        efficiencies, the cycle factor) and the controller's own CPU (the head node's,
        not the kind's) stay."""
        upd: dict[str, object] = {
            "decode_step_s": {b: t / factor for b, t in self.decode_step_s.items()}
        }
        for name in _RATES:
            value = getattr(self, name)
            if value is not None:
                upd[name] = value * factor
        for name in _TIMES:
            value = getattr(self, name)
            if value is not None:
                upd[name] = value / factor
        if (e := self.every_core) is not None:
            upd["every_core"] = e.model_copy(
                update={
                    "decode_step_s": {b: t / factor for b, t in e.decode_step_s.items()},
                    "prefill_tokens_per_s": e.prefill_tokens_per_s * factor,
                    "train_tokens_per_s": e.train_tokens_per_s * factor,
                }
            )
        return self.model_copy(update=upd)


_RATES = (
    "prefill_tokens_per_s",
    "score_tokens_per_s",
    "score_concurrent_tokens_per_s",
    "classify_tokens_per_s",
    "train_tokens_per_s",
    "train_sync_tokens_per_s",
    "train_trim_tokens_per_s",
)
_TIMES = (
    "train_publish_s",
    "train_broadcast_s",
    "train_broadcast_pair_s",
    "train_after_send_s",
    "train_checkpoint_s",
    "reload_idle_s",
    "reload_shared_s",
    "reload_overlap_s",
    "update_pause_s",
    "update_pause_idle_s",
    "context_switch_s",
)


class Profile(Section):
    model: str  # preset name or config path the rates are for
    params: int = Field(gt=0)
    kinds: dict[str, DeviceRates]

    def has(self, kind: str) -> bool:
        return kind in self.kinds

    def at_speed(self, factors: dict[str, float]) -> Profile:
        """The profile with each kind in `factors` at that many times its measured speed
        (`DeviceRates.at_speed`); the others as measured."""
        kinds = {k: r.at_speed(factors[k]) if k in factors else r for k, r in self.kinds.items()}
        return self.model_copy(update={"kinds": kinds})

    def decode_step_s(self, kind: str, batch: int) -> float:
        """Piecewise-linear in the batch between measured points, linear beyond."""
        pts = sorted(self.kinds[kind].decode_step_s.items())
        xs = [b for b, _ in pts]
        i = bisect.bisect_left(xs, batch)
        if i < len(xs) and xs[i] == batch:
            return pts[i][1]
        lo, hi = (
            (pts[0], pts[1])
            if i == 0
            else (pts[-2], pts[-1])
            if i >= len(xs)
            else (pts[i - 1], pts[i])
        )
        if len(pts) == 1:
            return pts[0][1]
        slope = (hi[1] - lo[1]) / (hi[0] - lo[0])
        return max(1e-9, lo[1] + slope * (batch - lo[0]))

    def prefill_tokens_per_s(self, kind: str) -> float:
        return self.kinds[kind].prefill_tokens_per_s

    def train_tokens_per_s(self, kind: str, sync: bool = False) -> float:
        """`sync`: a synchronous run's step (its weight write not beside it), where
        measured."""
        rates = self.kinds[kind]
        if sync and rates.train_sync_tokens_per_s is not None:
            return rates.train_sync_tokens_per_s
        return rates.train_tokens_per_s

    def generation_efficiency(self, kind: str, batch: int | None = None) -> float:
        """`kind`'s efficiency for an instance at `batch`: linear in the batch between the
        batches its continuous load was measured at, the nearest one's beyond them; the
        single figure where the profile has no batches (or no `batch` is given)."""
        rates = self.kinds.get(kind)
        if rates is None:
            return 1.0
        at = rates.generation_efficiency_at
        if not at or batch is None:
            return rates.generation_efficiency or 1.0
        pts = sorted(at.items())
        if batch <= pts[0][0]:
            return pts[0][1]
        if batch >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_left([b for b, _ in pts], batch)
        (b0, e0), (b1, e1) = pts[i - 1], pts[i]
        return e0 + (e1 - e0) * (batch - b0) / (b1 - b0)

    def generation_efficiency_shared(self, kind: str) -> float | None:
        """Measured with the host's work on the server's cores; None if not measured."""
        return self.kinds[kind].generation_efficiency_shared if kind in self.kinds else None

    def reload_shared_s(self, kind: str) -> float | None:
        return self.kinds[kind].reload_shared_s if kind in self.kinds else None

    def host_cpu_s_per_sample(self, kind: str) -> float:
        """The controller's CPU per sample taken from `kind`'s devices: only where they
        are the host's cores."""
        rates = self.kinds.get(kind)
        if rates is None or rates.device != "cpu":
            return 0.0
        return rates.host_cpu_s_per_sample or 0.0

    def sync_cycle_factor(self, kind: str) -> float:
        """What a synchronous cycle on `kind` is stretched by: its `sync_cycle_factor`,
        except on a box node (`device: box`), where the cycle it is taken from is not a
        measure: one kind timed it at 0.207 s in one profile and 0.106 s in the next,
        and over five held-out synchronous plans the factor put 3 within 15 % (mean
        |error| 17.8 %) where none put 4 (11.0 %) (docs/fidelity.md). It stays in the
        profile as a reading."""
        rates = self.kinds.get(kind)
        if rates is None or rates.device == BOX_DEVICE:
            return 1.0
        return rates.sync_cycle_factor or 1.0

    def replay_efficiency(self, kind: str, batch: int) -> float:
        """What a synchronous replay's decode steps and prefills on `kind` run at, as a
        share of its timings: on a box node its `generation_efficiency` at `batch` (the
        losses its continuous load measured beside the timings, admissions, HTTP and
        sampling, are there in a synchronous batch too, and no cycle factor holds them
        there); elsewhere 1.0, the kind's cycle factor, measured against the replay
        without it, holding them (docs/fidelity.md, "The synchronous replay at a box
        kind's efficiency")."""
        rates = self.kinds.get(kind)
        if rates is None or rates.device != BOX_DEVICE:
            return 1.0
        return self.generation_efficiency(kind, batch)

    def train_extra_s(
        self, kind: str, publish_every: int, checkpoint_every: int | None
    ) -> float | None:
        """Seconds per trainer step on `kind` beyond the optimizer step: a publish every
        `publish_every` steps and a checkpoint every `checkpoint_every` (None: not
        counted); None where the profile did not time the publish."""
        rates = self.kinds.get(kind)
        if rates is None or rates.train_publish_s is None:
            return None
        extra = rates.train_publish_s / publish_every
        if checkpoint_every and rates.train_checkpoint_s is not None:
            extra += rates.train_checkpoint_s / checkpoint_every
        return extra

    def _rounds(self, kind: str, sync: str) -> DeviceRates | None:
        """`kind`'s rates where its update rounds ran in mode `sync`, else None: what
        they measured prices only that mode's pauses."""
        rates = self.kinds.get(kind)
        return rates if rates is not None and rates.reload_overlap_sync == sync else None

    def reload_overlap_s(self, kind: str, sync: str = "disk") -> float:
        """Of a pause of mode `sync` on `kind`: the seconds measured to still generate."""
        rates = self._rounds(kind, sync)
        return 0.0 if rates is None else rates.reload_overlap_s or 0.0

    def train_broadcast_s(self, kind: str) -> float | None:
        return self.kinds[kind].train_broadcast_s if kind in self.kinds else None

    def train_after_send_s(self, kind: str) -> float | None:
        return self.kinds[kind].train_after_send_s if kind in self.kinds else None

    def update_pause_s(self, kind: str, sync: str = "disk") -> float | None:
        """`kind`'s own update pause in mode `sync` (stands for a link's latency within
        its zone); None where not measured in that mode."""
        rates = self._rounds(kind, sync)
        return None if rates is None else rates.update_pause_s

    def update_pause_idle_s(self, kind: str, sync: str = "disk") -> float | None:
        """`kind`'s update pause with nothing in flight in mode `sync`, as
        `update_pause_s` is priced; None where not measured in that mode."""
        rates = self._rounds(kind, sync)
        return None if rates is None else rates.update_pause_idle_s

    def reload_idle_s(self, kind: str) -> float | None:
        return self.kinds[kind].reload_idle_s if kind in self.kinds else None

    def context_switch_s(self, kind: str) -> float | None:
        return self.kinds[kind].context_switch_s if kind in self.kinds else None

    def on_every_core(self) -> Profile:
        """The profile as a colocated run's phases see it: each kind's rates on every
        core where measured (`DeviceRates.on_every_core`)."""
        kinds = {k: r.on_every_core() for k, r in self.kinds.items()}
        return self.model_copy(update={"kinds": kinds})

    def with_heap_trim(self) -> Profile:
        """The profile as a trainer that trims its heap after every step (a hybrid run's)
        sees it (`DeviceRates.with_heap_trim`)."""
        kinds = {k: r.with_heap_trim() for k, r in self.kinds.items()}
        return self.model_copy(update={"kinds": kinds})

    def has_every_core(self, kind: str) -> bool:
        return kind in self.kinds and self.kinds[kind].every_core is not None


def load_profile(path: str | Path, model_params: int | None = None) -> Profile:
    prof = build(Profile, read_yaml(path), str(path), "profile")
    if model_params is not None and prof.params != model_params:
        raise ConfigError(
            f"{path}: profile was measured for {prof.model!r} ({prof.params:,} parameters) "
            f"but the plan is for a model of {model_params:,} parameters"
        )
    return prof


def save_profile(prof: Profile, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(prof.model_dump(mode="json"), sort_keys=False))
    return p
