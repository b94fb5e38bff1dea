"""One trainer step over a batch of groups, on every rank.

Rank r trains only its share of the sequences, in micro-batches of at most
`micro_batch_tokens` padded tokens. The loss of each micro-batch is
sum(per-token loss x weight) with weights from the step's GLOBAL token and sequence
counts, so micro-batches and ranks add up to the whole-batch loss exactly. DeepSpeed
averages gradients over ranks, hence the factor `world` on each backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from areal_hex.algorithms import GlobalCounts, kl_estimate, mismatch_sums, policy_loss
from areal_hex.config.algo import AlgoConfig
from areal_hex.record import GroupRecord
from trainer_service import critic
from trainer_service.batching import (
    MicroBatch,
    Shaping,
    assign_to_ranks,
    collate,
    dummy_batch,
    flatten_groups,
    pack_micro_batches,
    sequence_advantages,
)
from trainer_service.engine import token_logprobs
from trainer_service.prox import prox_from_loss_pass
from trainer_service.reference import reference_logprobs

# sums reduced over ranks (SUM) and maxima (MAX), in this order
_SUM_KEYS = (
    "loss",
    "tokens",
    "clipped",
    "dual_clipped",
    "behav_w",
    "behav_masked",
    "entropy",
    "kl",
)
_MAX_KEYS = ("behav_w_max",)


@dataclass
class StepResult:
    sums: dict[str, float]
    maxima: dict[str, float]
    num_sequences: int
    num_tokens: int  # prompt + completion tokens processed (all ranks)
    degenerate_groups: int
    advantages: np.ndarray  # every completion's advantage, batch order
    grad_norm: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepContext:
    engine: Any  # DeepSpeed engine
    algo: AlgoConfig
    micro_batch_tokens: int
    fixed_len: int
    pad_id: int
    rank: int
    world: int
    ref_model: Any | None = None  # frozen reference policy (KL), or None
    # loads the reference model for a batch whose records lack π_ref log-probs (held on
    # demand when a reference task scores them: trainer_service/reference.py)
    load_ref: Callable[[], Any] | None = None
    device: str = "cpu"
    max_new_tokens: int = 0  # the generation budget (overlong penalty)
    version: int = 0  # version of the weights being trained (set by the loop each step)
    # Called right before the optimizer step changes the weights: waits for a weight
    # write still reading them (returns the seconds waited).
    before_update: Callable[[], float] | None = None
    # Heterogeneous ranks: relative speed of each rank (None: equal shares), and whether
    # to follow the speeds the ranks measure (trainer.rank_speeds, balance_measured).
    speeds: list[float] | None = None
    balance_measured: bool = False
    slowdown: float = 1.0  # trainer.emulate_slowdown of this rank (1: none)
    # Whether a micro-batch's passes hold a collective (ZeRO-2/3 reduce gradients in every
    # backward, ZeRO-3 gathers parameters in every forward): then every rank runs as many
    # micro-batches as the busiest one. ZeRO-0/1 reduce only in `engine.step()`, so there
    # each rank runs just its own share and a faster rank never waits mid-step.
    lockstep: bool = True
    critic: Any | None = None  # the critic's DeepSpeed engine (algo.advantage gae)
    step: int = 0  # trainer steps done before this one (set by the loop; critic warm-up)


def _slowed(ctx: StepContext, t0: float) -> None:
    """`trainer.emulate_slowdown`: stretch this rank's compute since `t0` by its factor.
    Callers time passes without a collective in them (`lockstep` off), so no wait for
    another rank is stretched."""
    if ctx.slowdown > 1.0:
        time.sleep((ctx.slowdown - 1.0) * (time.perf_counter() - t0))


def _all_reduce(values: list[float], op: str, device: str) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def plan_micro_batches(
    ctx: StepContext, groups: Sequence[GroupRecord]
) -> tuple[list[MicroBatch], list, GlobalCounts]:
    """This rank's micro-batches (in `lockstep`, padded with zero-weight ones to the
    ranks' maximum count), every sequence of the step, and the step's global counts."""
    items = flatten_groups(groups, drop_truncated=ctx.algo.overlong_mask)
    lengths = [len(it.tokens) for it in items]
    share = assign_to_ranks(lengths, ctx.world, ctx.speeds)[ctx.rank]
    packs = pack_micro_batches(share, lengths, ctx.micro_batch_tokens)
    mbs = [collate([items[i] for i in p], ctx.pad_id).to(ctx.device) for p in packs]
    if ctx.lockstep:
        (most,) = _all_reduce([float(len(packs))], "max", ctx.device)
    else:  # a rank without a share still gives every parameter a (zero) gradient
        most = 1.0
    mbs += [dummy_batch(ctx.pad_id).to(ctx.device) for _ in range(int(most) - len(packs))]
    counts = GlobalCounts(
        tokens=sum(it.num_completion_tokens for it in items),
        sequences=len(items),
        fixed_len=ctx.fixed_len,
    )
    return mbs, items, counts


def _reference_pass(
    ctx: StepContext, mbs: list[MicroBatch], with_prox: bool = True
) -> tuple[list[Any | None], list[Any | None]]:
    """No-grad log-probs before the update: the proximal policy (current weights, unless
    the loss pass gives them: `with_prox` False) and the reference model, where the
    objective needs them."""
    import torch

    need_prox = with_prox and (ctx.algo.decoupled or ctx.algo.kl_coef > 0)
    prox: list[Any | None] = []
    ref: list[Any | None] = []
    with torch.no_grad():
        for mb in mbs:
            t0 = time.perf_counter()
            prox.append(token_logprobs(ctx.engine, mb)[0] if need_prox else None)
            ref.append(reference_logprobs(ctx, mb))
            _slowed(ctx, t0)
    return prox, ref


def _kl_penalty(
    ctx: StepContext, mbs: list[MicroBatch], prox: list, ref: list, n: int
) -> np.ndarray:
    """(n,) per-sequence sum of kl_coef x KL, gathered from all ranks (KL in the reward)."""
    local = np.zeros(n)
    for mb, p, r in zip(mbs, prox, ref, strict=True):
        kl = kl_estimate(p, r, ctx.algo.kl_estimator, ctx.algo.kl_clamp)
        kl = (kl * mb.loss_mask).sum(dim=1)
        for row, idx in enumerate(mb.seq_index.tolist()):
            if idx >= 0:
                local[idx] = float(kl[row]) * ctx.algo.kl_coef
    return np.asarray(_all_reduce(local.tolist(), "sum", ctx.device)) if n else local


@dataclass
class _Minibatch:
    """One optimizer update's share of the step, prepared before any update."""

    mbs: list[MicroBatch]
    items: list
    counts: GlobalCounts
    prox: list
    ref: list
    adv: Any  # (N + 1,) advantages of the sequences, then a 0 for dummy rows
    degenerate: int
    all_adv: np.ndarray
    forward_s: float = 0.0  # the no-grad passes: this rank's compute, no collective in it
    critic: critic.CriticBatch | None = None  # GAE: values, returns, token advantages
    prox_in_loss: bool = False  # `prox` is filled by the loss pass (prox.py)


