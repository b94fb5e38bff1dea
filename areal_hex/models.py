"""Models and tokenizers: the tiny locally built ones, and loading any HF causal LM.

The tiny model is a small Qwen3 built from a config; its tokenizer is character-level and
built here from a fixed alphabet, so nothing is ever downloaded. Heavy imports
(torch, transformers, tokenizers) happen inside the functions.
"""

from __future__ import annotations

import shutil
import string
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_hex.config import ModelConfig, TinyModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, EOS, UNK, IM_START, IM_END)
# Printable ASCII (letters, digits, punctuation, space, newline): enough for GSM8K-style text.
ALPHABET = "".join(dict.fromkeys(string.printable.replace("\r", "").replace("\x0b", "")))
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII with Qwen-style chat specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ALPHABET))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=UNK,
        additional_special_tokens=[EOS, IM_START],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen3_config(
    cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, **extra: Any
) -> Qwen3Config:
    """The Qwen3Config of the tiny model over `tokenizer` (`extra`: further keys, e.g. a
    classifier's num_labels)."""
    from transformers import Qwen3Config

    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(
            f"model.tiny.hidden_size ({cfg.hidden_size}) must be divisible by "
            f"model.tiny.num_heads ({cfg.num_heads})"
        )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"model.tiny.num_heads ({cfg.num_heads}) must be divisible by "
            f"model.tiny.num_kv_heads ({cfg.num_kv_heads})"
        )
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
        **extra,
    )


