"""PPO's critic side as pure tensor functions: outcome rewards placed on tokens,
generalized advantage estimation (GAE), whitening, and the (clipped) value loss.

Shapes follow `areal_hex.algorithms`: token tensors are (N, T), position t holding the
step that emits token t + 1, with a 0/1 `mask` on the completion tokens. A value
`values[:, t]` is the critic's estimate V(s_t) of the state before that token.

GAE (Schulman et al. 2016) over the masked tokens of each row, read back to front:

    delta_t = r_t + gamma * V(s_next) - V(s_t)
    A_t     = delta_t + gamma * lam * A_next
    R_t     = A_t + V(s_t)            (the critic's regression target)

where `next` is the next masked position of the row (V = 0 and A = 0 past the last
one: the episode ends with the completion; no bootstrap). Unmasked positions are
skipped: they neither add a TD error nor break the chain, so a row may hold its prompt
and its padding around the completion.

The value loss is 1/2 (V - R)^2 per token, or with `clip` c PPO's pessimistic form
1/2 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), aggregated like the policy
loss (`algorithms.aggregate`, the step's global counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def terminal_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """(N,) sequence scores placed on each row's last masked token; zeros elsewhere.
    A row without masked tokens gets nothing. -> (N, T)."""
    import torch

    mask = mask.float()
    t = mask.shape[1]
    positions = torch.arange(t, device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros_like(mask, dtype=scores.dtype)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = scores[rows]
    return out


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimates and returns over the masked tokens.

    rewards, values, mask: (N, T) -> (advantages, returns), (N, T) each. At an unmasked
    position the advantage is that of the next masked one (the chain passes through),
    and the return is that advantage plus the position's value; only masked positions
    are meant to be read. No gradient flows (the critic's values are targets here).
    """
    import torch

    with torch.no_grad():
        m = mask.bool()
        rewards, values = rewards.float(), values.float()
        n, t = values.shape
        adv = torch.zeros_like(values)
        acc = values.new_zeros(n)  # A of the next masked position
        nxt = values.new_zeros(n)  # V of the next masked position
        for i in range(t - 1, -1, -1):
            live = m[:, i]
            delta = rewards[:, i] + gamma * nxt - values[:, i]
            acc = torch.where(live, delta + gamma * lam * acc, acc)
            nxt = torch.where(live, values[:, i], nxt)
            adv[:, i] = acc
        return adv, adv + values


@dataclass
class Moments:
    """Masked sums of one share of the step, added over micro-batches and ranks before
    whitening (so the statistics are those of the whole step)."""

    count: float = 0.0
    total: float = 0.0
    squares: float = 0.0

    @classmethod
    def of(cls, x: Tensor, mask: Tensor) -> Moments:
        m = mask.float()
        x = x.double() * m
        return cls(float(m.sum()), float(x.sum()), float((x * x).sum()))

    def __add__(self, other: Moments) -> Moments:
        return Moments(
            self.count + other.count, self.total + other.total, self.squares + other.squares
        )

    def mean_var(self) -> tuple[float, float]:
        """Mean and the unbiased (Bessel-corrected) variance; variance 0 for one value."""
        if self.count <= 0:
            return 0.0, 0.0
        mean = self.total / self.count
        var = max(self.squares / self.count - mean * mean, 0.0)
        if self.count > 1:
            var *= self.count / (self.count - 1)
        return mean, var


def whiten(x: Tensor, mask: Tensor, moments: Moments | None = None, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with the masked mean and unbiased variance (of the
    given `moments`, or of `x` itself); masked-out positions become 0. (N, T) -> (N, T)."""
    stats = moments if moments is not None else Moments.of(x, mask)
    mean, var = stats.mean_var()
    return ((x - mean) / (var + eps) ** 0.5) * mask.float()


@dataclass
class ValueTerms:
    """Per-token outputs of the value loss, (N, T) each."""

    loss: Tensor  # 1/2 the squared error chosen, not yet aggregated
    clipped: Tensor  # bool: the clipped prediction gave the larger error


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None = None
) -> ValueTerms:
    """Per-token critic loss. `values` (N, T) carries the gradient; `old_values` are the
    critic's predictions when the returns were computed, `returns` the targets. With
    `clip` c the new prediction may move at most c from the old one before the error
    stops shrinking (PPO's value clip; the larger of the two errors is kept)."""
    import torch

    returns = returns.detach()
    err = (values - returns).square()
    if clip is None:
        return ValueTerms(loss=0.5 * err, clipped=torch.zeros_like(err, dtype=torch.bool))
    if clip <= 0:
        raise ValueError(f"algo.value_clip {clip}: expected a value > 0 (or null for no clip)")
    old = old_values.detach()
    moved = old + (values - old).clamp(-clip, clip)
    err_clipped = (moved - returns).square()
    return ValueTerms(loss=0.5 * torch.maximum(err, err_clipped), clipped=err_clipped > err)


def explained_variance(residuals: Moments, returns: Moments) -> float:
    """1 - Var(R - V) / Var(R) from the moments of the residuals R - V and of the returns
    over the masked tokens (1: a perfect critic; <= 0: no better than a constant); nan
    when the returns do not vary."""
    ret_var = returns.mean_var()[1]
    return 1.0 - residuals.mean_var()[1] / ret_var if ret_var > 0 else float("nan")