def _prepare(
    ctx: StepContext, groups: Sequence[GroupRecord], prox_in_loss: bool = False
) -> _Minibatch:
    """Micro-batches, proximal/reference log-probs and advantages of `groups`; with
    `prox_in_loss`, the proximal log-probs are left to the loss pass."""
    import torch

    a = ctx.algo
    mbs, items, counts = plan_micro_batches(ctx, groups)
    t0 = time.perf_counter()
    prox, ref = _reference_pass(ctx, mbs, with_prox=not prox_in_loss)
    forward_s = time.perf_counter() - t0
    shaping = Shaping(
        overlong_max=ctx.max_new_tokens,
        overlong_buffer=a.overlong_buffer,
        overlong_factor=a.overlong_penalty,
        batch_normalize=a.batch_normalize,
        eps=a.std_eps,
    )
    if a.advantage == "gae":
        if ctx.critic is None:
            raise ValueError("algo.advantage gae needs the critic's engine (StepContext.critic)")
        t0 = time.perf_counter()
        scores = critic.sequence_scores(groups, items, shaping)
        cb = critic.estimate(ctx.critic, a, mbs, scores, prox, ref)
        forward_s += time.perf_counter() - t0
        flat = sum(bool(np.all(g.rewards == g.rewards[0])) for g in groups)
        adv = torch.zeros(len(items) + 1, device=ctx.device)  # token advantages in `cb`
        return _Minibatch(mbs, items, counts, prox, ref, adv, flat, np.zeros(0), forward_s, cb)
    penalty = None
    if a.kl_coef > 0 and a.kl_in_reward:
        penalty = _kl_penalty(ctx, mbs, prox, ref, len(items))
    seq_adv, degenerate, all_adv = sequence_advantages(
        groups, items, a.advantage, a.std_normalize, a.std_eps, penalty, shaping
    )
    adv = torch.tensor(np.append(seq_adv, 0.0), dtype=torch.float32, device=ctx.device)
    if a.denominator == "informative":
        counts = informative_counts(groups, items, all_adv, counts)
    out = _Minibatch(mbs, items, counts, prox, ref, adv, degenerate, all_adv, forward_s)
    out.prox_in_loss = prox_in_loss
    return out


