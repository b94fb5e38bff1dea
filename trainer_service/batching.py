"""From group records to per-rank micro-batches: flatten, share out, pack, collate.

Every rank runs the same deterministic functions on the same broadcast batch, so each
knows its own share (and everyone else's) without further messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from areal_hex.record import GroupRecord

if TYPE_CHECKING:
    import torch


@dataclass
class SeqItem:
    """One completion as a training row: prompt + completion tokens."""

    index: int  # position among the step's trained sequences
    group: int  # index of its group in the batch
    tokens: np.ndarray  # (P + T,) int64
    prompt_len: int  # P
    behav_logp: np.ndarray  # (T,) float32
    temperature: float
    completion: int = 0  # index of the completion inside its group
    versions: np.ndarray | None = None  # (T,) policy version of each token
    server: str = ""  # inference server that produced it ("" when not recorded)
    gpu_kind: str = ""
    ref_logp: np.ndarray | None = None  # (T,) float32 π_ref log-probs, when recorded

    @property
    def num_completion_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len


def flatten_groups(groups: Sequence[GroupRecord], drop_truncated: bool = False) -> list[SeqItem]:
    """Completions with at least one token, in batch order (empty ones carry no loss;
    they still count in their group's reward baseline). With `drop_truncated`,
    completions cut at the length limit are left out of the loss the same way."""
    items: list[SeqItem] = []
    for gi, g in enumerate(groups):
        for ci, c in enumerate(g.completions):
            if len(c.token_ids) == 0 or (drop_truncated and c.finish_reason == "length"):
                continue
            tokens = np.concatenate([g.prompt_ids, c.token_ids]).astype(np.int64)
            items.append(
                SeqItem(
                    index=len(items),
                    group=gi,
                    tokens=tokens,
                    prompt_len=len(g.prompt_ids),
                    behav_logp=c.logprobs.astype(np.float32),
                    temperature=float(g.temperature) if g.temperature > 0 else 1.0,
                    completion=ci,
                    versions=c.versions,
                    server=c.server,
                    gpu_kind=c.gpu_kind,
                    ref_logp=None if c.ref_logprobs is None else c.ref_logprobs.astype(np.float32),
                )
            )
    return items


def assign_to_ranks(
    lengths: Sequence[int], world: int, speeds: Sequence[float] | None = None
) -> list[list[int]]:
    """Longest-first greedy: each sequence goes to the rank that would finish it first,
    (tokens so far + its tokens) / the rank's speed (ties: the lower rank). Equal speeds
    (None) give equal token loads. Returns the sequence indices of each rank."""
    speed = list(speeds) if speeds is not None else [1.0] * world
    if len(speed) != world:
        raise ValueError(f"{len(speed)} rank speeds for {world} ranks: expected one per rank")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        r = min(range(world), key=lambda k: ((loads[k] + lengths[i]) / speed[k], k))
        shares[r].append(i)
        loads[r] += lengths[i]
    return shares


def pack_micro_batches(
    indices: Sequence[int], lengths: Sequence[int], budget: int
) -> list[list[int]]:
    """Pack sequences longest first into micro-batches whose padded size
    (rows x longest row) stays within `budget` tokens."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if lengths[i] > budget:
            raise ValueError(
                f"a sequence of {lengths[i]} tokens exceeds trainer.micro_batch_tokens "
                f"({budget}); raise it to at least the longest prompt + completion"
            )
        # longest first: the first row of a micro-batch is its longest
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@dataclass
class MicroBatch:
    """Padded tensors of one micro-batch; token tensors are shifted by one: position j
    holds the log-prob of token j + 1 given tokens 0..j."""

    seq_index: torch.Tensor  # (B,) int64, indices into the step's sequences
    input_ids: torch.Tensor  # (B, L) int64, right-padded
    attention_mask: torch.Tensor  # (B, L) int64
    loss_mask: torch.Tensor  # (B, L - 1) float, 1 on completion tokens
    behav_logp: torch.Tensor  # (B, L - 1) float
    temperature: torch.Tensor  # (B, 1, 1) float
    targets: torch.Tensor  # (B, L - 1) int64, input_ids shifted left
    versions: torch.Tensor  # (B, L - 1) int64, each token's policy version; -1 elsewhere
    # (B, L - 1) float π_ref log-probs from the records (0 off completions); None when
    # some row's record has none (the trainer computes them)
    ref_logp: torch.Tensor | None = None
    # (B,) int64 each row's group in the step and (B,) int64 its prompt length: rows of
    # a group share their prompt (trainer_service/shared_prompt.py); None: not known
    group: torch.Tensor | None = None
    prompt_len: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device: str) -> MicroBatch:
        return MicroBatch(
            **{k: None if v is None else v.to(device) for k, v in self.__dict__.items()}
        )


