"""Readers of what the trackers wrote: TensorBoard event files and W&B offline run files,
to compare with `metrics.jsonl` (tests, and scripts/check_run_trackers.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_history(run_file: Path) -> list[dict[str, float]]:
    """History records of an offline `.wandb` file (a LevelDB-style log of protobuf
    records: 7-byte header, 32 KiB blocks, chunks of crc32/uint16 length/uint8 type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, out = run_file.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                values = {_key(i): json.loads(i.value_json) for i in rec.history.item}
                out.append({k: float(v) for k, v in values.items() if _number(v)})
    return out


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _key(item: object) -> str:
    return item.key or "/".join(item.nested_key)  # type: ignore[attr-defined]
