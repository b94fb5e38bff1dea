"""The lean prefill/decode forward against HF's forward on the same running batch, through
prefill, merge, decode steps past the buffers' growth, rows leaving in place and a
select that cuts columns: the same logits bit for bit (CPU), but for the float32 decode
step's attention (two matmuls and a softmax instead of SDPA's kernel), whose logits move
by rounding only: the same greedy tokens, every probability within 1e-6. And the models
it must leave to HF."""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from areal_hex.config import TinyModelConfig
from areal_hex.models import build_tiny_model, build_tokenizer
from rollout_service.server import batching, decoder
from rollout_service.server.sampling import SamplingTensors

VOCAB = 103
PREFILL_ROWS = 2 * 3 + 2  # `run`: three prompt positions of two rows, the last of two


def params(n: int) -> SamplingTensors:
    row = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0)
    return SamplingTensors.build([row] * n, torch.device("cpu"))


@cache
def tokenizer() -> Any:
    return build_tokenizer()


def qwen3(heads: int, kv_heads: int) -> Any:
    cfg = TinyModelConfig(num_heads=heads, num_kv_heads=kv_heads)
    return build_tiny_model(cfg, tokenizer(), seed=0).eval()


def hf_model(kind: str, **extra: Any) -> Any:
    """A 2-layer model of another supported family, built from a config (random weights)."""
    import transformers

    torch.manual_seed(0)
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[kind]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **extra,
    )
    config._attn_implementation = "sdpa"
    return model_cls(config).eval()


def assert_same_logits(lean: torch.Tensor, hf: torch.Tensor, exact: bool) -> None:
    """Bit for bit, or (`exact` False) within float32 rounding: every token's probability
    at temperature 1 and 1.2 within 1e-6 (the tokens fed back were each side's argmax, so
    the sequences already agree)."""
    if exact:
        assert torch.equal(lean, hf)
        return
    torch.testing.assert_close(lean, hf, atol=1e-5, rtol=0)
    for temperature in (1.0, 1.2):
        p_lean, p_hf = (torch.softmax(x.float() / temperature, -1) for x in (lean, hf))
        assert float((p_lean - p_hf).abs().max()) <= 1e-6


def run(model: Any, dec: decoder.Decoder | None) -> tuple[torch.Tensor, list[int]]:
    """Prefill (with prompt logits), merge a longer batch under it, decode, let the
    longest row leave in place (attention skips its columns), decode until the buffers
    are rebuilt without them (32 columns, then 58), keep three rows in a new order,
    decode on. Returns every logit computed (the prefills' first: PREFILL_ROWS rows),
    and the capacity before each step."""
    seqs = [[7, 8, 9, 10, 11, 12], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38], [7, 8]]
    a, first = batching.prefill_keep(model, seqs[:2], params(2), 0, 3, dec)
    b, second = batching.prefill(model, seqs[2:], params(2), 0, dec)
    a.last, b.last = torch.tensor([40, 41]), torch.tensor([42, 43])
    batch = batching.merge(a, b)
    out, caps = [first.flatten(0, 1), second], []
    for i in range(40):
        caps.append(batch.capacity)
        logits = batching.decode_step(model, batch, dec)
        out.append(logits)
        batch.last = logits.argmax(-1)
        if i == 10:
            assert batching.remove(batch, [0, 1, 3]) == [0, 1, 3] and batch.start == 3
        if i == 30:
            batch = batching.select(batch, [1, 0, 2])
    return torch.cat(out), caps


@pytest.mark.parametrize(
    "make",
    [
        lambda: qwen3(4, 2),
        lambda: qwen3(4, 1).to(torch.bfloat16),
        lambda: hf_model("qwen2"),
        lambda: hf_model("llama", attention_bias=True, mlp_bias=True),
    ],
    ids=["qwen3", "qwen3-bf16-one-kv-head", "qwen2-bias", "llama-bias"],
)
def test_lean_forward_gives_hf_logits_bit_for_bit(make: Any) -> None:
    model = make()
    dec = decoder.for_model(model)
    assert dec is not None
    lean, caps = run(model, dec)
    hf, _ = run(model, None)
    assert torch.equal(lean[:PREFILL_ROWS], hf[:PREFILL_ROWS])
    float32 = model.dtype == torch.float32
    assert_same_logits(lean[PREFILL_ROWS:], hf[PREFILL_ROWS:], exact=not float32)
    assert caps[:3] == [32, 32, 32] and 58 in caps[:31]  # rebuilt once, without 3 columns


