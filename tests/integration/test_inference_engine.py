"""The built-in engine's pieces on a real tiny Qwen3: sampling rules and the left-padded
running batch (prefill, merge, decode, select) against full forward passes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from areal_hex.config import InferenceConfig, ModelConfig, TinyModelConfig
from areal_hex.models import build_tiny_model, build_tokenizer
from rollout_service.server import batching, sampling
from rollout_service.server.sampling import SamplingTensors


@pytest.fixture(scope="module")
def model() -> Any:
    return build_tiny_model(TinyModelConfig(), build_tokenizer(), seed=0).eval()


def params(n: int, **kw: Any) -> SamplingTensors:
    row = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0)
    rows = [SimpleNamespace(**{**vars(row), **kw}) for _ in range(n)]
    return SamplingTensors.build(rows, torch.device("cpu"))


def last_logits(model: Any, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0, -1]


def test_sampling_rules() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    best = logits.argmax(-1)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"temperature": 0.0}):
        tokens, _ = sampling.sample(logits, params(4, **kw), gen)
        assert tokens.tolist() == best.tolist(), kw
    # top-k: 200 draws stay inside each row's 5 most likely tokens
    many = logits.repeat(50, 1)
    tokens, lp = sampling.sample(many, params(200, top_k=5, temperature=2.0), gen)
    top5 = many.topk(5, dim=-1).indices
    assert bool((top5 == tokens[:, None]).any(-1).all())
    # log-probs are those of log_softmax(logits / T), not of the restricted distribution
    want = torch.log_softmax(many / 2.0, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(lp, want)
    # greedy rows report log_softmax of the raw logits
    mixed = SamplingTensors.cat(params(2, temperature=0.0), params(2, temperature=0.5))
    tokens, lp = sampling.sample(logits, mixed, gen)
    assert tokens[:2].tolist() == best[:2].tolist()
    torch.testing.assert_close(lp[:2], torch.log_softmax(logits[:2], -1).max(-1).values)
    want = torch.log_softmax(logits[2:] / 0.5, -1).gather(1, tokens[2:, None]).squeeze(1)
    torch.testing.assert_close(lp[2:], want)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_tempered_distribution(temperature: float) -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(20000, 1)
    gen = torch.Generator().manual_seed(2)
    tokens, _ = sampling.sample(logits, params(20000, temperature=temperature), gen)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    want = torch.softmax(logits[0] / temperature, -1)
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)


def test_top_p_keeps_the_nucleus() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two only
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    gen = torch.Generator().manual_seed(1)
    tokens, _ = sampling.sample(probs.log().repeat(400, 1), params(400, top_p=0.7), gen)
    assert set(tokens.tolist()) == {0, 1}


def test_prefill_merge_decode_select_match_full_forward(model: Any) -> None:
    seqs = [[7, 8, 9, 10, 11, 12], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    a, la = batching.prefill(model, seqs[:2], params(2), pad_id=0)
    b, lb = batching.prefill(model, seqs[2:], params(1), pad_id=0)
    for row, seq in enumerate(seqs[:2]):
        torch.testing.assert_close(la[row], last_logits(model, seq), atol=1e-4, rtol=0)
    torch.testing.assert_close(lb[0], last_logits(model, seqs[2]), atol=1e-4, rtol=0)
    a.last = torch.tensor([40, 41])
    b.last = torch.tensor([42])
    merged = batching.merge(a, b)  # b is longer: a's rows get more left padding
    assert merged.size == 3 and merged.length == 9
    seqs = [s + [t] for s, t in zip(seqs, [40, 41, 42], strict=True)]
    for _ in range(3):
        logits = batching.decode_step(model, merged)
        nxt = logits.argmax(-1)
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(logits[row], last_logits(model, seq), atol=1e-4, rtol=0)
        merged.last = nxt
        seqs = [s + [int(t)] for s, t in zip(seqs, nxt, strict=True)]
    # the longest row leaves: leading padding columns are cut
    kept = batching.select(merged, [1, 0])
    assert kept.size == 2 and kept.length == len(seqs[0]) - 1
    assert bool(kept.mask[:, 0].any())
    logits = batching.decode_step(model, kept)
    for row, seq in zip((0, 1), (seqs[1], seqs[0]), strict=True):
        torch.testing.assert_close(logits[row], last_logits(model, seq), atol=1e-4, rtol=0)


def assert_cols_follow_pos(batch: batching.KVBatch) -> None:
    """Row b's real columns are [length - pos[b], length); none of them lie before start."""
    for b, n in enumerate(batch.pos.tolist()):
        want = [batch.length - n <= c for c in range(batch.start, batch.length)]
        assert batch.mask[b].tolist() == want and batch.length - n >= batch.start