def informative_counts(
    groups: Sequence[GroupRecord], items: Sequence, all_adv: np.ndarray, counts: GlobalCounts
) -> GlobalCounts:
    """The step's counts over the sequences of groups with any non-zero advantage (the
    degenerate groups' tokens still run, with weight x advantage 0)."""
    sizes = [len(g.completions) for g in groups]
    per_group = np.split(all_adv, np.cumsum(sizes)[:-1]) if groups else []
    live = {gi for gi, a in enumerate(per_group) if np.any(a != 0)}
    kept = [it for it in items if it.group in live]
    return replace(
        counts,
        tokens=sum(it.num_completion_tokens for it in kept),
        sequences=len(kept),
    )


def train_inference_mismatch(ctx: StepContext, prepared: Sequence[_Minibatch]) -> dict:
    """Mean |log pi_train - log pi_infer| and k3 KL(pi_infer || pi_train) over the tokens
    that the version being trained generated, by inference server and by GPU kind.
    Collective: every rank knows every sequence, so the keys agree across ranks."""
    import torch

    keys = sorted(
        {("server", it.server or "unknown") for p in prepared for it in p.items}
        | {("gpu_kind", it.gpu_kind or "unknown") for p in prepared for it in p.items}
    )
    if not keys or not ctx.algo.decoupled:  # no proximal recompute without decoupling
        return {}
    slot = {k: i for i, k in enumerate(keys)}
    sums = np.zeros((len(keys), 3))  # |dlogp|, k3, tokens
    for p in prepared:
        # (N, 2) the slots of each sequence's server and GPU kind
        slots = np.array(
            [
                (slot["server", it.server or "unknown"], slot["gpu_kind", it.gpu_kind or "unknown"])
                for it in p.items
            ],
            dtype=np.int64,
        ).reshape(-1, 2)
        for mb, prox in zip(p.mbs, p.prox, strict=True):
            own = mb.loss_mask * (mb.versions == ctx.version)  # tokens of this version
            abs_d, k3 = mismatch_sums(prox, mb.behav_logp, own)
            rows = torch.stack([abs_d, k3, own.sum(dim=1)], dim=1).double().cpu().numpy()
            idx = mb.seq_index.cpu().numpy()
            real = idx >= 0
            for col in range(2):  # row by row, in order: the sums of the per-row loop
                np.add.at(sums, slots[idx[real], col], rows[real])
    total = np.asarray(_all_reduce(sums.ravel().tolist(), "sum", ctx.device)).reshape(-1, 3)
    out: dict[str, dict[str, dict[str, float]]] = {"server": {}, "gpu_kind": {}}
    for (kind, name), (a, k, n) in zip(keys, total, strict=True):
        if n > 0:
            out[kind][name] = {"abs_dlogp": a / n, "k3": k / n, "tokens": int(n)}
    return out


def drift_by_lag(ctx: StepContext, prepared: Sequence[_Minibatch]) -> dict:
    """How far pi_prox is from pi_behav on the step's tokens, by each token's version lag
    (the trained version minus the one that generated it): {lag: {"abs_dlogp": mean
    |log w|, "k3": mean KL(behav || prox), "tokens": n}}, w = pi_prox / pi_behav the
    decoupled objective's behaviour weight. Lag 0 is the train-inference mismatch alone;
    lag k adds k optimizer updates, so the rows show what the staleness bound lets the
    stale tokens' weights spread to. Collective: every rank knows every sequence, so the
    lags (the keys) agree across ranks."""
    if not ctx.algo.decoupled:  # no proximal log-probs: the weight is 1
        return {}
    known = [it.versions for p in prepared for it in p.items if it.versions is not None]
    if not known:
        return {}
    lags = [ctx.version - int(v) for v in np.unique(np.concatenate(known))[::-1]]
    sums = np.zeros((len(lags), 3))  # |dlogp|, k3, tokens
    for p in prepared:
        for mb, prox in zip(p.mbs, p.prox, strict=True):
            lag = ctx.version - mb.versions  # (B, L - 1); positions off completions masked
            scored = mb.loss_mask * (mb.versions >= 0)
            for i, k in enumerate(lags):
                m = scored * (lag == k)
                abs_d, k3 = mismatch_sums(prox, mb.behav_logp, m)
                sums[i] += (float(abs_d.sum()), float(k3.sum()), float(m.sum()))
    total = np.asarray(_all_reduce(sums.ravel().tolist(), "sum", ctx.device)).reshape(-1, 3)
    return {
        str(k): {"abs_dlogp": float(a / n), "k3": float(k3 / n), "tokens": int(n)}
        for k, (a, k3, n) in zip(lags, total, strict=True)
        if n > 0
    }