def greedy(model: Any, prompts: list[list[int]], dec: decoder.Decoder | None) -> list[list[int]]:
    """20 greedy tokens per prompt, all prompts in one running batch; rows leave at EOS."""
    batch, logits = batching.prefill(model, prompts, params(len(prompts)), 0, dec)
    eos = int(model.config.eos_token_id)
    rows, out = list(range(len(prompts))), [[] for _ in prompts]
    for _ in range(20):
        tokens = logits.argmax(-1)
        keep = []
        for i, tok in enumerate(tokens.tolist()):
            out[rows[i]].append(tok)
            if tok != eos:
                keep.append(i)
        if not keep:
            break
        batch.last = tokens
        if len(keep) < len(rows):
            rows = [rows[i] for i in batching.remove(batch, keep)]
        logits = batching.decode_step(model, batch, dec)
    return out


def test_greedy_tokens_match_hf_on_a_prompt_set() -> None:
    """Eight chat prompts of sums, as the README job's: the lean step's greedy tokens are
    HF's, one by one."""
    tok = tokenizer()
    prompts = []
    for a, b in [(i, (7 * i + 3) % 20) for i in range(8)]:
        msgs = [{"role": "user", "content": f"What is {a} + {b}?"}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    model = qwen3(4, 2)
    lean = greedy(model, prompts, decoder.for_model(model))
    assert lean == greedy(model, prompts, None)
    assert sum(map(len, lean)) > 8 * 8  # most rows ran many steps


def test_prompt_logits_are_hf_prefill_logits() -> None:
    """The lean prefill's last positions are those of a plain forward of each prompt."""
    model = qwen3(4, 2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    _, logits = batching.prefill_keep(model, prompts, params(2), 0, 2, decoder.for_model(model))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0, -2:]
        torch.testing.assert_close(logits[row], want, atol=1e-5, rtol=0)


class Wrapped(torch.nn.Module):
    """A model whose forward does more than HF's (the engine must call it)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, **kwargs: Any) -> Any:
        return self.inner(**kwargs)


def test_models_outside_the_scheme_run_hf() -> None:
    model = qwen3(4, 2)
    assert decoder.for_model(model) is not None
    assert decoder.for_model(Wrapped(model)) is None
    eager = hf_model("qwen2")
    eager.config._attn_implementation = "eager"
    assert decoder.for_model(eager) is None
    dynamic = hf_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert decoder.for_model(dynamic) is None
    quantized = qwen3(4, 2)  # a Linear subclass (as quantization libraries swap in)
    quantized.model.layers[0].mlp.up_proj.__class__ = type("QLinear", (torch.nn.Linear,), {})
    assert decoder.for_model(quantized) is None


def test_the_engine_picks_the_lean_step_and_keeps_it_through_an_in_place_reload(
    tmp_path: Any,
) -> None:
    """The step loop builds the decoder from its model (a wrapped model runs HF); a reload
    into the running model keeps the decoder, which then computes with the new weights
    (its fused copies of them too, built before the reload)."""
    from rollout_service.server.engine import Engine, EngineOptions
    from rollout_service.server.requests import Control
    from rollout_service.server.step_loop import Core

    model, new = qwen3(4, 2), build_tiny_model(TinyModelConfig(), tokenizer(), seed=1).eval()
    new.save_pretrained(tmp_path / "v1")
    core = Core(Engine(model, None, lambda p: model, "tiny", "0", EngineOptions()))
    lean = core.decoder
    assert lean is not None
    assert_same_logits(run(model, lean)[0], run(model, None)[0], exact=False)
    reload = Control("reload", {"path": str(tmp_path / "v1"), "version": "1", "abort_all": False})
    assert core._reload(reload) and core.e.model is model and core.decoder is lean
    assert_same_logits(run(model, lean)[0], run(new, None)[0], exact=False)

    wrapped = Wrapped(model)
    wrapped.generation_config = model.generation_config
    opts = EngineOptions()
    assert Core(Engine(wrapped, None, lambda p: model, "tiny", "0", opts)).decoder is None