def test_remove_in_place_matches_full_forward(model: Any) -> None:
    """Rows leave in place: the last row takes the first one's slot, attention skips the
    columns no remaining row uses, and a merge then cuts them."""
    seqs = [[30, 31, 32, 33, 34, 35, 36, 37, 38], [20, 21], [7, 8, 9, 10]]
    batch, _ = batching.prefill(model, seqs, params(3), pad_id=0)
    batch.last = torch.tensor([40, 41, 42])
    seqs = [s + [t] for s, t in zip(seqs, [40, 41, 42], strict=True)]
    keys = batch.keys[0]
    order = batching.remove(batch, [1, 2])  # the longest row (0) leaves
    assert order == [2, 1] and batch.size == 2 and batch.keys[0].data_ptr() == keys.data_ptr()
    assert batch.start == 9 - 4 and batch.length == 9
    assert_cols_follow_pos(batch)
    seqs = [seqs[i] for i in order]
    logits = batching.decode_step(model, batch)
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(logits[row], last_logits(model, seq), atol=1e-4, rtol=0)
    batch.last = logits.argmax(-1)
    seqs = [s + [int(t)] for s, t in zip(seqs, batch.last, strict=True)]
    other, _ = batching.prefill(model, [[50, 51, 52]], params(1), pad_id=0)
    other.last = torch.tensor([53])
    merged = batching.merge(batch, other)
    assert merged.start == 0 and merged.length == 5  # the skipped columns are gone
    assert_cols_follow_pos(merged)
    logits = batching.decode_step(model, merged)
    for row, seq in enumerate([*seqs, [50, 51, 52, 53]]):
        torch.testing.assert_close(logits[row], last_logits(model, seq), atol=1e-4, rtol=0)


def test_admit_in_place_matches_full_forward(model: Any) -> None:
    """New rows go into the spare rows of the running batch's buffers (no copy of the
    cache), even when they reach further left than its rows do; whatever the spare rows
    and the columns before `start` held (NaN and True here) is never attended to."""
    seqs = [[30, 31, 32, 33, 34, 35, 36, 37, 38], [20, 21], [7, 8, 9, 10]]
    a, _ = batching.prefill(model, seqs[:2], params(2), pad_id=0)
    b, _ = batching.prefill(model, seqs[2:], params(1), pad_id=0)
    a.last, b.last = torch.tensor([40, 41]), torch.tensor([42])
    batch = batching.merge(a, b, rows=6)
    assert batch.store is not None and batch.store.rows == 6 and batch.size == 3
    seqs = [s + [t] for s, t in zip(seqs, [40, 41, 42], strict=True)]
    for _ in range(2):
        batch.last = batching.decode_step(model, batch).argmax(-1)
        seqs = [s + [int(t)] for s, t in zip(seqs, batch.last, strict=True)]
    order = batching.remove(batch, [1, 2])  # the longest row leaves: start moves right
    seqs = [seqs[i] for i in order]
    assert batch.start == 5 and batch.length == 11
    store = batch.store
    assert store is not None
    for t in (*store.keys, *store.values):  # garbage where nothing real is
        t[batch.size :] = float("nan")
        t[:, :, : batch.start] = float("nan")
    store.cols[batch.size :] = True
    store.cols[:, : batch.start] = True
    new_seq = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    c, _ = batching.prefill(model, [new_seq], params(1), pad_id=0)
    c.last = torch.tensor([60])
    ptr = store.keys[0].data_ptr()
    batch = batching.admit(batch, c, rows=6)
    assert batch.store is store and batch.keys[0].data_ptr() == ptr  # in place
    assert batch.start == 1 and batch.size == 3  # reaches left of the old start
    assert_cols_follow_pos(batch)
    logits = batching.decode_step(model, batch)
    seqs = [*seqs, new_seq + [60]]
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(logits[row], last_logits(model, seq), atol=1e-4, rtol=0)
    batch.last = logits.argmax(-1)
    seqs = [s + [int(t)] for s, t in zip(seqs, batch.last, strict=True)]
    # a short row lands in a spare (NaN) row, padded from `start` up to its columns
    d, _ = batching.prefill(model, [[70, 71]], params(1), pad_id=0)
    d.last = torch.tensor([72])
    batch = batching.admit(batch, d, rows=6)
    assert batch.store is store and batch.start == 1 and batch.size == 4
    assert_cols_follow_pos(batch)
    logits = batching.decode_step(model, batch)
    for row, seq in enumerate([*seqs, [70, 71, 72]]):
        torch.testing.assert_close(logits[row], last_logits(model, seq), atol=1e-4, rtol=0)
    # no spare rows left for four more: a merge into new buffers instead
    full = batching.admit(batch, batching.select(batch, [0, 1, 2]), rows=6)
    assert full.store is not None and full.store is not store and full.size == 7


