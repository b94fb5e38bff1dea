"""The rollout controller: sampling, group size, rewards, retries."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from areal_hex.config.base import Section
from areal_hex.config.reward import RewardModelConfig, check_reward_spec

# How a published version reaches the inference servers: "disk" (the trainer writes
# weights/v<N>, the servers load it: needs a filesystem both see) or "network" (the
# trainer broadcasts it to the servers over a torch.distributed group, SGLang's
# /init_weights_update_group + /update_weights_from_distributed).
WeightSyncMode = Literal["disk", "network"]


# `auto`: retract where every server reports per-token versions, else abort; the others
# are `areal_hex.api.PauseMode`, the mode every layer below carries.
UpdatePause = Literal["auto", "abort", "retract", "in_place"]

# The servers the controller waits for at start (`RolloutConfig.wait_for_servers`).
WaitForServers = Literal["first", "all"]


class RolloutConfig(Section):
    group_size: int = Field(4, gt=0)
    max_new_tokens: int = Field(32, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    # Prompts in flight at once (each is a group of `group_size` requests).
    max_concurrent_groups: int = Field(16, gt=0)
    # One /generate call; on expiry the request is retried on another server.
    request_timeout_s: float = Field(120.0, gt=0)
    # Failed attempts (error, timeout, dead server) allowed per sample before its group is
    # abandoned (and its admission given back to the gate).
    max_retries: int = Field(3, ge=0)
    reward_workers: int = Field(1, gt=0)
    reward_timeout_s: float = Field(5.0, gt=0)
    # The reward: "rule", "model" (the workflow's reward_model task) or weights such as
    # {rule: 1.0, model: 0.5} (areal_hex/config/reward.py); the reward model's settings.
    reward: str | dict[str, float] = "rule"
    reward_model: RewardModelConfig = RewardModelConfig()
    # Groups to produce; None: trainer.total_steps * buffer.groups_per_step, the groups
    # the steps train (and those the trainer drops as stale, made again).
    max_groups: int | None = Field(None, gt=0)
    # DAPO dynamic sampling: a group whose rewards are all equal (no gradient) is dropped
    # at the controller, its gate admission given back, and counted (groups_filtered);
    # the controller samples on until max_groups informative groups, producing at most
    # max_groups x dynamic_sampling_max_factor groups in all.
    dynamic_sampling: bool = False
    dynamic_sampling_max_factor: int = Field(8, ge=1)
    # On SIGTERM/SIGINT, in-flight groups get this long to finish before they are dropped.
    stop_grace_s: float = Field(30.0, ge=0)
    # Seconds between lines of <run_dir>/rollout.jsonl (and progress logs).
    metrics_interval_s: float = Field(5.0, gt=0)
    # Prometheus /metrics port of the controller (None: off, 0: a free port); the rows
    # above, refreshed every metrics_interval_s.
    metrics_port: int | None = Field(None, ge=0, lt=65536)
    # Seconds between health probes of unhealthy servers.
    probe_interval_s: float = Field(2.0, gt=0)
    # Which inference servers the controller waits for before it makes its first group:
    # "first" (the first healthy one; the others join as they come up) or "all" (every
    # configured server healthy and holding the current weights: a run that measures its
    # plan, such as `bench hetero`'s, generates on the servers it planned from the start).
    wait_for_servers: WaitForServers = "first"
    # How long `areal-hex rollout` waits at start for the servers `wait_for_servers`
    # names; past it the controller ends, naming the servers that never came up.
    startup_timeout_s: float = Field(600.0, gt=0)
    # What a weight update does to the requests in flight. "abort": they end with their
    # partial output and are resent (SGLang's way; each token tagged with the version of
    # the response that returned it). "retract": the servers keep them, recompute their
    # KV cache with the new weights and go on; needs servers that report each token's
    # version (the built-in engine). "in_place": they keep their KV cache as the old
    # weights computed it and go on (no recompute; the cheapest update while the servers
    # are busy, PipelineRL's in-flight update; the behaviour log-probs are still those
    # that sampled each token). "auto": retract when every server reports token
    # versions, else abort.
    update_pause: UpdatePause = "auto"
    # How new weights reach the servers (WeightSyncMode above). The settings below are
    # the network mode's (refused with disk): the address the servers reach trainer rank
    # 0 at for the weight-update group (None: the trainer host's address on the route to
    # the first server), its TCPStore port (None: a free one; the controller reads both
    # from the manifest), the network interface gloo uses (None: GLOO_SOCKET_IFNAME, else
    # the address's); then, for the network mode, the bucket size (one
    # /update_weights_from_distributed call each) and how long a group may take to form
    # or a bucket to arrive; how long the members of a new group (the servers healthy
    # when the controller starts its update, recorded in Redis) take to be agreed and to
    # meet: a member that does not come fails the group in that time, not the above.
    weight_sync: WeightSyncMode = "disk"
    weight_sync_address: str | None = None
    weight_sync_port: int | None = Field(None, gt=0, lt=65536)
    weight_sync_ifname: str | None = None
    weight_sync_bucket_mb: float = Field(512.0, gt=0)
    weight_sync_timeout_s: float = Field(300.0, gt=0)
    weight_sync_join_timeout_s: float = Field(30.0, gt=0)

    _reward = field_validator("reward", mode="before")(check_reward_spec)
