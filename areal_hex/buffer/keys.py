"""Redis key names of one run: everything the buffer stores lives under `<run>:`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from areal_hex.api import GiveBackReason

GROUP = "trainer"  # the consumer group of the trajectory stream
# A consumer group that never reads: a put moves it to the stream's end to learn the id of
# the entry it just appended (scripts.PUT_LEDGER).
TIP_GROUP = "tip"
PAYLOAD_FIELD = b"d"  # stream entries carry the encoded group in this field
# Why an admission was given back instead of put: generated but all rewards equal (dynamic
# sampling), generation failed, cancelled at a stop, or its holder died (reclaimed).
GIVE_BACK_REASONS: tuple[str, ...] = get_args(GiveBackReason)


@dataclass(frozen=True)
class BufferKeys:
    run_id: str

    def _k(self, name: str) -> str:
        return f"{self.run_id}:{name}"

    @property
    def traj(self) -> str:  # stream of encoded groups, consumer group `trainer`
        return self._k("traj")

    @property
    def version(self) -> str:  # current policy version (int)
        return self._k("version")

    @property
    def weights_path(self) -> str:  # directory of the current version's weights
        return self._k("weights_path")

    @property
    def submitted(self) -> str:  # groups admitted by the staleness gate (int)
        return self._k("submitted")

    @property
    def admitted(self) -> str:  # groups ever admitted (never decremented): the data position
        return self._k("admitted")

    def given_back(self, reason: str) -> str:  # admissions given back, by reason (int)
        return self._k(f"given_back:{reason}")

    def put_token(self, token: str) -> str:  # a put already done (expires after a day)
        return self._k(f"put:{token}")

    @property
    def leases(self) -> str:  # hash: holder -> admissions it holds (admitted, not yet put)
        return self._k("leases")

    def lease(self, holder: str) -> str:  # the holder's heartbeat (expires when it dies)
        return self._k(f"lease:{holder}")

    @property
    def dead(self) -> str:  # dead-letter stream: malformed entries with the reason
        return self._k("dead")

    @property
    def dead_count(self) -> str:
        return self._k("dead_count")

    @property
    def groups_dropped_stale(self) -> str:  # groups dropped: older than v - eta, or newer than v
        return self._k("groups_dropped_stale")

    @property
    def lineage(self) -> str:  # restores so far: a version after one may be lower
        return self._k("lineage")

    @property
    def acked(self) -> str:  # groups acknowledged (trained) in total
        return self._k("acked")

    @property
    def weights_channel(self) -> str:  # pub/sub: JSON {"version": N, "path": ...}
        return self._k("weights")
