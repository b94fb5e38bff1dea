"""The trainer scores only the positions from the batch's first completion token on, and
attends causally without a padding mask; rows that share prompts run each prompt once,
and their completions padded (`shared`) or packed into one sequence (`packed`): on a
batch of mixed prompt and completion lengths, the log-probs and entropy on completion
tokens, the step's loss, statistics and gradients of every path equal those of the full
pass with the padding mask (to 1e-6)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from fakes import PlainEngine

from areal_hex.config import AlgoConfig, ModelConfig, TinyModelConfig
from trainer_service import packed, rms_norm
from trainer_service import step as step_mod
from trainer_service.batching import collate, flatten_groups
from trainer_service.engine import first_scored, token_logprobs
from trainer_service.shared_prompt import shares_prompts


def full_pass(
    model: Any, mb: Any, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every position scored, padding masked: the pass the window replaces."""
    from areal_hex.algorithms import entropy_from_logp

    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
    logp_all = torch.log_softmax(out.logits[:, :-1].float() / mb.temperature, dim=-1)
    logp = logp_all.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logp(logp_all)
    return logp, entropy


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list]:
    from areal_hex.models import load_model, materialize
    from trainer_service.synthetic import synthetic_groups

    d = materialize(ModelConfig(tiny=TinyModelConfig(num_layers=2)), tmp_path_factory.mktemp("m"))
    model = load_model(d).train()
    vocab = model.config.vocab_size
    # prompts of 9 and 5 tokens, completions of 3 to 12: rows padded by different amounts
    groups = synthetic_groups(2, 4, vocab, 9, (3, 12), seed=1, temperature=0.8)
    groups += synthetic_groups(2, 4, vocab, 5, (3, 12), seed=2, temperature=0.8)
    return model, groups


# packed, also with the rows of a group not next to each other (`mixed`)
PATHS = ["packed", "packed-mixed", "shared", "window"]


def _model_for(model: Any, path: str) -> Any:
    """`model` as the trainer runs it (engine.build_engine) on `packed` paths: its
    attention packs completions, its norms have their backward written out."""
    if not path.startswith("packed"):
        return model
    out = copy.deepcopy(model)
    assert packed.enable(out) and packed.enabled(out)
    assert rms_norm.fuse(out) > 0
    return out


def test_window_starts_at_the_first_completion_token(setup: tuple) -> None:
    _, groups = setup
    mb = collate(flatten_groups(groups), 0)
    assert first_scored(mb) == 4  # the 5-token prompts' last position predicts token 5
    assert mb.attention_mask.min() == 0  # some rows are padded


def _batch(groups: list, shared: bool, mixed: bool = False) -> Any:
    items = flatten_groups(groups)
    if mixed:  # a group's rows apart from each other
        items = items[::2] + items[1::2]
    mb = collate(items, 0)
    if not shared:  # rows whose groups are not known: the windowed padded pass
        mb.group = None
    return mb


def test_shared_pass_only_where_it_computes_fewer_positions(setup: tuple) -> None:
    model, groups = setup
    assert shares_prompts(model, _batch(groups, shared=True))
    assert not shares_prompts(model, _batch(groups, shared=False))
    one_each = [replace(g, completions=g.completions[:1]) for g in groups]
    assert not shares_prompts(model, _batch(one_each, shared=True))  # nothing shared
    checkpointed = copy.deepcopy(model)
    enable = getattr(checkpointed, "activation_checkpointing_enable", None)
    (enable or checkpointed.gradient_checkpointing_enable)()
    assert not shares_prompts(checkpointed, _batch(groups, shared=True))


def test_packed_attention_only_for_sdpa_models(setup: tuple) -> None:
    model, groups = setup
    packed_model = _model_for(model, "packed")
    assert not packed.enabled(model)  # the copy only
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    assert not packed.enable(eager) and not packed.enabled(eager)
    # outside a packed pass it is SDPA: a plain padded forward gives the same logits
    mb = _batch(groups, shared=True)
    with torch.no_grad():
        a = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        b = packed_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)


