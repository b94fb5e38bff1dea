"""Trainer pieces without DeepSpeed: batching, LR schedule, publication, checkpoint
discovery, the launcher command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from areal_hex.config import TrainerConfig, load_config
from areal_hex.record import Completion, GroupRecord
from trainer_service.batching import (
    assign_to_ranks,
    collate,
    flatten_groups,
    pack_micro_batches,
    sequence_advantages,
)
from trainer_service.checkpoint import MARKER, complete_checkpoints, resolve_resume
from trainer_service.engine import ds_config, lr_lambda
from trainer_service.publish import collect_versions, write_model_dir
from trainer_service.sources import ReplayConsumer, group_to_json, write_replay


def comp(tokens: list[int], reward: float) -> Completion:
    n = len(tokens)
    return Completion(tokens, [-0.5] * n, [1] * n, "stop", reward)


def test_assign_longest_first_to_least_loaded() -> None:
    # 10 -> r0, 8 -> r1, 5 -> r1 (8 < 10), 3 -> r0 (10 < 13), 1 -> r0 (13 == 13: lower rank)
    assert assign_to_ranks([5, 10, 3, 8, 1], 2) == [[1, 2, 4], [3, 0]]


def test_pack_respects_padded_budget() -> None:
    lengths = [9, 4, 4, 4, 3]
    # longest first: [0] (9; 9*2 > 16), then 4,4,4 (3*4=12 <= 16, +3 -> 4*4=16 <= 16)
    assert pack_micro_batches(range(5), lengths, 16) == [[0], [1, 2, 3, 4]]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_micro_batches([0], [20], 16)


def test_collate_shifts_masks_and_behaviour_logprobs() -> None:
    g = GroupRecord("p", [7, 8], [comp([1, 2, 3], 1.0), comp([4], 0.0)], temperature=0.5)
    items = flatten_groups([g])
    mb = collate(items, pad_id=0)
    assert mb.input_ids.tolist() == [[7, 8, 1, 2, 3], [7, 8, 4, 0, 0]]
    # completion tokens are predicted at positions P-1 .. P+T-2 of the shifted tensors
    assert mb.loss_mask.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0]]
    assert mb.targets.tolist() == [[8, 1, 2, 3], [8, 4, 0, 0]]
    assert mb.behav_logp[0].tolist() == [0.0, -0.5, -0.5, -0.5]
    assert mb.temperature.flatten().tolist() == [0.5, 0.5]
    assert mb.num_tokens == 4


def test_sequence_advantages_skip_empty_completions_but_keep_their_reward() -> None:
    g0 = GroupRecord("a", [1], [comp([2], 1.0), comp([], 0.0), comp([3, 4], 0.0)])
    g1 = GroupRecord("b", [1], [comp([2], 1.0), comp([5], 1.0)])
    items = flatten_groups([g0, g1])
    assert [(it.group, len(it.tokens)) for it in items] == [(0, 2), (0, 3), (1, 2), (1, 2)]
    adv, flat, every = sequence_advantages([g0, g1], items, "grpo", False, 1e-6)
    # group 0 rewards 1, 0, 0: mean 1/3 -> 2/3, -1/3, -1/3; group 1 is degenerate
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, 0.0, 0.0])
    assert flat == 1
    assert every.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0])
    # KL in the reward lowers the first sequence's reward by 0.3: 0.7, 0, 0 -> mean 0.2333
    adv, _, _ = sequence_advantages(
        [g0, g1], items, "grpo", False, 1e-6, np.array([0.3, 0.0, 0.0, 0.0])
    )
    assert adv[0] == pytest.approx(0.7 - 0.7 / 3)


def test_lr_schedule_warmup_then_cosine() -> None:
    cfg = TrainerConfig(warmup_steps=3, lr_schedule="cosine", total_steps=13, min_lr_ratio=0.1)
    fn = lr_lambda(cfg)
    assert [fn(s) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert fn(3) == pytest.approx(1.0)
    assert fn(8) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert fn(13) == pytest.approx(0.1)
    assert lr_lambda(TrainerConfig())(100) == 1.0


def test_lr_schedule_counts_trainer_steps_with_minibatches() -> None:
    fn = lr_lambda(TrainerConfig(warmup_steps=1), updates_per_step=2)
    # updates 0 and 1 belong to step 0 (warm-up), 2 and 3 to step 1
    assert [fn(u) for u in range(4)] == pytest.approx([0.5, 0.5, 1.0, 1.0])


def test_split_groups_into_minibatches() -> None:
    from trainer_service.step import split_groups

    groups = [GroupRecord(f"p{i}", [1], [comp([2], 0.0)]) for i in range(5)]
    sizes = [[g.prompt_id for g in part] for part in split_groups(groups, 2)]
    assert sizes == [["p0", "p1"], ["p2", "p3", "p4"]]
    assert len(split_groups(groups[:1], 4)) == 1


def test_ds_config_per_device() -> None:
    cpu = ds_config(TrainerConfig(zero_stage=3), world_size=2)
    assert cpu["bf16"]["enabled"] is False and cpu["zero_optimization"]["stage"] == 3
    assert cpu["managed_gradient_accumulation"] is False
    assert ds_config(TrainerConfig(device="cuda"), 1)["bf16"]["enabled"] is True


def test_write_model_dir_is_atomic_and_loadable(tmp_path: Path) -> None:
    from areal_hex.config import ModelConfig, TinyModelConfig
    from areal_hex.models import load_model, materialize

    src = materialize(ModelConfig(tiny=TinyModelConfig(num_layers=1)), tmp_path / "v0")
    model = load_model(src)
    tensors = {n: p.detach() * 2 for n, p in model.named_parameters()}
    out = write_model_dir(tensors, src, tmp_path / "v1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0", "v1"]  # no temp dir left
    assert (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    again = load_model(out)
    w0 = model.model.embed_tokens.weight
    assert torch.allclose(again.model.embed_tokens.weight, 2 * w0)
    assert torch.allclose(again.lm_head.weight, 2 * w0)  # tied, stored once


def test_collect_versions_keeps_newest_and_v0(tmp_path: Path) -> None:
    for v in (0, 1, 2, 3, 10):
        (tmp_path / f"v{v}").mkdir()
    (tmp_path / ".v11.tmp-1").mkdir()
    removed = collect_versions(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["v1", "v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".v11.tmp-1", "v0", "v10", "v3"]


def test_collect_versions_drops_a_dead_lineage_above_the_current(tmp_path: Path) -> None:
    """A trainer resumed at v5 after its predecessor published up to v16: v5 stays (it is
    the version the servers are told to load), the dead lineage's v14-v16 go."""
    for v in (0, 5, 14, 15, 16):
        (tmp_path / f"v{v}").mkdir()
    removed = collect_versions(tmp_path, keep=3, current=5)
    assert sorted(p.name for p in removed) == ["v14", "v15", "v16"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v0", "v5"]


def test_publisher_republishing_below_newer_versions_keeps_its_own(tmp_path: Path) -> None:
    from areal_hex.config import ModelConfig, TinyModelConfig
    from areal_hex.models import load_model, materialize
    from trainer_service.publish import AsyncPublisher

    src = materialize(ModelConfig(tiny=TinyModelConfig(num_layers=1)), tmp_path / "model")
    weights = tmp_path / "weights"
    for v in (14, 15, 16):
        (weights / f"v{v}").mkdir(parents=True)
        (weights / f"v{v}" / "config.json").write_text("{}")
    announced: list[tuple[int, str]] = []
    pub = AsyncPublisher(weights, src, 3, lambda v, p: announced.append((v, p)))
    tensors = {n: p.detach() for n, p in load_model(src).named_parameters()}
    pub.publish_now(5, tensors)
    assert sorted(p.name for p in weights.iterdir()) == ["v5"]
    assert (weights / "v5" / "config.json").is_file()
    assert announced == [(5, str((weights / "v5").resolve()))]


def test_resume_picks_newest_complete(tmp_path: Path) -> None:
    for s in (2, 4, 6):
        (tmp_path / f"step{s}").mkdir()
    for s in (2, 4):
        (tmp_path / f"step{s}" / MARKER).write_text("{}")
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 4]
    assert resolve_resume("auto", tmp_path) == tmp_path / "step4"
    assert resolve_resume("none", tmp_path) is None
    assert resolve_resume("auto", tmp_path / "missing") is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_resume(str(tmp_path / "step6"), tmp_path)


