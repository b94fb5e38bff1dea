"""The trajectory buffer: batch size B, staleness bound η, backpressure, leases."""

from __future__ import annotations

from pydantic import Field, model_validator

from areal_hex.config.base import Section


class BufferConfig(Section):
    # B: groups per optimizer step; the staleness gate admits at most (v + eta + 1) * B.
    groups_per_step: int = Field(8, gt=0)
    # eta: maximum policy-version lag of a trained group (0 = synchronous RL).
    max_staleness: int = Field(2, ge=0)
    # Backpressure: producers wait while this many groups are unconsumed or pending.
    max_pending: int = Field(1024, gt=0)
    # Seconds a producer may wait at the gate before it fails with a clear error.
    gate_timeout_s: float = Field(600.0, gt=0)
    # Pending entries idle this long are reclaimed from a dead consumer.
    reclaim_idle_ms: int = Field(30_000, ge=0)
    # Name of this consumer in the stream's consumer group: a restarted trainer with the
    # same name re-reads the entries it had not acknowledged.
    consumer_name: str = Field("trainer-0", pattern=r"^[A-Za-z0-9_.:-]+$")
    # Poll interval of waiters (gate, consumer) besides pub/sub wake-ups.
    poll_interval_s: float = Field(0.1, gt=0)
    # A producer's admissions live as long as its heartbeat: one dead for this long gives
    # them back to the gate (the next admit of any producer reclaims them).
    lease_ttl_s: float = Field(10.0, gt=0)
    # The consumer reads up to this many entries per round trip; the surplus stays pending
    # to it (and is checked for staleness again) until a later get_batch hands it out.
    prefetch: int = Field(16, ge=1)
    # While the buffer's server is unreachable, the controller and the trainer retry their
    # calls with doubling delays for this long, then fail.
    retry_s: float = Field(60.0, ge=0)
    # Seed of the within-batch shuffle (oldest groups are taken first, then shuffled).
    shuffle_seed: int = 0

    @model_validator(mode="after")
    def _room_for_a_batch(self) -> BufferConfig:
        # The trainer holds a whole batch pending while it waits for the rest of it; with
        # less room than that, producers and trainer would wait on each other forever.
        if self.max_pending < self.groups_per_step:
            raise ValueError(
                f"max_pending ({self.max_pending}) must be at least groups_per_step "
                f"({self.groups_per_step})"
            )
        return self