def test_packed_pass_checks_that_every_layer_took_the_rows(setup: tuple) -> None:
    model, groups = setup
    mb = _batch(groups, shared=True)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def ignores_rows(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
        """An attention that knows nothing of packed rows: causal over the sequence."""
        kw = {n: x for n, x in kw.items() if n != "packed_rows"}
        return sdpa_attention_forward(module, q, k, v, None, **kw)

    AttentionInterface.register("ignores_rows", ignores_rows)
    broken = _model_for(model, "packed")
    broken.model.layers[1].self_attn.config = copy.deepcopy(broken.config)
    broken.model.layers[1].self_attn.config._attn_implementation = "ignores_rows"
    with pytest.raises(RuntimeError, match="1 of 2 attention layers"):
        token_logprobs(broken, mb)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_same_logprobs_entropy_and_gradients(setup: tuple, entropy_grad: bool, path: str) -> None:
    base, groups = setup
    shared = path != "window"
    model = _model_for(base, path)
    mb = _batch(groups, shared, mixed=path == "packed-mixed")
    assert shares_prompts(model, mb) is shared
    mask = mb.loss_mask
    w = torch.linspace(0.5, 2.0, mask.shape[1])  # a loss weighting every position apart
    got: list[tuple] = []
    for fn in (full_pass, token_logprobs):
        model.zero_grad(set_to_none=True)
        logp, ent = fn(model, mb, with_entropy=True, entropy_grad=entropy_grad)
        assert ent is not None and logp.shape == mask.shape == ent.shape
        # a token mean, as the step's loss is
        loss = ((logp * w + ent * float(entropy_grad)) * mask).sum() / mask.sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        got.append((logp.detach() * mask, ent.detach() * mask, grads))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = got
    assert lp_a.abs().sum() > 0
    torch.testing.assert_close(lp_b, lp_a, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-6, rtol=1e-6)
    for n, g in g_a.items():
        torch.testing.assert_close(g_b[n], g, atol=1e-6, rtol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("path", ["packed", "shared", "window"])
def test_same_step_as_the_full_pass(
    setup: tuple, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, groups = setup
    model = _model_for(base, path)
    if path == "window":
        monkeypatch.setattr("trainer_service.shared_prompt.shares_prompts", lambda m, mb: False)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    algo = AlgoConfig(behav_cap=2.0, kl_coef=0.1)
    runs = []
    for fn in (full_pass, token_logprobs):
        monkeypatch.setattr(step_mod, "token_logprobs", fn)
        monkeypatch.setattr("trainer_service.engine.token_logprobs", fn)  # the reference's
        model.zero_grad(set_to_none=True)
        ctx = step_mod.StepContext(PlainEngine(model), algo, 64, 16, 0, 0, 1, ref_model=ref)
        out = step_mod.optimize(ctx, groups)
        runs.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, g_a), (b, g_b) = runs
    assert a.sums["loss"] != 0.0 and a.sums["kl"] != 0.0
    for k in a.sums:
        assert b.sums[k] == pytest.approx(a.sums[k], rel=1e-6, abs=1e-6), k
    assert b.maxima["behav_w_max"] == pytest.approx(a.maxima["behav_w_max"], abs=1e-6)
    np.testing.assert_allclose(b.advantages, a.advantages, atol=1e-6)
    for n, g in g_a.items():
        torch.testing.assert_close(g_b[n], g, atol=1e-6, rtol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_flushed_denormals_change_no_gradient(setup: tuple) -> None:
    """The CPU trainer counts denormal floats as zero (engine.flush_denormals): the same
    log-probs and gradients to 1e-6."""
    base, groups = setup
    model = _model_for(base, "packed")
    mb = _batch(groups, shared=True)
    got = []
    try:
        for flush in (False, True):
            torch.set_flush_denormal(flush)
            model.zero_grad(set_to_none=True)
            logp, _ = token_logprobs(model, mb)
            (logp * mb.loss_mask).sum().backward()
            got.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    finally:
        torch.set_flush_denormal(False)
    (lp_a, g_a), (lp_b, g_b) = got
    torch.testing.assert_close(lp_b, lp_a, atol=1e-6, rtol=1e-6)
    for n, g in g_a.items():
        torch.testing.assert_close(g_b[n], g, atol=1e-6, rtol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
