from __future__ import annotations

from pathlib import Path

import torch

from areal_hex.config import ModelConfig, TinyModelConfig
from areal_hex.models import (
    IM_END,
    build_tiny_model,
    build_tokenizer,
    load_model,
    load_tokenizer,
    materialize,
)


def test_tokenizer_round_trips_text_and_chat():
    tok = build_tokenizer()
    text = "Natalia sold 48/2 = 24 clips.\n#### 72"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    chat_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(chat_ids[0]) == "<|im_start|>"
    assert len(chat_ids) == len(prompt) - 2 * (len("<|im_start|>") - 1) - (len("<|im_end|>") - 1)
    assert tok.eos_token == IM_END and tok.pad_token_id != tok.eos_token_id


def test_tiny_model_is_deterministic_and_materializes(tmp_path):
    tok = build_tokenizer()
    cfg = TinyModelConfig(num_layers=1, hidden_size=32, intermediate_size=64)
    a, b = build_tiny_model(cfg, tok, seed=3), build_tiny_model(cfg, tok, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    out = materialize(ModelConfig(tiny=cfg, seed=3), tmp_path / "v0")
    loaded = load_model(out)
    ids = torch.tensor([tok("1 + 2 =")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, a.eval()(ids).logits, atol=1e-6)
    assert load_tokenizer(out).decode(ids[0]) == "1 + 2 ="
    # a local directory is copied, not reused in place
    copy = materialize(ModelConfig(path=str(out)), tmp_path / "copy")
    assert (copy / "model.safetensors").is_file() and copy != out


def test_supervised_warm_start_lowers_loss():
    from areal_hex.models import supervised_warm_start

    tok = build_tokenizer()
    cfg = TinyModelConfig(
        num_layers=1, hidden_size=32, intermediate_size=64, sft_steps=60, sft_batch_size=8
    )
    model = build_tiny_model(cfg, tok, seed=0)
    texts = [f"{a} + {b} = {a + b}" for a in range(5) for b in range(5)]
    losses = supervised_warm_start(model, tok, texts, cfg)
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:3]) / 3


def test_reload_in_place_copies_matching_weights_only(tmp_path: Path) -> None:
    import torch

    from areal_hex.models import load_weights_in_place

    tok = build_tokenizer()
    cfg = TinyModelConfig()
    running = build_tiny_model(cfg, tok, seed=0)
    newer = build_tiny_model(cfg, tok, seed=1)
    newer.save_pretrained(tmp_path / "v1", safe_serialization=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert load_weights_in_place(running, tmp_path / "v1")
    with torch.no_grad():
        torch.testing.assert_close(running(ids).logits, newer(ids).logits)
    # tied embeddings stay tied
    assert running.lm_head.weight.data_ptr() == running.model.embed_tokens.weight.data_ptr()
    # another architecture, or a broken file: refused, the running model is untouched
    wider = build_tiny_model(
        cfg.model_copy(update={"hidden_size": 128, "intermediate_size": 256}), tok
    )
    wider.save_pretrained(tmp_path / "wide", safe_serialization=True)
    before = {k: v.clone() for k, v in running.state_dict().items()}
    assert not load_weights_in_place(running, tmp_path / "wide")
    (tmp_path / "v1" / "model.safetensors").write_bytes(b"not a tensor file")
    assert not load_weights_in_place(running, tmp_path / "v1")
    assert not load_weights_in_place(running, tmp_path / "missing")
    for k, v in running.state_dict().items():
        assert torch.equal(v, before[k]), k
