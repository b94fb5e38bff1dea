"""Record verl's and AReaL's GAE and value-loss outputs on fixed random inputs into
tests/data/ppo_reference.json, which tests/unit/test_gae.py holds areal_hex.gae against.

Run where `verl` and `areal` import (their wheels and dependencies installed; neither is
a dependency of areal-hex, and the tests never import them):

    python scripts/record_ppo_reference.py [OUT]

Layout of the inputs: N rows of T token positions, each row a prompt (unmasked), a
completion (masked) and padding (unmasked), the completion's score on its last token.
Every row leaves at least one padded position, so AReaL's bootstrap of rows that fill
the whole width (their last value) never applies: on such rows both define the same
formula.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import torch

N, T = 6, 13
GAMMA, LAM, CLIP = 0.97, 0.9, 0.2
FIXED_LEN = 16


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, 4, (N,), generator=g)
    lens = torch.randint(1, 8, (N,), generator=g)
    mask = torch.zeros(N, T)
    for i in range(N):
        mask[i, starts[i] : starts[i] + lens[i]] = 1.0
    values = torch.randn(N, T, generator=g)
    scores = torch.randn(N, generator=g)
    rewards = torch.zeros(N, T)
    for i in range(N):
        rewards[i, int(starts[i] + lens[i]) - 1] = scores[i]
    new_values = values + 0.4 * torch.randn(N, T, generator=g)
    return {
        "mask": mask,
        "values": values,
        "scores": scores,
        "rewards": rewards,
        "new_values": new_values,
    }


def verl_outputs(x: dict[str, torch.Tensor]) -> dict[str, object]:
    from verl.trainer.ppo import core_algos as ca

    adv, ret = ca.compute_gae_advantage_return(
        x["rewards"], x["values"], x["mask"], torch.tensor(GAMMA), torch.tensor(LAM)
    )
    out: dict[str, object] = {"whitened_advantages": adv.tolist(), "returns": ret.tolist()}
    modes = {
        "token_mean": ("token-mean", None),
        "seq_mean_token_mean": ("seq-mean-token-mean", None),
        "seq_mean_token_sum": ("seq-mean-token-sum", None),
        "fixed_len": ("seq-mean-token-sum-norm", FIXED_LEN),
    }
    losses = {}
    for ours, (theirs, scale) in modes.items():
        loss, clipfrac = ca.compute_value_loss(
            x["new_values"], ret, x["values"], x["mask"], CLIP, theirs, loss_scale_factor=scale
        )
        losses[ours] = float(loss)
        out["value_clip_frac"] = float(clipfrac)
    out["value_loss"] = losses
    return out


def areal_outputs(x: dict[str, torch.Tensor]) -> dict[str, object]:
    """AReaL's GAE runs in its actor on whole sequences (token t at column t, the mask
    rolled left by one inside): a column of our layout is a column of theirs, plus one
    column at the end that is never masked."""
    from areal.trainer.ppo.actor import PPOActor
    from areal.utils.functional.functional import ppo_critic_loss_fn

    mask = torch.cat([x["mask"], torch.zeros(N, 1)], dim=1)  # (N, T + 1), ours
    seqlen = (mask * torch.arange(T + 1)).max(dim=1).values.long() + 2  # last token + 2
    attn = (torch.arange(T + 1)[None, :] < seqlen[:, None]).long()
    actor = SimpleNamespace(
        config=SimpleNamespace(
            overlong_reward_penalty=False, use_decoupled_loss=True, recompute_logprob=True
        ),
        reward_bias=0.0,
        reward_scaling=1.0,
        reward_clip=1e9,
        reward_norm=None,
        kl_ctl=0.0,
        kl_estimator=lambda a, b: torch.zeros_like(a),
        mask_no_eos_with_zero=False,
        discount=GAMMA,
        gae_lambda=LAM,
        adv_norm=None,
    )
    data = {
        "input_ids": torch.zeros(N, T + 1, dtype=torch.long),
        "attention_mask": attn,
        "loss_mask": torch.roll(mask, shifts=1, dims=-1),  # theirs: on the tokens
        "logprobs": torch.zeros(N, T + 1),
        "prox_logp": torch.zeros(N, T + 1),
        "rewards": x["scores"].clone(),
        "values": torch.cat([x["values"], torch.zeros(N, 1)], dim=1),
    }
    got = PPOActor._compute_advantages(actor, data)
    assert torch.equal(got["loss_mask"][:, :T], x["mask"]), "layout mismatch"
    ret = got["returns"][:, :T]
    loss, stat = ppo_critic_loss_fn(
        x["new_values"].float(), x["values"].float(), ret.float(), CLIP, x["mask"].bool()
    )
    return {
        "advantages": got["advantages"][:, :T].tolist(),
        "returns": ret.tolist(),
        "value_loss_token_mean": float(loss),
        "value_clipped": stat["clip_mask"].tolist(),
    }


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else Path("tests/data/ppo_reference.json")
    x = inputs()
    record = {
        "about": "outputs of verl and AReaL on the inputs below (scripts/record_ppo_reference.py)",
        "versions": {"verl": metadata.version("verl"), "areal": metadata.version("areal")},
        "params": {"gamma": GAMMA, "lam": LAM, "value_clip": CLIP, "fixed_len": FIXED_LEN},
        "inputs": {k: v.tolist() for k, v in x.items()},
        "verl": verl_outputs(x),
        "areal": areal_outputs(x),
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
