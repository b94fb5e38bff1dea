"""The built-in engine's per-row logit shaping (penalties, logit bias, min_new_tokens),
greedy threshold, prompt log-prob indexing and stop trimming, on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_service.server.requests import GenRequest, trimmed_text
from rollout_service.server.sampling import (
    LogitShaping,
    SamplingTensors,
    prompt_logprobs,
    sample,
)
from rollout_service.wire import FinishReason, SamplingParamsIn

CPU = torch.device("cpu")


def test_shaping_matches_hand_values() -> None:
    sp = SamplingParamsIn(
        frequency_penalty=0.5,
        presence_penalty=0.25,
        repetition_penalty=2.0,
        logit_bias={"4": 3.0},
        min_new_tokens=2,
        stop_token_ids=[5],
    )
    plain = SamplingParamsIn()
    shaping = LogitShaping.build([([1], sp), ([2], plain)], vocab=6, eos=frozenset({0}), device=CPU)
    shaping.observe(torch.tensor([3, 3]))
    shaping.observe(torch.tensor([3, 1]))
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, -1.0, 6.0], [1.0, 2.0, 3.0, 4.0, -1.0, 6.0]])
    got = shaping.apply(logits.clone())
    # row 0: token 3 twice in the output (freq 2 × 0.5 + presence 0.25, then / 2 as it is
    # positive); token 1 in the prompt (/ 2); token 4 + 3; two tokens are out, so
    # min_new_tokens (2) no longer masks EOS 0 and stop token 5
    assert got[0].tolist() == [1.0, 1.0, 3.0, (4.0 - 1.0 - 0.25) / 2, 2.0, 6.0]
    assert torch.equal(got[1], logits[1])  # the neutral row is untouched
    fresh = LogitShaping.build([([1], sp)], vocab=6, eos=frozenset({0}), device=CPU)
    masked = fresh.apply(torch.zeros(1, 6))
    assert masked[0, 0] == -math.inf and masked[0, 5] == -math.inf  # before min_new_tokens
    assert masked[0, 2] == 0.0

    neg = SamplingParamsIn(repetition_penalty=0.5)
    one = LogitShaping.build([([2], neg)], vocab=6, eos=frozenset(), device=CPU)
    out = one.apply(torch.tensor([[0.0, 0.0, -2.0, 0.0, 0.0, 0.0]]))
    assert out[0, 2] == -1.0  # negative logits are multiplied by the penalty


def test_shaping_state_follows_rows() -> None:
    sp = SamplingParamsIn(presence_penalty=1.0)
    a = SamplingTensors.build([sp, SamplingParamsIn()], CPU)
    a.shaping = LogitShaping.build([([1], sp), ([1], SamplingParamsIn())], 4, frozenset(), CPU)
    b = SamplingTensors.build([SamplingParamsIn()], CPU)  # a batch that never needed it
    merged = SamplingTensors.cat(a, b)
    assert merged.shaping is not None and merged.shaping.counts.shape == (3, 4)
    assert merged.select(torch.tensor([0, 2])).shaping is not None
    assert merged.select(torch.tensor([1, 2])).shaping is None  # only neutral rows left


def test_take_keeps_the_flags_and_draws_as_select() -> None:
    """Rows that need top-k, top-p, min-p and greedy leave: `take` keeps the flags set,
    `select` clears them; both draw the same tokens with the same log-probs."""
    rows = [
        SamplingParamsIn(temperature=0.0),
        SamplingParamsIn(temperature=1.2, top_k=3, top_p=0.5, min_p=0.1),
        SamplingParamsIn(temperature=1.2),
        SamplingParamsIn(temperature=0.7),
    ]
    params = SamplingTensors.build(rows, CPU)
    idx = torch.tensor([3, 2])
    kept, fresh = params.take(idx), params.select(idx)
    assert kept.need_k and kept.need_p and kept.need_min and kept.any_greedy
    assert not (fresh.need_k or fresh.need_p or fresh.need_min or fresh.any_greedy)
    assert torch.equal(kept.divisor, fresh.divisor) and torch.equal(kept.top_k, fresh.top_k)
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    draws = [sample(logits, p, torch.Generator().manual_seed(4)) for p in (kept, fresh)]
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])


def test_greedy_below_1e_6() -> None:
    rows = [SamplingParamsIn(temperature=t) for t in (0.0, 5e-7, 1e-6, 0.7)]
    assert SamplingTensors.build(rows, CPU).temperature.tolist() == pytest.approx(
        [0.0, 0.0, 1e-6, 0.7]
    )


def test_prompt_logprobs_index_the_kept_positions() -> None:
    torch.manual_seed(0)
    prompt = [3, 1, 4, 1, 5]
    full = torch.randn(5, 8)  # logits at every prompt position
    ref = torch.log_softmax(full[:-1], dim=-1)
    for start in (0, 1, 3):
        kept = full[max(start, 1) - 1 :]  # what prefill_keep returns for this prompt
        lps, tops = prompt_logprobs(kept, prompt, start, 1.0, 2)
        want = [ref[j - 1, prompt[j]].item() for j in range(max(start, 1), 5)]
        assert lps[:1] == ([None] if start == 0 else lps[:1])
        assert [x for x in lps if x is not None] == pytest.approx(want, abs=1e-6)
        assert len(tops) == len(lps) and all(t is None or len(t) == 2 for t in tops)
    hot, _ = prompt_logprobs(full, prompt, 1, 2.0, 0)
    assert hot[0] == pytest.approx(torch.log_softmax(full[0] / 2, -1)[1].item(), abs=1e-6)


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_trimmed_text() -> None:
    def req(sp: SamplingParamsIn, finish: FinishReason | None) -> GenRequest:
        r = GenRequest(rid="r", prompt=[0], sampling=sp, output_ids=[0, 1, 2, 3])
        r.finish = finish
        return r

    tok = CharTokenizer()
    by_token = FinishReason(type="stop", matched=3)
    assert trimmed_text(tok, req(SamplingParamsIn(), by_token), 4) == "abc"
    assert trimmed_text(tok, req(SamplingParamsIn(no_stop_trim=True), by_token), 4) == "abcd"
    by_text = FinishReason(type="stop", matched="bc")
    assert trimmed_text(tok, req(SamplingParamsIn(), by_text), 4) == "a"
    length = FinishReason(type="length", length=4)
    assert trimmed_text(tok, req(SamplingParamsIn(), length), 4) == "abcd"
    assert trimmed_text(tok, req(SamplingParamsIn(), None), 2) == "ab"  # still running
    assert trimmed_text(None, req(SamplingParamsIn(), by_token), 4) == ""
