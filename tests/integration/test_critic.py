"""PPO's critic on real DeepSpeed (CPU, gloo, one rank in this process): the value loss
falls on a fixed batch, the warm-up leaves the policy alone, and a checkpoint restores
the critic with the policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from areal_hex.config import AlgoConfig, ModelConfig, TinyModelConfig, TrainerConfig


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from areal_hex.models import materialize
    from trainer_service.engine import init_single_rank
    from trainer_service.synthetic import synthetic_groups

    init_single_rank("cpu")
    d = tmp_path_factory.mktemp("critic")
    model_dir = materialize(ModelConfig(tiny=TinyModelConfig(num_layers=1), seed=4), d / "m")
    groups = synthetic_groups(4, 4, 64, seed=7, temperature=1.0)
    return {"dir": d, "model": model_dir, "groups": groups}


def _engines(model_dir: Path, algo: AlgoConfig) -> tuple[Any, Any]:
    from areal_hex.models import load_model
    from trainer_service.critic import build_critic
    from trainer_service.engine import build_engine

    torch.manual_seed(0)
    t = TrainerConfig(lr=1e-3, micro_batch_tokens=4096)
    actor = build_engine(load_model(model_dir).train(), t, world_size=1)
    return actor, build_critic(model_dir, t, algo, world=1)


def _ctx(actor: Any, critic: Any, algo: AlgoConfig, step: int = 0, budget: int = 4096) -> Any:
    from trainer_service.step import StepContext

    return StepContext(actor, algo, budget, 16, 0, rank=0, world=1, critic=critic, step=step)


def _params(engine: Any) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()])


def test_value_loss_falls_and_warmup_leaves_the_policy(setup: dict[str, Any]) -> None:
    from trainer_service.step import optimize

    algo = AlgoConfig(advantage="gae", gamma=1.0, lam=0.95, critic_lr=3e-3, critic_warmup_steps=3)
    actor, critic = _engines(setup["model"], algo)
    before_actor, before_critic = _params(actor), _params(critic)
    losses, evs = [], []
    for step in range(6):  # the same batch: the critic fits its returns
        res = optimize(_ctx(actor, critic, algo, step=step), setup["groups"])
        stats = res.extra["critic"]
        losses.append(stats["value_loss"])
        evs.append(stats["explained_var"])
        if step == 2:  # the last warm-up step: the policy has not moved, the critic has
            assert torch.equal(_params(actor), before_actor)
            assert not torch.equal(_params(critic), before_critic)
            assert res.grad_norm is None and res.sums["loss"] == 0.0
    assert not torch.equal(_params(actor), before_actor)  # trained after the warm-up
    assert losses[-1] < 0.5 * losses[0], losses
    assert evs[-1] is not None and evs[-1] > evs[0], evs
    assert res.sums["loss"] != 0.0 and res.advantages.shape == (res.num_sequences,)


def test_token_advantages_do_not_depend_on_micro_batches(setup: dict[str, Any]) -> None:
    from trainer_service.step import _prepare, _whiten

    algo = AlgoConfig(advantage="gae", gamma=0.99, lam=0.9)
    actor, critic = _engines(setup["model"], algo)
    per_budget = []
    for budget in (4096, 40):
        prepared = [_prepare(_ctx(actor, critic, algo, budget=budget), setup["groups"])]
        _whiten(_ctx(actor, critic, algo, budget=budget), prepared)
        p = prepared[0]
        assert p.critic is not None
        by_seq: dict[int, torch.Tensor] = {}
        for adv, mb in zip(p.critic.advantages, p.mbs, strict=True):
            for row, idx in enumerate(mb.seq_index.tolist()):
                by_seq[idx] = adv[row][mb.loss_mask[row] > 0]
        per_budget.append((len(p.mbs), by_seq, p.all_adv))
    (n_whole, whole, seq_whole), (n_micro, micro, seq_micro) = per_budget
    assert n_whole == 1 and n_micro >= 4
    for idx, adv in whole.items():
        torch.testing.assert_close(micro[idx], adv, atol=1e-5, rtol=1e-5)
    allv = torch.cat(list(whole.values()))
    assert abs(float(allv.mean())) < 1e-5 and float(allv.std()) == pytest.approx(1.0, abs=1e-4)
    assert seq_micro == pytest.approx(seq_whole, abs=1e-5)


def test_checkpoint_restores_the_critic(setup: dict[str, Any]) -> None:
    from trainer_service import checkpoint
    from trainer_service.critic import CHECKPOINT_TAG
    from trainer_service.step import optimize

    algo = AlgoConfig(advantage="gae", critic_lr=3e-3)
    actor, critic = _engines(setup["model"], algo)
    optimize(_ctx(actor, critic, algo), setup["groups"])
    saved_critic, saved_actor = _params(critic), _params(actor)
    root = setup["dir"] / "ckpt"
    path = checkpoint.save(actor, root, 1, {"step": 1}, keep=2, extra={CHECKPOINT_TAG: critic})
    assert (path / CHECKPOINT_TAG).is_dir()
    checkpoint.verify(path)  # the critic's files are in the manifest
    optimize(_ctx(actor, critic, algo, step=1), setup["groups"])
    assert not torch.equal(_params(critic), saved_critic)
    state = checkpoint.load(actor, path, extra={CHECKPOINT_TAG: critic})
    assert state["step"] == 1
    assert torch.equal(_params(critic), saved_critic)
    assert torch.equal(_params(actor), saved_actor)
    # the same next step from the restored state gives the same critic
    optimize(_ctx(actor, critic, algo, step=1), setup["groups"])
    again = _params(critic)
    checkpoint.load(actor, path, extra={CHECKPOINT_TAG: critic})
    optimize(_ctx(actor, critic, algo, step=1), setup["groups"])
    torch.testing.assert_close(_params(critic), again)
    with pytest.raises(RuntimeError, match="holds no"):
        checkpoint.load(actor, path, extra={"other": critic})


def _train(
    d: Path, model_dir: Path, replay: Path, name: str, steps: int, kill_at: int | None = None
) -> Path:
    """`areal-hex train` (one rank, started itself) on replayed groups, PPO with
    a critic warmed up for one step; checkpoints every step. With `kill_at`, the whole
    process group is SIGKILLed once that step's row is written."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml

    cfg = {
        "run": {"run_id": name, "output_dir": str(d / "runs")},
        "model": {"path": str(model_dir)},
        "buffer": {"groups_per_step": 2},
        "algo": {"advantage": "gae", "lam": 0.9, "critic_lr": 3e-3, "critic_warmup_steps": 1},
        "trainer": {
            "total_steps": steps,
            "lr": 1e-3,
            "adam_eps": 1e-6,
            "replay_path": str(replay),
            "checkpoint_every": 1,
        },
    }
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "hexctl.cli", "train", str(path)]
    log = open(d / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    run_dir = d / "runs" / name
    metrics = run_dir / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            if kill_at is not None and metrics.is_file():
                lines = metrics.read_text().splitlines()
                if any(json.loads(ln)["step"] >= kill_at for ln in lines if ln.strip()):
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
                    return run_dir
            time.sleep(0.05)
        assert proc.returncode == 0, (d / f"{name}.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return run_dir


@pytest.mark.timeout(900)
def test_a_killed_run_resumes_like_an_uninterrupted_one(setup: dict[str, Any]) -> None:
    """SIGKILL of the trainer (policy and critic ranks alike) mid-run, then resume: the
    critic's weights, optimizer and schedule come back from the checkpoint, so the steps
    after it give the losses and final weights of a run that never stopped."""
    import json

    from safetensors.torch import load_file

    from trainer_service.sources import write_replay

    d = setup["dir"]
    replay = write_replay(d / "groups.jsonl", setup["groups"])
    straight = _train(d, setup["model"], replay, "straight", 6)
    killed = _train(d, setup["model"], replay, "killed", 6, kill_at=2)

    def rows(run: Path) -> list[dict]:
        return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]

    first = rows(killed)
    assert first[-1]["step"] < 6, "the run ended before the kill"
    assert any((killed / "checkpoints").glob("step*/critic"))
    _train(d, setup["model"], replay, "killed", 6)
    a = {r["step"]: r for r in rows(straight)}
    resumed = rows(killed)[len(first) :]
    assert resumed and resumed[-1]["step"] == 6
    assert a[1]["loss"] == 0.0 and a[1]["value_loss"] > 0  # the warm-up step
    for r in resumed:
        assert r["value_loss"] == pytest.approx(a[r["step"]]["value_loss"], abs=1e-6)
        assert r["loss"] == pytest.approx(a[r["step"]]["loss"], abs=1e-6)
        assert r["explained_var"] == pytest.approx(a[r["step"]]["explained_var"], abs=1e-5)
    wa = load_file(str(straight / "weights" / "v6" / "model.safetensors"))
    wb = load_file(str(killed / "weights" / "v6" / "model.safetensors"))
    for k, v in wa.items():
        torch.testing.assert_close(wb[k], v, atol=1e-6, rtol=0)