def _accumulate(ctx: StepContext, mb_set: _Minibatch, sums: dict[str, float]) -> float:
    """Forward + backward of every micro-batch of one minibatch; adds statistics to
    `sums` and returns the largest behaviour weight seen."""
    a = ctx.algo
    w_max = 0.0
    for i, (mb, p, r) in enumerate(zip(mb_set.mbs, mb_set.prox, mb_set.ref, strict=True)):
        t0 = time.perf_counter()
        logp, ent = token_logprobs(
            ctx.engine, mb, with_entropy=True, entropy_grad=a.entropy_coeff > 0
        )
        if mb_set.critic is not None:  # GAE: (B, L - 1) token advantages
            adv = mb_set.critic.advantages[i]
        else:  # (B, 1) sequence advantages; index -1 (dummy rows) -> the final 0
            adv = mb_set.adv[mb.seq_index].view(-1, 1)
        behav = mb.behav_logp
        if mb_set.prox_in_loss:  # the weights of this pass are the proximal policy
            p = mb_set.prox[i] = logp.detach()
        loss, terms = policy_loss(
            a,
            logp,
            p if p is not None else behav,
            behav,
            adv,
            mb.loss_mask,
            mb_set.counts,
            ref_logp=r if not a.kl_in_reward else None,
            entropy=ent,
        )
        ctx.engine.backward(loss * ctx.world)
        _slowed(ctx, t0)
        m = mb.loss_mask
        sums["loss"] += float(loss.detach())
        sums["tokens"] += float(m.sum())
        sums["clipped"] += float((terms.clipped * m).sum())
        sums["dual_clipped"] += float((terms.dual_clipped * m).sum())
        sums["behav_w"] += float((terms.behav_weight * m).sum())
        sums["behav_masked"] += float((terms.behav_masked * m).sum())
        sums["entropy"] += float((ent.detach() * m).sum())
        if r is not None:
            kl = kl_estimate(logp.detach(), r, a.kl_estimator, a.kl_clamp)
            sums["kl"] += float((kl * m).sum())
        if m.sum() > 0:
            w_max = max(w_max, float(terms.behav_weight[m > 0].max()))
    return w_max


