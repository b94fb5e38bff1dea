"""Workload (what one RL step needs) and the cost model's named constants.

Every constant says where its default comes from; override any of them in the workload
YAML under `constants:` or replace the analytic rates with a measured profile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from areal_hex.config.base import ConfigError, Section, build, read_yaml, refuse_renamed
from areal_hex.config.checks import check_publish_every
from areal_hex.config.rollout import WeightSyncMode
from areal_hex.config.workflow import TaskSpec
from areal_hex.plan import RENAMED_KEYS

# Bounds on what a workload may ask, far past the RL recipes in use (hundreds of prompts x
# tens of samples per step): the simulator replays every sample of a step, so a step of
# 10^8 samples would not finish.
MAX_SAMPLES_PER_STEP = 65_536
MAX_GROUP_SIZE = 1_024
MAX_TOKENS = 1_048_576
MAX_STALENESS = 64


class CostConstants(Section):
    # Fraction of datasheet HBM bandwidth a decode step attains (weights + KV read).
    # Assumption from published SGLang/vLLM decode roofline studies (60-80%); calibrate
    # with `areal-hex profile`.
    decode_bw_efficiency: float = Field(0.7, gt=0, le=1)
    # Fraction of dense BF16 peak reached by prefill and compute-bound decode GEMMs.
    prefill_mfu: float = Field(0.5, gt=0, le=1)
    # Model FLOPs utilisation of a training step (forward + backward + recompute);
    # 30-45% is what Megatron/DeepSpeed report for dense models at this scale.
    train_mfu: float = Field(0.35, gt=0, le=1)
    # Share of HBM the inference engine may take (SGLang's mem_fraction_static ~0.88).
    hbm_utilization: float = Field(0.88, gt=0, le=1)
    # CUDA context, allocator slack and kernels' workspaces per GPU, GB.
    runtime_reserve_gb: float = Field(2.0, ge=0)
    # Largest decode batch per instance (SGLang's max_running_requests class of limit).
    max_running_requests: int = Field(256, gt=0, le=MAX_SAMPLES_PER_STEP)
    # Scheduler + kernel-launch overhead per decode step, ms (CUDA graphs: a few ms).
    decode_step_overhead_ms: float = Field(2.0, ge=0)
    # Latency of one TP all-reduce, ms (NCCL small-message latency on NVLink/PCIe).
    tp_allreduce_latency_ms: float = Field(0.01, ge=0)
    # GRPO groups share a prompt: with a radix/prefix cache the prompt is prefilled once
    # per group instead of G times.
    prefix_cache: bool = True
    # Weight sync time = latency + factor * 2N bytes / link bandwidth; AReaL-Hex measured
    # 4-6x the naive bytes/bandwidth figure (reload, pause, resharding), hence 5.
    weight_sync_factor: float = Field(5.0, ge=1)
    # Where disk sync's files are read from: shared storage over the cluster's links
    # (True: the bytes above cross them), or storage beside every node (False: a box on
    # one machine, whose profiled update pause already holds the read), the update then
    # costing the link's latency only.
    storage_on_links: bool = True
    # Colocated placement: seconds of the context switch in each step (the servers release
    # their memory for the trainer and take it back before the next weights load).
    # Calibrate from a colocated run's rollout rows: context_switch_s_total /
    # context_switches_total (docs/modes.md has this machine's figure).
    context_switch_s: float = Field(0.05, ge=0)
    # rollout.weight_sync=network: bytes sent per parameter (bf16 2; a CPU trainer's
    # fp32 4), the bucket size (rollout.weight_sync_bucket_mb) and the fixed cost of one
    # bucket (its HTTP call to each server and the load between two decode steps), ms.
    weight_sync_bytes_per_param: float = Field(2.0, gt=0)
    weight_sync_bucket_mb: float = Field(512.0, gt=0)
    weight_sync_bucket_overhead_ms: float = Field(5.0, ge=0)
    # Bytes on the wire between the head node (Valkey, the controller) and the services,
    # per sample (scheduler/traffic.py): fitted (least squares over 40 groups of 8, mean
    # prompt 33.9 tokens, mean answer 15.0) to what the box's tiny job sent through the
    # built-in server, its client (rollout_service/client.py, rollout_service/wire.py) and
    # the record codec (areal_hex/buffer/codec.py); docs/fidelity.md, "The traffic priced".
    # The /generate request (the prompt's ids as JSON, once per sample of the group):
    http_request_bytes_per_sample: float = Field(61.0, ge=0)
    http_request_bytes_per_prompt_token: float = Field(3.2, ge=0)
    # The response (output ids, [log-prob, id, null] per token, versions, meta):
    http_response_bytes_per_sample: float = Field(344.0, ge=0)
    http_response_bytes_per_token: float = Field(37.1, ge=0)
    # The group record the trainer reads from Valkey: the header's per-sample fields, the
    # prompt's int32 ids once per group, 12 bytes per token (id, log-prob, version) and
    # the answer's text:
    record_bytes_per_sample: float = Field(69.0, ge=0)
    record_bytes_per_prompt_token: float = Field(4.0, ge=0)  # per group
    record_bytes_per_token: float = Field(13.3, ge=0)
    # Rank 0 writes the bf16 weights (2N bytes) to shared storage at this rate, GB/s.
    storage_write_gbs: float = Field(2.0, gt=0)
    # Fraction of the DP gradient all-reduce hidden behind backward compute (0: none).
    comm_overlap: float = Field(0.0, ge=0, le=1)
    # Bytes per parameter of mixed-precision Adam state before sharding (ZeRO paper):
    # bf16 params 2 + bf16 grads 2 + fp32 master, momentum, variance 12.
    adam_bytes_per_param: float = Field(16.0, gt=0)
    # Activation bytes kept per token and layer with activation checkpointing (the layer
    # input, bf16) plus one layer's recompute working set per token (~34 h bytes,
    # Korthikanti et al. 2022); the fp32 logits of a micro-batch come on top.
    act_checkpoint_bytes_per_hidden: float = Field(2.0, gt=0)
    act_layer_bytes_per_hidden: float = Field(34.0, gt=0)


class Workload(Section):
    groups_per_step: int = Field(32, gt=0, le=MAX_SAMPLES_PER_STEP)  # B: prompts per step
    group_size: int = Field(8, gt=0, le=MAX_GROUP_SIZE)  # G: samples per prompt
    prompt_tokens: int = Field(512, gt=0, le=MAX_TOKENS)
    response_tokens: int = Field(2048, gt=0, le=MAX_TOKENS)  # mean generated length
    max_response_tokens: int = Field(4096, gt=0, le=MAX_TOKENS)  # KV reservation per request
    # η, the config's buffer.max_staleness (AReaL's default for maths is 8)
    max_staleness: int = Field(4, ge=0, le=MAX_STALENESS)
    # k, the config's trainer.publish_every: optimizer steps between weight publishes
    publish_every: int = Field(1, gt=0, le=MAX_STALENESS + 1)
    # the config's trainer.checkpoint_every: a profiled checkpoint's time is spread over
    # these steps (None: checkpoints not priced)
    checkpoint_every: int | None = Field(None, gt=0)
    # KL to a frozen reference: one more forward per token, in the trainer unless a task
    # of role reference computes the reference's log-probs (scheduler/task_costs.py)
    reference_model: bool = False
    # PPO's critic (the config's algo.advantage gae): a value model of the actor's size in
    # the trainer's ranks, its values forward and its own update in every step
    critic: bool = False
    # The reward model a task of role reward_model serves: a preset or an HF config.json
    # (None: the actor's shape)
    reward_model_shape: str | None = None
    # Pin choices to what the experiment config runs (`deploy` checks both against it):
    # every rollout instance at this TP (inference.sglang.tp_size), the trainer at this
    # ZeRO stage (trainer.zero_stage). None lets the planner choose.
    rollout_tp: int | None = Field(None, gt=0)
    zero_stage: int | None = Field(None, ge=0, le=3)
    # A trainer may span GPU kinds (heterogeneous data parallelism); false keeps it on
    # one kind (`plan --one-kind-trainer`: what `deploy` renders).
    mixed_trainer: bool = True
    # The most machines a trainer may span (None: any). A box (`areal-hex box`) sets 1:
    # it does not emulate a multi-node DeepSpeed launch.
    max_trainer_nodes: int | None = Field(None, gt=0)
    # On CPU kinds, whose cores the rollout controller, rewards and Valkey take their CPU
    # from (the profile's `host_cpu_s_per_sample`): the trainer's (each step pays B·G times
    # it) or the rollout instances' (each sample does). A local run's layout sets it
    # (`run.host_cores`); GPU kinds are unaffected.
    host_work: Literal["trainer", "rollout"] = "trainer"
    # How weights reach the rollout instances (rollout.weight_sync): the cost model
    # charges that mode over the links it crosses (costmodel.weight_sync_s).
    weight_sync: WeightSyncMode = "disk"
    # The workflow's tasks beyond generate and train (the config's workflow.tasks): each
    # instance gets its devices before the pools are sized (scheduler/tasks.py).
    tasks: list[TaskSpec] = []
    constants: CostConstants = CostConstants()

    @model_validator(mode="before")
    @classmethod
    def _refuse_old_names(cls, data: object) -> object:
        return refuse_renamed(data, RENAMED_KEYS)

    @model_validator(mode="after")
    def _reward_model_needs_its_task(self) -> Workload:
        if self.reward_model_shape is not None and not any(
            t.role == "reward_model" for t in self.tasks
        ):
            raise ValueError(
                f"reward_model_shape {self.reward_model_shape!r} without a task of role "
                "reward_model does nothing: expected such a task in tasks, or no "
                "reward_model_shape"
            )
        return self

    @property
    def samples_per_step(self) -> int:
        return self.groups_per_step * self.group_size


def load_workload(path: str | Path | None) -> Workload:
    if path is None:
        return Workload()
    w = build(Workload, read_yaml(path), str(path), "workload")
    if w.max_response_tokens < w.response_tokens:
        raise ConfigError(
            f"{path}: max_response_tokens ({w.max_response_tokens}) must be >= "
            f"response_tokens ({w.response_tokens})"
        )
    if w.samples_per_step > MAX_SAMPLES_PER_STEP:
        raise ConfigError(
            f"{path}: groups_per_step x group_size = {w.samples_per_step:,} samples per step; "
            f"at most {MAX_SAMPLES_PER_STEP:,}"
        )
    check_publish_every(
        w.publish_every, w.max_staleness, keys=("publish_every", "max_staleness"), source=str(path)
    )
    return w