def collate(items: Sequence[SeqItem], pad_id: int) -> MicroBatch:
    """Right-pad `items` into one micro-batch (filled row by row in numpy, then handed to
    torch without a copy: one tensor op per field instead of several per row)."""
    import torch

    rows, width = len(items), max(len(it.tokens) for it in items)
    ids = np.full((rows, width), pad_id, dtype=np.int64)
    attn = np.zeros((rows, width), dtype=np.int64)
    mask = np.zeros((rows, width - 1), dtype=np.float32)
    behav = np.zeros((rows, width - 1), dtype=np.float32)
    versions = np.full((rows, width - 1), -1, dtype=np.int64)
    with_ref = all(it.ref_logp is not None for it in items)
    ref = np.zeros((rows, width - 1), dtype=np.float32) if with_ref else None
    for r, it in enumerate(items):
        n, p = len(it.tokens), it.prompt_len
        ids[r, :n] = it.tokens
        attn[r, :n] = 1
        # completion token t (absolute position p + t) is predicted at position p + t - 1
        mask[r, p - 1 : n - 1] = 1.0
        behav[r, p - 1 : n - 1] = it.behav_logp
        if it.versions is not None:
            versions[r, p - 1 : n - 1] = it.versions
        if ref is not None and it.ref_logp is not None:
            ref[r, p - 1 : n - 1] = it.ref_logp
    temps = torch.tensor([it.temperature for it in items], dtype=torch.float32)
    input_ids = torch.from_numpy(ids)
    return MicroBatch(
        seq_index=torch.tensor([it.index for it in items], dtype=torch.long),
        input_ids=input_ids,
        attention_mask=torch.from_numpy(attn),
        loss_mask=torch.from_numpy(mask),
        behav_logp=torch.from_numpy(behav),
        temperature=temps.view(rows, 1, 1),
        targets=input_ids[:, 1:].clone(),
        versions=torch.from_numpy(versions),
        ref_logp=None if ref is None else torch.from_numpy(ref),
        group=torch.tensor([it.group for it in items], dtype=torch.long),
        prompt_len=torch.tensor([it.prompt_len for it in items], dtype=torch.long),
    )


def dummy_batch(pad_id: int) -> MicroBatch:
    """A one-row, zero-weight micro-batch: ranks with fewer micro-batches run it so every
    rank takes part in the same number of forward/backward collectives."""
    import torch

    return MicroBatch(
        seq_index=torch.tensor([-1]),
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
        attention_mask=torch.ones((1, 2), dtype=torch.long),
        loss_mask=torch.zeros((1, 1)),
        behav_logp=torch.zeros((1, 1)),
        temperature=torch.ones((1, 1, 1)),
        targets=torch.full((1, 1), pad_id, dtype=torch.long),
        versions=torch.full((1, 1), -1, dtype=torch.long),
        ref_logp=torch.zeros((1, 1)),
    )


def group_rewards(groups: Sequence[GroupRecord]) -> list[np.ndarray]:
    return [g.rewards.astype(np.float64) for g in groups]


@dataclass
class Shaping:
    """Reward and advantage shaping applied before/after the group baseline."""

    overlong_max: int = 0  # max_new_tokens (used with overlong_buffer)
    overlong_buffer: int | None = None  # DAPO soft overlong penalty (None: off)
    overlong_factor: float = 1.0
    batch_normalize: bool = False  # A <- (A - mean) / std over the batch
    eps: float = 1e-6


def shaped_rewards(
    groups: Sequence[GroupRecord],
    items: Sequence[SeqItem],
    reward_penalty: np.ndarray | None,
    shaping: Shaping,
) -> list[np.ndarray]:
    """Rewards per group after the KL-in-reward and overlong penalties."""
    import torch

    from areal_hex.algorithms import overlong_penalty

    rewards = [r.copy() for r in group_rewards(groups)]
    if reward_penalty is not None:
        for it, pen in zip(items, reward_penalty, strict=True):
            rewards[it.group][it.completion] -= float(pen)
    if shaping.overlong_buffer is not None:
        for gi, g in enumerate(groups):
            lens = torch.tensor([len(c.token_ids) for c in g.completions])
            pen = overlong_penalty(
                lens, shaping.overlong_max, shaping.overlong_buffer, shaping.overlong_factor
            )
            rewards[gi] += pen.double().numpy()
    return rewards


def sequence_advantages(
    groups: Sequence[GroupRecord],
    items: Sequence[SeqItem],
    kind: str,
    std_normalize: bool,
    eps: float,
    reward_penalty: np.ndarray | None = None,
    shaping: Shaping | None = None,
) -> tuple[np.ndarray, int, np.ndarray]:
    """Advantages per trained sequence (N,), the number of degenerate groups, and every
    completion's advantage in batch order (for statistics). `reward_penalty` (N,) is
    subtracted from the trained sequences' rewards first (KL in the reward)."""
    import torch

    from areal_hex.algorithms import batch_normalize, grpo_advantages

    shaping = shaping or Shaping()
    rewards = shaped_rewards(groups, items, reward_penalty, shaping)
    per_group: list[np.ndarray] = []
    informative: list[np.ndarray] = []
    degenerate = 0
    for r in rewards:
        adv, flat = grpo_advantages(torch.tensor(r[None, :]), kind, std_normalize, eps)
        per_group.append(adv[0].numpy())
        informative.append(np.full(len(r), not flat))
        degenerate += flat
    if shaping.batch_normalize and per_group:
        flat_adv = batch_normalize(
            torch.tensor(np.concatenate(per_group)),
            torch.tensor(np.concatenate(informative)),
            shaping.eps,
        ).numpy()
        splits = np.cumsum([len(a) for a in per_group])[:-1]
        per_group = list(np.split(flat_adv, splits))
    seq_adv = np.zeros(len(items), dtype=np.float32)
    for it in items:
        seq_adv[it.index] = per_group[it.group][it.completion]
    all_adv = np.concatenate(per_group) if per_group else np.zeros(0)
    return seq_adv, degenerate, all_adv.astype(np.float32)