def build_tiny_model(
    cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised Qwen3 of the configured size (deterministic in `seed`)."""
    import torch
    from transformers import Qwen3ForCausalLM

    config = tiny_qwen3_config(cfg, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def supervised_warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    texts: Sequence[str],
    cfg: TinyModelConfig,
    seed: int = 0,
) -> list[float]:
    """Teacher-forced next-token training on `texts` for `cfg.sft_steps` steps (AdamW).

    Returns the loss per step. Used to give the tiny model a starting policy that knows the
    answer format, as a real RL run starts from a pretrained/SFT model.
    """
    import torch

    if not texts:
        raise ValueError("supervised warm start needs at least one text")
    gen = torch.Generator().manual_seed(seed)
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr)
    model.train()
    losses = []
    for _ in range(cfg.sft_steps):
        idx = torch.randint(len(encoded), (cfg.sft_batch_size,), generator=gen).tolist()
        batch = [encoded[i][: cfg.max_position_embeddings] for i in idx]
        ids, mask = pad_batch(batch, tokenizer.pad_token_id)
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def pad_batch(batch: Sequence[Sequence[int]], pad_id: int, device: str = "cpu") -> tuple:
    """Right-padded (B, T) input ids and their attention mask, of token id lists."""
    import torch

    width = max(1, max(len(b) for b in batch))
    ids = torch.full((len(batch), width), int(pad_id))  # (B, T)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, b in enumerate(batch):
        ids[row, : len(b)] = torch.tensor(list(b), dtype=torch.long)
        mask[row, : len(b)] = 1
    return ids.to(device), mask.to(device)


def materialize(
    model_cfg: ModelConfig, out_dir: str | Path, sft_texts: Sequence[str] | None = None
) -> Path:
    """Write the configured initial model as an HF directory (weights + tokenizer).

    - `model.tiny` set and no `model.path`: build the tiny model and tokenizer here, then
      warm-start it on `sft_texts` if `model.tiny.sft_steps` > 0.
    - `model.path` a local directory: copy it (a run never writes into the user's model).
    - otherwise: load from the HF hub cache by name and save.
    """
    out = Path(out_dir)
    if out.exists() and (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if model_cfg.path is None:
        if model_cfg.tiny is None:
            raise ValueError("model: set model.path (HF name or directory) or model.tiny")
        tokenizer = build_tokenizer()
        model = build_tiny_model(model_cfg.tiny, tokenizer, seed=model_cfg.seed)
        if model_cfg.tiny.sft_steps:
            if not sft_texts:
                raise ValueError("model.tiny.sft_steps > 0 needs texts to warm-start on")
            supervised_warm_start(model, tokenizer, sft_texts, model_cfg.tiny, model_cfg.seed)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    elif Path(model_cfg.path).is_dir():
        shutil.copytree(model_cfg.path, tmp)
        if model_cfg.tokenizer_path and Path(model_cfg.tokenizer_path).is_dir():
            load_tokenizer(model_cfg.tokenizer_path).save_pretrained(tmp)
    else:
        model = load_model(model_cfg.path, "cpu", model_cfg.dtype)
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(model_cfg.tokenizer_path or model_cfg.path).save_pretrained(tmp)
    tmp.replace(out)
    return out


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def torch_dtype(name: str):  # -> torch.dtype
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# config.json keys that do not change what the weights compute
_VOLATILE_CONFIG_KEYS = {
    "_name_or_path",
    "architectures",
    "transformers_version",
    "torch_dtype",
    "dtype",
}


def load_weights_in_place(model: PreTrainedModel, path: str | Path) -> bool:
    """Copy the safetensors weights of the HF directory `path` into `model` when they fit
    it exactly (same config, same names and shapes; tied weights may be absent). Returns
    False, leaving `model` untouched, otherwise: the caller then loads the model anew.
    Much faster than `from_pretrained` for a reload between decode steps."""
    import json

    import torch
    from safetensors.torch import load_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    try:
        new_cfg = json.loads((root / "config.json").read_text())
        if not files or not isinstance(new_cfg, dict):
            return False
        own_cfg = model.config.to_dict()
        if any(own_cfg.get(k) != v for k, v in new_cfg.items() if k not in _VOLATILE_CONFIG_KEYS):
            return False
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
    except Exception:  # unreadable or malformed: let the full load report it
        return False
    return fill(model, weights)


def fill(model: PreTrainedModel, weights: dict) -> bool:  # weights: name -> torch.Tensor
    """Copy `weights` into `model` when they set every parameter and buffer of its state
    (tied ones aside) with the same names and shapes; False, `model` untouched, else."""
    import torch

    own = model.state_dict()
    if any(k not in own or own[k].shape != v.shape for k, v in weights.items()):
        return False
    present = {own[k].data_ptr() for k in weights}
    if any(own[k].data_ptr() not in present for k in own.keys() - weights.keys()):
        return False  # a parameter the file does not set (and that is not tied to one it does)
    with torch.no_grad():
        for k, v in weights.items():
            own[k].copy_(v)
    return True


# `load_direct` builds the model at its configured size, its initial values then
# overwritten: bounded by the file's size (beyond it, from_pretrained's meta-device
# construction is the cheaper one)
DIRECT_MAX_BYTES = 64 << 20


def load_direct(path: str | Path, dtype: str = "float32") -> PreTrainedModel | None:
    """The causal LM of the HF directory `path` built from its config and filled from its
    single safetensors file, when it is small (`DIRECT_MAX_BYTES`), stored in `dtype`,
    of a class transformers has (no remote code, not quantized) and its file sets every
    parameter (tied ones aside); None otherwise. The same tensors, buffers, config and
    generation config as `from_pretrained`, without its per-process set-up of checkpoint
    conversions (about 0.1 s of CPU, each service's first load)."""
    import json

    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    root = Path(path)
    file = root / "model.safetensors"
    try:
        raw = json.loads((root / "config.json").read_text())
        if (
            not isinstance(raw, dict)
            or {"quantization_config", "auto_map"} & raw.keys()
            or file.stat().st_size > DIRECT_MAX_BYTES
            or (root / "model.safetensors.index.json").exists()
        ):
            return None
        weights = load_file(str(file))
        if any(t.dtype != torch_dtype(dtype) for t in weights.values()):
            return None
        config = AutoConfig.from_pretrained(str(root))
        with torch.random.fork_rng(devices=[]):  # its initial values draw nothing
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
        generation = root / "generation_config.json"
        if generation.is_file():
            model.generation_config = GenerationConfig.from_pretrained(str(root))
    except (OSError, ValueError, KeyError, SafetensorError):  # from_pretrained reports it
        return None
    return model if fill(model, weights) else None


def load_model(path: str | Path, device: str = "cpu", dtype: str = "float32") -> PreTrainedModel:
    """Load an HF causal LM in eval mode on `device` (`load_direct` where it applies)."""
    model = load_direct(path, dtype)
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype))
    return model.to(device).eval()