def test_a_shared_group_joins_by_copy_and_never_steps_shared(model: Any) -> None:
    """A group's rows as views of one prefilled row: owned (new buffers) or admitted into
    a running batch, each row then decodes on its own; stepped as views, it is refused."""
    group = [[7, 8, 9, 10]] * 3
    shared, logits = batching.prefill_keep(model, group, params(3), 0, 1, shared=True)
    assert shared.keys[0].stride(0) == 0 and logits.shape[0] == 3
    shared.last = torch.tensor([40, 41, 42])
    with pytest.raises(RuntimeError):  # its first write, before anything moved
        batching.decode_step(model, shared)
    assert shared.length == 4
    owned = batching.own(shared, rows=5)
    assert owned.store is not None and owned.store.rows == 5 and owned.keys[0].stride(0) != 0
    other, _ = batching.prefill_keep(model, [[20, 21]] * 2, params(2), 0, 1, shared=True)
    other.last = torch.tensor([43, 44])
    batch = batching.admit(owned, other, rows=5)
    assert batch.store is owned.store and batch.size == 5
    out = batching.decode_step(model, batch)
    seqs = [g + [t] for g, t in zip(group, [40, 41, 42], strict=True)]
    seqs += [[20, 21, 43], [20, 21, 44]]
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(out[row], last_logits(model, seq), atol=1e-4, rtol=0)


