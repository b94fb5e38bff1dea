"""The ledger of a run: where every admitted group went, from durable state only (Valkey's
counters and stream, the newest complete checkpoint, the trainer's commit log), so it is
true across crashes, restarts and resumed attempts.

    produced = admitted - given back unmade (failed, abandoned at a stop, reclaimed
               from a dead controller)
             = trained + groups_dropped_stale + dead_letter + filtered + pending + in_flight
    groups_lost = produced - (trained + groups_dropped_stale + dead_letter + filtered
                              + pending + in_flight)

- trained: groups in the committed weights (the newest complete checkpoint's total);
- pending: in the stream and not in the committed weights (unconsumed, or trained after
  the last checkpoint and to be trained again after a restart);
- in_flight: admissions a controller holds (generating);
- prompts_produced_twice: data positions put into the stream by more than one group;
- trained_twice: group ids that appear in more than one commit of `committed.jsonl`
  (of the commits that count: those a fallback from a corrupt checkpoint rolled back
  do not).

Rates are over the time the job actually ran: each attempt from its services being ready
to its end, less the time the trainer was down between an exit and its restart.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from areal_hex.buffer.keys import GIVE_BACK_REASONS, BufferKeys
from areal_hex.run_files import RunPaths, TrainerRow
from trainer_service.checkpoint import MARKER, complete_checkpoints, read_committed


def buffer_counters(client: Any, keys: BufferKeys, committed_ids: list[str]) -> dict[str, int]:
    """Valkey's durable counters in one transaction, and how many of `committed_ids`
    (trained into the newest checkpoint, maybe not acknowledged yet) are still in the
    stream."""
    pipe = client.pipeline(transaction=True)
    names = ["admitted", "acked", "groups_dropped_stale", "dead_count"]
    pipe.mget([getattr(keys, n) for n in names])
    pipe.mget([keys.given_back(r) for r in GIVE_BACK_REASONS])
    pipe.hvals(keys.leases)
    pipe.xlen(keys.traj)
    for entry_id in committed_ids:
        pipe.xrange(keys.traj, entry_id, entry_id)
    counts, back, held, length, *found = pipe.execute()
    out = {n: int(v or 0) for n, v in zip(names, counts, strict=True)}
    out.update(
        {f"given_back_{r}": int(v or 0) for r, v in zip(GIVE_BACK_REASONS, back, strict=True)}
    )
    out["in_flight"] = sum(int(v) for v in held)
    out["in_stream"] = int(length)
    out["committed_in_stream"] = sum(1 for f in found if f)
    out["produced_twice"] = produced_twice(client, keys)
    return out


def produced_twice(client: Any, keys: BufferKeys) -> int:
    """Prompts (data positions) put into the stream by more than one group: each put
    leaves a token `<controller>-<seq>` for a day, and a resumed or restarted controller
    continues the prompt order, so a seq seen twice is a prompt produced twice."""
    seqs: Counter[str] = Counter()
    for key in client.scan_iter(match=keys.put_token("*"), count=1000):
        name = key.decode() if isinstance(key, bytes) else str(key)
        seqs[name.rsplit("-", 1)[-1]] += 1
    return sum(1 for n in seqs.values() if n > 1)


def committed_state(checkpoint_dir: Path) -> dict[str, Any]:
    """The newest complete checkpoint's marker (step 0 and nothing trained if none)."""
    found = complete_checkpoints(checkpoint_dir)
    if not found:
        return {"step": 0, "totals": {}, "ack_ids": []}
    return json.loads((found[-1][1] / MARKER).read_text())


def trained_twice(committed_log: Path) -> int:
    """Group ids that more than one commit holds (0 when each trained exactly once)."""
    seen: Counter[str] = Counter()
    for rec in read_committed(committed_log):
        seen.update(set(rec.get("ids", [])))
    return sum(1 for n in seen.values() if n > 1)


def ledger(
    counters: dict[str, int] | None, committed: dict[str, Any], twice: int
) -> dict[str, Any]:
    """The group accounting from the buffer's counters and the committed checkpoint.
    Without counters (the buffer's data is gone), only what the checkpoint knows."""
    trained = int(committed.get("totals", {}).get("groups_trained_total", 0))
    out: dict[str, Any] = {
        "groups_trained": trained,
        "committed_step": int(committed.get("step", 0)),
        "trained_twice": twice,
    }
    if counters is None:
        out["groups_lost"] = None
        out["ledger_error"] = "the buffer's counters could not be read"
        return out
    c = counters
    unmade = c["given_back_failed"] + c["given_back_abandoned"] + c["given_back_reclaimed"]
    produced = c["admitted"] - unmade
    pending = c["in_stream"] - c["committed_in_stream"]
    accounted = (
        trained
        + c["groups_dropped_stale"]
        + c["dead_count"]
        + c["given_back_filtered"]
        + pending
        + c["in_flight"]
    )
    out.update(
        {
            "groups_admitted": c["admitted"],
            "groups_produced": produced,
            "groups_dropped_stale": c["groups_dropped_stale"],
            "groups_dead_letter": c["dead_count"],
            "groups_filtered": c["given_back_filtered"],
            "groups_pending": pending,
            "groups_in_flight": c["in_flight"],
            "groups_failed": c["given_back_failed"],
            "groups_abandoned": c["given_back_abandoned"],
            "groups_reclaimed": c["given_back_reclaimed"],
            "groups_acked": c["acked"],
            "prompts_produced_twice": c["produced_twice"],
            "groups_lost": produced - accounted,
        }
    )
    return out


