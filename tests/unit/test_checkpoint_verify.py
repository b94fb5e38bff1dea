"""Checkpoints carry a manifest of their files; a corrupt newest one is set aside and the
newest intact one is resumed from, and the commit log rolls back to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hexctl.report.ledger import trained_twice
from trainer_service.checkpoint import (
    MANIFEST_KEY,
    MARKER,
    CorruptCheckpoint,
    choose_resume,
    complete_checkpoints,
    manifest,
    read_committed,
    record_committed,
    rollback,
    verify,
)


def _checkpoint(root: Path, step: int) -> Path:
    """A checkpoint as `save` leaves it: files, then the marker with their manifest."""
    path = root / f"step{step}"
    (path / "global_step").mkdir(parents=True)
    (path / "global_step" / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 40)
    (path / "rng_rank0.pt").write_bytes(b"rng" * 10)
    state = {"step": step, "ack_ids": [f"{step}-0"], MANIFEST_KEY: manifest(path)}
    (path / MARKER).write_text(json.dumps(state))
    return path


def test_manifest_lists_every_file_but_the_marker(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 3)
    files = json.loads((path / MARKER).read_text())[MANIFEST_KEY]
    assert sorted(files) == ["global_step/mp_rank_00_model_states.pt", "rng_rank0.pt"]
    assert files["rng_rank0.pt"][0] == 30
    assert verify(path)["step"] == 3


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda f: f.write_bytes(f.read_bytes()[:100]), "has 100 bytes, 10240 written"),
        (lambda f: f.write_bytes(b"x" + f.read_bytes()[1:]), "does not match its checksum"),
        (lambda f: f.unlink(), "is missing"),
    ],
)
def test_verify_names_the_damaged_file(tmp_path: Path, damage, says: str) -> None:
    path = _checkpoint(tmp_path, 3)
    damage(path / "global_step" / "mp_rank_00_model_states.pt")
    with pytest.raises(CorruptCheckpoint, match=says):
        verify(path)


def test_unreadable_marker_is_corrupt_and_old_markers_pass(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 3)
    (path / MARKER).write_text('{"step": 3, "ack')
    with pytest.raises(CorruptCheckpoint, match="unreadable COMPLETE marker"):
        verify(path)
    (path / MARKER).write_text('{"step": 3}')  # written before manifests existed
    assert verify(path) == {"step": 3}


def test_corrupt_newest_is_set_aside_and_the_intact_one_resumed(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 20)
    newest = _checkpoint(tmp_path, 40)
    (newest / "global_step" / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04")
    said: list[str] = []
    assert choose_resume("auto", tmp_path, said.append) == tmp_path / "step20"
    assert len(said) == 1 and str(newest) in said[0] and "set aside as step40.corrupt" in said[0]
    assert (tmp_path / "step40.corrupt" / MARKER).is_file()  # kept to look at
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [20]
    # the next resume finds the intact one at once
    assert choose_resume("auto", tmp_path, said.append) == tmp_path / "step20"
    assert len(said) == 1


def test_every_checkpoint_corrupt_resumes_from_none(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 3)
    (path / "rng_rank0.pt").unlink()
    assert choose_resume("auto", tmp_path, lambda _m: None) is None
    assert (tmp_path / "step3.corrupt").is_dir()


def test_an_explicit_corrupt_checkpoint_is_refused(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 3)
    (path / "rng_rank0.pt").write_bytes(b"")
    with pytest.raises(CorruptCheckpoint, match="rng_rank0.pt has 0 bytes"):
        choose_resume(str(path), tmp_path)
    assert path.is_dir()  # named by the user: not moved


def test_a_fallback_rolls_the_commit_log_back(tmp_path: Path) -> None:
    """Steps 21-40 are trained again after the fallback to step 20: the commit log no
    longer counts the first time, so no group counts as trained twice."""
    log = tmp_path / "committed.jsonl"
    record_committed(log, 20, ["a", "b"])
    record_committed(log, 40, ["c", "d"])
    record_committed(log, 20, ["a", "b"])  # the resume from step 20
    assert [r["step"] for r in read_committed(log)] == [20]
    record_committed(log, 40, ["d", "c"])  # trained again
    assert [r["step"] for r in read_committed(log)] == [20, 40]
    assert trained_twice(log) == 0
    assert json.loads(log.read_text().splitlines()[2]) == {"rollback_to": 20}
    # a group really trained into two commits of the lineage still counts
    record_committed(log, 60, ["a", "e"])
    assert trained_twice(log) == 1


def test_rollback_to_zero_and_nothing_to_roll_back(tmp_path: Path) -> None:
    log = tmp_path / "committed.jsonl"
    assert rollback(log, 0) == [] and not log.exists()
    record_committed(log, 3, ["a"])
    assert rollback(log, 3) == [{"step": 3, "ids": ["a"]}]
    assert rollback(log, 0) == [] and read_committed(log) == []
