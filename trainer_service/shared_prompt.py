"""Token log-probs of a micro-batch whose rows share prompts: each prompt runs once.

A GRPO group's completions all continue the same prompt, and in a short-answer task the
prompt is most of each row: a padded pass computes every prompt once per completion.
Here the distinct prompts of the micro-batch run first, (G, P), keeping their keys and
values; each row then takes its prompt's keys and values (an index along the batch, so
the backward sums the rows' gradients into the one prompt pass) and only its completion
runs, (B, T), at positions p_r.. after its prompt. Every completion token sees exactly
the tokens it sees in the padded pass, so the log-probs are the same and the gradients
differ only by the order of their sums (float rounding).

    prompt pass   (G, P)  prompts right-padded to the longest; causal attention keeps
                          padding out of every real token
    completions   (B, T)  keys: the row's prompt (padding masked) + its own completion
    token j of row r      predicted at the prompt's last position (j = 0) or at the
                          completion's position j - 1; returned at p_r - 1 + j of the
                          (B, L - 1) layout of `token_logprobs`

A model that runs the packed attention (packed.py, the CPU trainer's) does the same in
one pass over a sequence of real tokens only, without the padding of either pass.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

from trainer_service import packed

if TYPE_CHECKING:
    import torch

    from trainer_service.batching import MicroBatch


@cache
def _cache_argument(cls: type) -> str | None:
    """The name under which `cls.forward` takes a KV cache (transformers renamed it)."""
    forward = getattr(cls, "forward", None)
    if forward is None:
        return None
    params = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def _module(model: Any) -> Any:
    return getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model


def _checkpointed(module: Any) -> bool:
    """Whether activation (gradient) checkpointing is on; transformers renamed it."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(module), name):
            return bool(getattr(module, name))
    return False


def shares_prompts(model: Callable[..., Any], mb: MicroBatch) -> bool:
    """Whether `mb`'s rows share prompts enough that the shared pass computes fewer
    positions than the padded one, and `model` can run it: an HF causal LM taking a KV
    cache, without gradient checkpointing (which turns the cache off) and with its
    weights whole (ZeRO-3 gathers them per forward)."""
    if mb.group is None or mb.prompt_len is None or int(mb.prompt_len.min()) < 1:
        return False
    module = _module(model)
    if _cache_argument(type(module)) is None or _checkpointed(module):
        return False
    partitioned = getattr(model, "zero_optimization_partition_weights", None)
    if partitioned is not None and partitioned():
        return False
    rows, width = mb.input_ids.shape
    groups = int(mb.group.unique().numel())
    n_comp = mb.attention_mask.sum(dim=1) - mb.prompt_len
    # the completion pass: packed, its real tokens; else padded to the longest
    completion = int(n_comp.sum()) if packed.enabled(model) else rows * int(n_comp.max())
    return groups * int(mb.prompt_len.max()) + completion < rows * width


def shared_prompt_logprobs(
    model: Callable[..., Any],
    mb: MicroBatch,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of `mb` (the same (B, L - 1) layout, 0 off completion tokens)
    with each distinct prompt computed once; `shares_prompts(model, mb)` must hold."""
    import torch

    from areal_hex.algorithms import entropy_from_logp

    if packed.enabled(model):  # prompts and completions in one packed pass
        return packed.packed_logprobs(model, mb, with_entropy, entropy_grad)
    assert mb.group is not None and mb.prompt_len is not None
    ids, plen = mb.input_ids, mb.prompt_len
    rows, width = ids.shape
    dev = ids.device
    _, row_prompt = torch.unique(mb.group, return_inverse=True)  # (B,) into the G prompts
    n_prompts = int(row_prompt.max()) + 1
    first = torch.full((n_prompts,), rows, dtype=torch.long, device=dev)
    first = first.scatter_reduce(0, row_prompt, torch.arange(rows, device=dev), "amin")
    gp = plen[first]  # (G,) prompt lengths
    longest = int(gp.max())
    span = torch.arange(longest, device=dev)
    prompts = torch.where(span < gp[:, None], ids[first, :longest], ids.new_zeros(()))
    keep = longest - int(gp.min()) + 1  # logits from the shortest prompt's last position
    out = model(input_ids=prompts, use_cache=True, logits_to_keep=keep)
    kv = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    # (B, V) each row's logits at its prompt's last position: its first token's
    at_prompt = out.logits[row_prompt, plen - 1 - (longest - keep)]
    kv.batch_select_indices(row_prompt)
    n_comp = mb.attention_mask.sum(dim=1) - plen  # (B,)
    t = int(n_comp.max())
    pos = plen[:, None] + torch.arange(t, device=dev)  # (B, T) absolute positions
    comp = ids.gather(1, pos.clamp(max=width - 1))
    comp = torch.where(torch.arange(t, device=dev) < n_comp[:, None], comp, ids.new_zeros(()))
    seen = torch.cat([(span < plen[:, None]).long(), torch.ones_like(comp)], dim=1)
    name = _cache_argument(type(_module(model)))
    after = model(
        input_ids=comp, attention_mask=seen, position_ids=pos, use_cache=True, **{name: kv}
    )
    # (B, T, V): token 0 from the prompt's last position, token j from completion j - 1
    logits = torch.cat([at_prompt[:, None], after.logits[:, :-1]], dim=1).float()
    logp_all = torch.log_softmax(logits / mb.temperature, dim=-1)
    logp = logp_all.gather(-1, comp.unsqueeze(-1)).squeeze(-1)  # (B, T)
    j = torch.arange(width - 1, device=dev) + 1 - plen[:, None]  # (B, L - 1) token index
    inside = (j >= 0) & (j < t)
    j = j.clamp(0, t - 1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = entropy_from_logp(logp_all).gather(1, j)
            entropy = torch.where(inside, ent, ent.new_zeros(()))
    return torch.where(inside, logp.gather(1, j), logp.new_zeros(())), entropy