def test_replay_roundtrip_and_wraparound(tmp_path: Path) -> None:
    groups = [GroupRecord(f"p{i}", [1, 2], [comp([3, i], float(i))]) for i in range(3)]
    groups[1].completions[0].server, groups[1].completions[0].gpu_kind = "http://a", "H20"
    src = ReplayConsumer(write_replay(tmp_path / "g.jsonl", groups))
    b = src.get_batch(4)
    assert [g.prompt_id for g in b.groups] == ["p0", "p1", "p2", "p0"]
    assert b.entry_ids == ["0-0", "0-1", "0-2", "1-0"]
    assert b.groups[2].completions[0].token_ids.tolist() == [3, 2]
    origin = [(c.server, c.gpu_kind) for g in b.groups[:2] for c in g.completions]
    assert origin == [("", ""), ("http://a", "H20")]
    (tmp_path / "bad.jsonl").write_text('{"prompt_id": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a group record"):
        ReplayConsumer(tmp_path / "bad.jsonl")
    line = json.dumps(group_to_json(groups[1])).replace('"H20"', "7")
    (tmp_path / "kind.jsonl").write_text(line + "\n")
    with pytest.raises(ValueError, match="kind.jsonl:1: not a group record.*gpu_kind"):
        ReplayConsumer(tmp_path / "kind.jsonl")


def test_launcher_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    from hexctl.cli.train_cmd import launcher_command, launcher_env, rank_env

    # a test that ran DeepSpeed in this process earlier set it in os.environ
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)

    cfg = load_config(None, ["trainer.num_ranks=2", "trainer.master_port=29999"])
    cmd = launcher_command(cfg, "c.yaml", ["trainer.lr=1"])
    assert cmd[1:] == [
        "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "29999",
        "--module", "trainer_service.main", "c.yaml", "trainer.lr=1",
    ]  # fmt: skip
    assert launcher_env(cfg)["DS_ACCELERATOR"] == "cpu"
    cfg = load_config(
        None, ["trainer.launcher=torchrun", "trainer.device=cuda", "trainer.num_ranks=2"]
    )
    cmd = launcher_command(cfg, "c.yaml", [])
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc_per_node"]
    # one rank on one node starts itself, with the launcher's rendezvous variables
    one = load_config(None, ["trainer.master_port=29998"])
    assert launcher_command(one, "c.yaml", ["trainer.lr=1"])[1:] == [
        "-m", "trainer_service.main", "c.yaml", "trainer.lr=1"
    ]  # fmt: skip
    env = rank_env(one)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("0", "1", "29998")
    monkeypatch.setenv("PET_NNODES", "2")  # one rank per node on two nodes: the launcher
    assert launcher_command(one, "c.yaml", [])[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert "DS_ACCELERATOR" not in launcher_env(cfg) or launcher_env(cfg)["DS_ACCELERATOR"] != "cpu"


def test_train_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from hexctl.cli import main

    assert main(["train", "trainer.zero_stage=4"]) == 2
    assert "trainer.zero_stage" in capsys.readouterr().err
    assert main(["train", "trainer.lr=1"]) == 2
    assert "run.run_id" in capsys.readouterr().err
    assert main(["train", "run.run_id=x"]) == 2
    assert "redis.url" in capsys.readouterr().err
    url = "redis.url=redis://127.0.0.1:1"
    assert main(["train", "run.run_id=x", url, "trainer.checkpoint_every=200"]) == 2
    assert "buffer.max_pending (1024)" in capsys.readouterr().err
