"""`areal-hex profile` (without --local or --box): a model's bare speed on one device.

Generation: transformers prefill (one forward over a prompt batch) and decode steps
(forward of one token per sequence with a KV cache) at several batch sizes. Training: a
torch AdamW step (forward, backward, optimizer) on one device. The model is a tiny
Qwen3 built from a `Qwen3Config` unless an HF config.json is given (weights are random:
speed does not depend on them). No service of the job runs: for the job's own engines,
as `run` places them, see `hexctl/profile/local.py` (`--local`) and
`hexctl/box/profile.py` (`--box`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from areal_hex.device_kind import device_kind
from scheduler.model_shape import ModelShape, load_model_shape
from scheduler.profile import DeviceRates, Profile

# The model `profile` times without a config.json: a tiny Qwen3, seconds on a CPU.
TINY_SHAPE = ModelShape("tiny-qwen3", 2, 128, 4, 2, 32, 384, 512, True)
TINY = {**TINY_SHAPE.hf_config(), "max_position_embeddings": 2048}


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        from areal_hex.errors import UsageError

        raise UsageError("--device cuda: no CUDA device is visible here")
    return choice


def _timed(fn, device: str, repeats: int) -> float:
    import torch

    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):  # best of: other work on the machine only adds time
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_profile(
    config_path: Path | None, device: str, kind: str | None, batches: list[int], context: int
) -> Profile:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

    device = _device(device)
    if device == "cpu":
        # One intra-op thread: OpenMP barriers spin badly when the cores are shared, which
        # made step times swing by 100x between batch sizes here.
        torch.set_num_threads(1)
    if config_path is None:
        cfg = Qwen3Config(**TINY)
        label = TINY_SHAPE.name
    else:
        cfg = AutoConfig.from_pretrained(
            str(config_path.parent if config_path.is_file() else config_path)
        )
        label = str(config_path)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    reps = 10  # best of 10: other processes on the machine only ever add time
    steps = {b: _decode_step(model, cfg.vocab_size, b, context, device, reps) for b in batches}
    prefill = _prefill_rate(model, cfg.vocab_size, context, device, reps)
    train = _train_rate(model, cfg.vocab_size, context, device, max(3, reps // 3))
    shape = _shape(cfg, label)
    rates = DeviceRates(
        device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        decode_step_s=steps,
        decode_context=context,
        prefill_tokens_per_s=prefill,
        train_tokens_per_s=train,
    )
    return Profile(model=label, params=shape.params, kinds={kind or device_kind(device): rates})


def _shape(cfg, label: str) -> ModelShape:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "config.json"
        p.write_text(json.dumps(cfg.to_dict()))
        shape = load_model_shape(str(p))
    return ModelShape(**{**shape.__dict__, "name": label})


def _decode_step(model, vocab: int, batch: int, context: int, device: str, reps: int) -> float:
    """Seconds for one decode step of `batch` sequences holding `context` cached tokens."""
    import torch
    from transformers import DynamicCache

    ids = torch.randint(0, vocab, (batch, context), device=device)  # (B, T)
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        nxt = torch.randint(0, vocab, (batch, 1), device=device)  # (B, 1)
        pos = torch.full((batch, 1), context, device=device)

        def step() -> None:
            model(input_ids=nxt, past_key_values=cache, use_cache=True, position_ids=pos)
            cache.crop(-1)  # drop the new token: the context stays fixed across repeats

        return _timed(step, device, reps)


def _prefill_rate(model, vocab: int, context: int, device: str, reps: int) -> float:
    import torch

    ids = torch.randint(0, vocab, (4, context), device=device)  # (4, T)
    with torch.no_grad():
        s = _timed(lambda: model(input_ids=ids, use_cache=False), device, reps)
    return ids.numel() / s


def _train_rate(model, vocab: int, context: int, device: str, reps: int) -> float:
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, vocab, (2, context), device=device)  # (2, T)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    s = _timed(step, device, reps)
    model.eval()
    return ids.numel() / s