def committed_ids(committed: dict[str, Any]) -> list[str]:
    """Ids in the committed weights that may still be in the stream: the newest
    checkpoint's own (acknowledged once the next commits) and the previous one's
    (acknowledged right after this commit)."""
    return [*committed.get("held_ids", []), *committed.get("ack_ids", [])]


def read_ledger(client: Any, run_id: str, paths: RunPaths) -> dict[str, Any]:
    committed = committed_state(paths.checkpoint_dir)
    counters = buffer_counters(client, BufferKeys(run_id), committed_ids(committed))
    return ledger(counters, committed, trained_twice(paths.committed))


def ledger_from_aof(valkey_dir: Path, run_id: str, paths: RunPaths) -> dict[str, Any]:
    """The ledger when the run's Valkey is not running: a copy of its append-only data is
    loaded into a temporary server (the original files are not touched)."""
    from areal_hex.buffer.embedded import EmbeddedServerError, EmbeddedValkey

    committed = committed_state(paths.checkpoint_dir)
    twice = trained_twice(paths.committed)
    if not valkey_dir.is_dir():
        return ledger(None, committed, twice)
    tmp = Path(tempfile.mkdtemp(prefix="areal-hex-ledger-"))
    try:
        shutil.copytree(valkey_dir, tmp / "data", ignore=shutil.ignore_patterns("*.conf"))
        server = EmbeddedValkey(data_dir=str(tmp / "data"), appendonly=True)
        with server:
            client = server_client(server)
            try:
                counters = buffer_counters(client, BufferKeys(run_id), committed_ids(committed))
            finally:
                client.close()
    except (EmbeddedServerError, OSError):
        counters = None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ledger(counters, committed, twice)


def server_client(server: Any) -> Any:
    import redis

    return redis.Redis.from_url(server.url, socket_timeout=10)


# ---------------------------------------------------------------- time actually run
def active_seconds(attempts: list[dict[str, Any]]) -> float:
    """Seconds the job ran: per attempt, services ready to end, less the trainer's
    downtime (from an exit to its restart)."""
    total = 0.0
    for a in attempts:
        if "t_end" not in a or "t_services_ready" not in a:
            continue
        total += max(0.0, a["t_end"] - a["t_services_ready"])
        down_since: float | None = None
        for e in a.get("events", []):
            if not str(e["process"]).startswith("trainer"):
                continue
            if str(e["event"]).startswith("exit"):
                down_since = e["time"]
            elif e["event"] == "restart" and down_since is not None:
                total -= e["time"] - down_since
                down_since = None
    return total


def steady_rate(rows: list[TrainerRow], group_size: int, breaks: list[float]) -> float | None:
    """Trained samples per second between consecutive steps, summed over the stretches
    where the trainer ran without interruption (a step not following its predecessor, or
    a trainer exit or new attempt in between, starts a new stretch)."""
    groups = seconds = 0.0
    for a, b in zip(rows, rows[1:], strict=False):
        if b.step != a.step + 1 or b.time <= a.time:
            continue
        if any(a.time < t < b.time for t in breaks):
            continue
        groups += b.groups_trained_total - a.groups_trained_total
        seconds += b.time - a.time
    return groups * group_size / seconds if seconds > 0 else None


def interruptions(attempts: list[dict[str, Any]]) -> list[float]:
    """Times at which the trainer stopped: its exits, and each attempt's end."""
    out = []
    for a in attempts:
        out += [
            e["time"]
            for e in a.get("events", [])
            if str(e["process"]).startswith("trainer") and str(e["event"]).startswith("exit")
        ]
        if "t_end" in a:
            out.append(a["t_end"])
    return out


def summary_fields(
    ledger_: dict[str, Any], events: dict[str, Any], rows: list[TrainerRow], group_size: int
) -> dict[str, Any]:
    """What the ledger puts into `summary.json`: its accounting (replacing the per-process
    `in_buffer_at_stop` / `in_flight_controller`, which its `groups_pending` /
    `groups_in_flight` supersede), and times and rates over every attempt
    (`events.json`'s `attempts`, or the one attempt it describes)."""
    attempts = events.get("attempts") or ([events] if events else [])
    walls = [a["t_end"] - a["t_start"] for a in attempts if "t_end" in a and "t_start" in a]
    active = active_seconds(attempts)
    trained_samples = int(ledger_.get("groups_trained", 0)) * group_size
    restarts: Counter[str] = Counter()
    for a in attempts:
        restarts.update(a.get("restarts", {}))
    return {
        **ledger_,
        "attempts": len(attempts),
        "wall_time_s": sum(walls) if walls else None,
        "active_time_s": active,
        "samples_per_s": steady_rate(rows, group_size, interruptions(attempts)),
        "samples_per_s_wall": trained_samples / active if active > 0 else None,
        "restarts": dict(restarts),
    }