def test_identical_prompts_are_prefilled_once_and_decode_apart(model: Any) -> None:
    group = [[7, 8, 9, 10], [20, 21], [7, 8, 9, 10], [7, 8, 9, 10]]
    temps = SamplingTensors.cat(params(2, temperature=0.5), params(2, temperature=1.5))
    batch, logits = batching.prefill(model, group, temps, pad_id=0)
    assert batch.size == 4 and batch.params.temperature.tolist() == [0.5, 0.5, 1.5, 1.5]
    for row, seq in enumerate(group):
        torch.testing.assert_close(logits[row], last_logits(model, seq), atol=1e-4, rtol=0)
    # the copies are rows of their own: different next tokens decode correctly
    batch.last = torch.tensor([40, 41, 42, 43])
    out = batching.decode_step(model, batch)
    for row, (seq, t) in enumerate(zip(group, [40, 41, 42, 43], strict=True)):
        torch.testing.assert_close(out[row], last_logits(model, seq + [t]), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.timeout(180)
async def test_engine_on_cuda() -> None:
    """The server on CUDA: behaviour log-probs (fp32) match a full forward on the GPU."""
    from areal_hex.api import SamplingParams
    from rollout_service.client import InferenceClient
    from rollout_service.server.main import ServerThread, build_server_app

    model_cfg = ModelConfig(tiny=TinyModelConfig(), seed=0)
    app = build_server_app(model_cfg, InferenceConfig(device="cuda"))
    ref = build_tiny_model(TinyModelConfig(), build_tokenizer(), seed=0).cuda().eval()
    with ServerThread(app) as url:
        async with InferenceClient(url) as c:
            prompts = [[10 + i] * (2 + 3 * i) for i in range(8)]
            sp = SamplingParams(max_new_tokens=24, temperature=0.8, ignore_eos=True)
            results = await asyncio.gather(*(c.generate(p, sp) for p in prompts))
    for prompt, res in zip(prompts, results, strict=True):
        assert len(res.output_ids) == 24
        ids = torch.tensor([prompt + res.output_ids], device="cuda")
        with torch.no_grad():
            logits = ref(ids).logits[0, len(prompt) - 1 : -1].float() / 0.8
        want = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(res.logprobs), want.cpu(), atol=1e-3, rtol=0)


class FailingOnce(torch.nn.Module):
    """The real tiny model, except that one forward raises as a CUDA OOM would."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.generation_config = inner.generation_config
        self.calls = 0
        self.fail_at = fail_at

    def forward(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("CUDA out of memory (injected)")
        return self.inner(**kwargs)


@pytest.mark.timeout(60)
async def test_a_failing_step_aborts_the_batch_and_the_server_goes_on(model: Any) -> None:
    from areal_hex.api import SamplingParams
    from rollout_service.client import InferenceClient
    from rollout_service.server.app import ServerSettings, create_app
    from rollout_service.server.engine import Engine, EngineOptions
    from rollout_service.server.main import ServerThread

    flaky = FailingOnce(model, fail_at=10)
    engine = Engine(flaky, None, lambda p: model, "tiny", "0", EngineOptions())
    with ServerThread(create_app(engine, ServerSettings())) as url:
        async with InferenceClient(url) as c:
            sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
            batch = {
                "input_ids": [[5], [6, 7]],
                "sampling_params": {"max_new_tokens": 40, "ignore_eos": True},
            }
            first = await c.generate_raw(batch)
            assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in first)
            assert all(0 < len(r["output_ids"]) < 40 for r in first)
            assert "engine error" in first[0]["meta_info"]["finish_reason"]["message"]
            info = await c.server_info()
            assert "CUDA out of memory (injected)" in info["last_error"]
            again = await c.generate([5], sp)
            assert again.finish_reason == "length" and len(again.output_ids) == 40
            assert await c.health()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("min_admit", [1, 4])
async def test_a_queue_joins_the_running_batch_in_few_prefills(model: Any, min_admit: int) -> None:
    """8 running rows, 32 requests of different lengths: with `min_admit` 4 the queue
    joins in batches of at least 4 (fewer prefill calls than with 1), and every request
    still gets exactly the tokens it asked for."""
    from rollout_service.server.engine import Engine, EngineOptions
    from rollout_service.wire import SamplingParamsIn

    opts = EngineOptions(max_running_requests=8, min_admit=min_admit)
    engine = Engine(model, None, lambda p: model, "tiny", "0", opts)
    engine.start()
    try:
        lengths = [1 + (i * 5) % 12 for i in range(32)]
        outs = await asyncio.gather(
            *(
                engine.generate(
                    [5 + i % 3, 6], SamplingParamsIn(max_new_tokens=n, ignore_eos=True), f"r{i}"
                )
                for i, n in enumerate(lengths)
            )
        )
        prefills = engine.stats().prefill_batches_total
    finally:
        engine.stop()
    assert [len(o.output_ids) for o in outs] == lengths
    if min_admit == 1:
        assert prefills > 32 // 4 + 4  # one prefill per freed row or two
    else:
        assert prefills <= 32 // 4 + 1  # the first 8, then batches of at least 4