def split_groups(groups: Sequence[GroupRecord], k: int) -> list[list[GroupRecord]]:
    """`k` contiguous, near-equal slices of the batch (fewer if there are fewer groups)."""
    k = max(1, min(k, len(groups)))
    bounds = [round(i * len(groups) / k) for i in range(k + 1)]
    return [list(groups[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)]


def optimize(ctx: StepContext, groups: Sequence[GroupRecord]) -> StepResult:
    """One trainer step: recompute the proximal log-probs of the whole batch with the
    current weights (and the critic's values, with GAE), then one optimizer update per
    minibatch (`algo.ppo_minibatches`), each accumulating gradients over its
    micro-batches; with a critic, one critic update per minibatch too, and no policy
    update during `algo.critic_warmup_steps`. Collective: every rank calls it. The
    reported losses are means over minibatches."""
    fused = prox_from_loss_pass(ctx.algo, ctx.critic is not None)
    batches = split_groups(groups, ctx.algo.ppo_minibatches)
    prepared = [_prepare(ctx, g, prox_in_loss=fused) for g in batches]
    if ctx.critic is not None:
        _whiten(ctx, prepared)
    sums = dict.fromkeys(_SUM_KEYS, 0.0)
    critic_sums: dict[str, float] = {}
    train_policy = ctx.critic is None or ctx.step >= ctx.algo.critic_warmup_steps
    w_max, fence_s, busy_s = 0.0, 0.0, 0.0
    fenced_at: float | None = None  # when the last weight send let the update go on
    for i, mb_set in enumerate(prepared):
        t0 = time.perf_counter()
        if train_policy:
            w_max = max(w_max, _accumulate(ctx, mb_set, sums))
        if mb_set.critic is not None:
            got = critic.update(
                ctx.critic, ctx.algo, mb_set.mbs, mb_set.critic, mb_set.counts, ctx.world
            )
            critic_sums = {k: critic_sums.get(k, 0.0) + v for k, v in got.items()}
        busy_s += time.perf_counter() - t0
        if i == 0 and ctx.before_update is not None and train_policy:
            fence_s = ctx.before_update()
            fenced_at = time.perf_counter()
        if train_policy:
            ctx.engine.step()
    mismatch = train_inference_mismatch(ctx, prepared)  # the proximal log-probs are set
    drift = drift_by_lag(ctx, prepared)
    # this rank's speed: its no-grad forward passes where the step makes them (a backward
    # may wait for the other ranks' gradients), else forward + backward
    forward_s = sum(p.forward_s for p in prepared)
    own = sum(int(mb.attention_mask.sum()) for p in prepared for mb in p.mbs)
    speeds = rebalance(ctx, own, forward_s if forward_s > 0 else busy_s)
    sums["loss"] /= len(prepared)
    reduced = _all_reduce([sums[k] for k in _SUM_KEYS], "sum", ctx.device)
    (w_max,) = _all_reduce([w_max], "max", ctx.device)
    norm = ctx.engine.get_global_grad_norm() if train_policy else None
    extra: dict[str, Any] = {
        "publish_fence_s": fence_s,
        # the step's work after that wait: serial with the weight send, which it waited for
        "after_fence_s": time.perf_counter() - fenced_at if fenced_at is not None else None,
        "mismatch": mismatch,
        "drift_by_lag": drift,
        "rank_speeds": speeds,
        "own_tokens_per_s": own / max(forward_s + busy_s, 1e-9),
    }
    if critic_sums:
        keys = sorted(critic_sums)
        total = _all_reduce([critic_sums[k] for k in keys], "sum", ctx.device)
        extra["critic"] = critic.summary(dict(zip(keys, total, strict=True)), len(prepared))
    return StepResult(
        sums=dict(zip(_SUM_KEYS, reduced, strict=True)),
        maxima={"behav_w_max": w_max},
        num_sequences=sum(len(p.items) for p in prepared),
        num_tokens=sum(len(it.tokens) for p in prepared for it in p.items),
        degenerate_groups=sum(p.degenerate for p in prepared),
        advantages=np.concatenate([p.all_adv for p in prepared]),
        grad_norm=float(norm) if norm is not None else None,
        extra=extra,
    )


def _whiten(ctx: StepContext, prepared: Sequence[_Minibatch]) -> None:
    """GAE: whiten the token advantages with the whole step's moments (all minibatches,
    all ranks), when `algo.whiten_advantages`; then each minibatch's per-sequence mean
    advantage, gathered from every rank, for the step's statistics."""
    from areal_hex.gae import Moments

    batches = [p.critic for p in prepared if p.critic is not None]
    if ctx.algo.whiten_advantages:
        local = sum((cb.moments for cb in batches), Moments())
        n, s, q = _all_reduce([local.count, local.total, local.squares], "sum", ctx.device)
        critic.whiten_all(batches, [p.mbs for p in prepared], Moments(n, s, q))
    for p in prepared:
        assert p.critic is not None
        local_means = critic.sequence_means(p.critic, p.mbs, len(p.items))
        p.all_adv = np.asarray(
            _all_reduce(local_means.tolist(), "sum", ctx.device) if p.items else local_means,
            dtype=np.float32,
        )


def rebalance(ctx: StepContext, tokens: int, busy_s: float) -> list[float] | None:
    """Every rank's tokens per second of its own compute this step (collective when
    `balance_measured`); the next step's shares follow their running mean."""
    if not ctx.balance_measured or ctx.world == 1:
        return ctx.speeds
    mine = [0.0] * ctx.world
    mine[ctx.rank] = tokens / max(busy_s, 1e-9)
    measured = _all_reduce(mine, "sum", ctx.device)  # identical on every rank
    if min(measured) <= 0:
        return ctx.speeds
    prev = ctx.speeds or [1.0] * ctx.world
    norm_prev, norm_new = sum(prev), sum(measured)
    ctx.speeds = [
        0.5 * a / norm_prev + 0.5 * b / norm_new for a, b in zip(prev, measured, strict=True)
    ]
    return ctx.speeds
