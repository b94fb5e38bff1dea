"""The critic of PPO (`algo.advantage: gae`): a value model, its no-grad values at the
step start, GAE advantages from them, and its own optimizer update.

The value model is the actor's architecture with a scalar head per token (transformers'
token classification with one label), initialised from the actor's weights, in its own
DeepSpeed engine (own optimizer, LR `algo.critic_lr`, ZeRO as the actor's). Per step,
before any update:

1. values V(s_t) of every micro-batch with the critic's current weights (like the
   proximal log-probs, recomputed at train time, so a stale batch is valued by today's
   critic);
2. token rewards: the completion's (shaped) reward on its last token, minus
   kl_coef x KL(pi_prox || pi_ref) on every token with `kl_in_reward`;
3. GAE advantages and returns per micro-batch, then the advantages whitened with the
   mean and variance of the whole step (summed over micro-batches and ranks);

then, for each minibatch, the policy update (skipped during `critic_warmup_steps`) and
one critic update on 1/2 max((V - R)^2, (clip(V, V_old +- c) - R)^2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from areal_hex.algorithms import GlobalCounts, aggregate, kl_estimate
from areal_hex.config.algo import AlgoConfig
from areal_hex.config.trainer import TrainerConfig
from areal_hex.gae import Moments, gae, terminal_rewards, value_loss, whiten
from areal_hex.record import GroupRecord
from trainer_service.batching import MicroBatch, SeqItem, Shaping, shaped_rewards

if TYPE_CHECKING:
    import torch

CHECKPOINT_TAG = "critic"  # the critic's engine files inside a checkpoint step<N>/


def build_value_model(model_dir: str | Path) -> torch.nn.Module:
    """The actor's architecture and weights with a one-output token head (new, small
    random weights) in place of the LM head, in training mode, fp32 on CPU (the engine
    moves and casts it). No dropout before the head (transformers' default for token
    classification is 0.1): the values at the step start and in the update must be the
    same function."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the new head and the dropped LM head are expected
    try:
        config = AutoConfig.from_pretrained(str(model_dir), num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(
            str(model_dir), config=config, dtype=torch.float32
        )
    finally:
        hf_logging.set_verbosity(previous)
    return model.train()


def build_critic(
    model_dir: str | Path, trainer: TrainerConfig, algo: AlgoConfig, world: int
) -> Any:
    """The critic's DeepSpeed engine: the trainer's settings with `algo.critic_lr`."""
    from trainer_service.engine import build_engine

    lr = algo.critic_lr if algo.critic_lr is not None else trainer.lr
    return build_engine(
        build_value_model(model_dir),
        trainer.model_copy(update={"lr": lr}),
        world,
        algo.ppo_minibatches,
    )


def token_values(model: Any, mb: MicroBatch) -> torch.Tensor:
    """(B, L - 1) values: position t holds V(s_t), the state before token t + 1 (the
    layout of the log-probs)."""
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
    return out.logits[:, :-1, 0].float()


@dataclass
class CriticBatch:
    """GAE's results for one minibatch's micro-batches, before the update."""

    old_values: list[Any] = field(default_factory=list)  # (B, L - 1) each
    returns: list[Any] = field(default_factory=list)
    advantages: list[Any] = field(default_factory=list)  # raw, then whitened in place
    moments: Moments = field(default_factory=Moments)  # of the raw advantages


def sequence_scores(
    groups: Sequence[GroupRecord], items: Sequence[SeqItem], shaping: Shaping
) -> np.ndarray:
    """(N,) the reward of each trained sequence after the overlong penalty."""
    rewards = shaped_rewards(groups, items, None, shaping)
    return np.array([rewards[it.group][it.completion] for it in items], dtype=np.float32)


def estimate(
    engine: Any,
    algo: AlgoConfig,
    mbs: Sequence[MicroBatch],
    scores: np.ndarray,
    prox: Sequence[Any],
    ref: Sequence[Any],
) -> CriticBatch:
    """No-grad values of every micro-batch and GAE over them (not yet whitened)."""
    import torch

    out = CriticBatch()
    score_t = torch.tensor(np.append(scores, 0.0), dtype=torch.float32)
    with torch.no_grad():
        for mb, p, r in zip(mbs, prox, ref, strict=True):
            values = token_values(engine, mb)
            rewards = terminal_rewards(score_t.to(values.device)[mb.seq_index], mb.loss_mask)
            if algo.kl_coef > 0 and algo.kl_in_reward:
                kl = kl_estimate(p, r, algo.kl_estimator, algo.kl_clamp)
                rewards = rewards - algo.kl_coef * kl * mb.loss_mask
            adv, ret = gae(rewards, values, mb.loss_mask, algo.gamma, algo.lam)
            out.old_values.append(values)
            out.returns.append(ret)
            out.advantages.append(adv * mb.loss_mask)
            out.moments = out.moments + Moments.of(adv, mb.loss_mask)
    return out


def whiten_all(
    batches: Sequence[CriticBatch], mbs: Sequence[Sequence[MicroBatch]], total: Moments
) -> None:
    """Whiten every minibatch's advantages with the whole step's `total` moments."""
    for cb, mb_list in zip(batches, mbs, strict=True):
        cb.advantages = [
            whiten(a, mb.loss_mask, total) for a, mb in zip(cb.advantages, mb_list, strict=True)
        ]


def sequence_means(cb: CriticBatch, mbs: Sequence[MicroBatch], n: int) -> np.ndarray:
    """(n,) mean token advantage of each sequence this rank holds (0 for the others)."""
    out = np.zeros(n, dtype=np.float32)
    for adv, mb in zip(cb.advantages, mbs, strict=True):
        per = (adv * mb.loss_mask).sum(dim=1) / mb.loss_mask.sum(dim=1).clamp(min=1.0)
        for row, idx in enumerate(mb.seq_index.tolist()):
            if idx >= 0:
                out[idx] = float(per[row])
    return out


CRITIC_SUMS = ("value_loss", "value_clipped", "value", "return", "tokens")


def update(
    engine: Any,
    algo: AlgoConfig,
    mbs: Sequence[MicroBatch],
    cb: CriticBatch,
    counts: GlobalCounts,
    world: int,
) -> dict[str, float]:
    """One optimizer update of the critic over a minibatch's micro-batches; this rank's
    sums for the step's statistics (keys CRITIC_SUMS) and the moments of the returns and
    residuals before the update ("ret_*", "res_*")."""
    sums = dict.fromkeys(CRITIC_SUMS, 0.0)
    ret_m, res_m = Moments(), Moments()
    for mb, old, ret in zip(mbs, cb.old_values, cb.returns, strict=True):
        values = token_values(engine, mb)
        terms = value_loss(values, old, ret, algo.value_clip)
        loss = aggregate(terms.loss, mb.loss_mask, algo.aggregation, counts)
        engine.backward(loss * world)
        m = mb.loss_mask
        sums["value_loss"] += float(loss.detach())
        sums["value_clipped"] += float((terms.clipped * m).sum())
        sums["value"] += float((old * m).sum())
        sums["return"] += float((ret * m).sum())
        sums["tokens"] += float(m.sum())
        ret_m = ret_m + Moments.of(ret, m)
        res_m = res_m + Moments.of(ret - old, m)
    engine.step()
    for name, mo in (("ret", ret_m), ("res", res_m)):
        sums.update({f"{name}_n": mo.count, f"{name}_s": mo.total, f"{name}_q": mo.squares})
    return sums


def summary(reduced: dict[str, float], minibatches: int) -> dict[str, float | None]:
    """The step's critic statistics from the sums over ranks and minibatches: the mean
    value loss over minibatches, the fraction of tokens clipped, the mean value and
    return, and the explained variance of the values at the step start (None when the
    returns do not vary)."""
    from areal_hex.gae import explained_variance

    tokens = max(reduced["tokens"], 1.0)
    ret = Moments(reduced["ret_n"], reduced["ret_s"], reduced["ret_q"])
    res = Moments(reduced["res_n"], reduced["res_s"], reduced["res_q"])
    ev = explained_variance(res, ret)
    return {
        "value_loss": reduced["value_loss"] / max(minibatches, 1),
        "value_clip_frac": reduced["value_clipped"] / tokens,
        "value_mean": reduced["value"] / tokens,
        "return_mean": reduced["return"] / tokens,
        "explained_var": ev if ev == ev else None,
    }
