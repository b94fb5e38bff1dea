"""Synthetic group records for tests, benchmarks and dry runs (no server needed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from areal_hex.record import Completion, GroupRecord


def synthetic_groups(
    n_groups: int,
    group_size: int,
    vocab_size: int,
    prompt_len: int = 8,
    completion_len: tuple[int, int] = (4, 12),
    seed: int = 0,
    temperature: float = 1.0,
    version: int = 0,
    model: Any | None = None,
    with_ref: bool = False,
) -> list[GroupRecord]:
    """Random prompts and completions with 0/1 rewards. Behaviour log-probs come from
    `model` (an HF causal LM, at `temperature`) when given, else random values in
    [-3, -0.5]. `with_ref`: each completion carries π_ref log-probs too (random, as a
    reference task's records carry them)."""
    rng = np.random.default_rng(seed)
    groups = []
    for gi in range(n_groups):
        prompt = rng.integers(5, vocab_size, size=prompt_len)
        comps = []
        for _ in range(group_size):
            n = int(rng.integers(completion_len[0], completion_len[1] + 1))
            toks = rng.integers(5, vocab_size, size=n)
            lp = rng.uniform(-3.0, -0.5, size=n)
            if model is not None:
                lp = _model_logprobs(model, prompt, toks, temperature)
            comps.append(
                Completion(
                    token_ids=toks,
                    logprobs=lp,
                    versions=np.full(n, version),
                    finish_reason="length",
                    reward=float(rng.integers(0, 2)),
                    ref_logprobs=rng.uniform(-3.0, -0.5, size=n) if with_ref else None,
                )
            )
        groups.append(
            GroupRecord(
                prompt_id=f"p{gi}", prompt_ids=prompt, completions=comps, temperature=temperature
            )
        )
    return groups


def _model_logprobs(
    model: Any, prompt: np.ndarray, toks: np.ndarray, temperature: float
) -> np.ndarray:
    import torch

    ids = torch.tensor(np.concatenate([prompt, toks]))[None, :]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    tgt = ids[0, 1:]
    out = logp.gather(-1, tgt[:, None])[:, 0]
    return out[len(prompt) - 1 :].numpy()
