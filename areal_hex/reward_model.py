"""The reward model: a sequence classifier with one label whose output is the reward of
prompt + completion. Loading any HF one, scoring texts in batches, and the tiny one
trained here on the job's generated arithmetic data.

The tiny reward model is the tiny policy's Qwen3 shape (`model.tiny`, or
`rollout.reward_model.tiny`) with a score head, over the same character tokenizer,
trained by regression (mean squared error) to the rule's reward of constructed
completions of the training problems: right answers (1) and wrong sums, answer lines
that differ from the working, missing or cut `#### answer` lines (0). Its score
is thus on the rule's scale (about 0 to 1). The held-out accuracy is measured on the
test split's problems (never trained on). It is built deterministically from the config
and kept in `<cache>/reward_models/<key>/` (`cache_root`), so every later run of the
job, and every instance of the reward-model task, loads it rather than train it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_hex.config import ExperimentConfig, TinyModelConfig
from areal_hex.data import DEFAULT_INSTRUCTIONS, Problem, load_problems, render_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

FORMAT = 1  # bump when the data or the training below change what is built
INFO_FILE = "reward_model.json"  # what was trained, and its held-out accuracy
LR, BATCH = 3e-3, 32


@dataclass(frozen=True)
class Example:
    text: str  # prompt + completion, as the controller sends it
    label: float  # the rule's reward of the completion: 1.0 or 0.0


# ---------------------------------------------------------------- data
def completions(problem: Problem, rng: random.Random) -> list[tuple[str, float]]:
    """Constructed answers to `problem` with the rule's reward of each: the worked
    solution (twice: as many right answers with working as wrong ones) and the bare
    answer line (1); a wrong sum carried to the answer line, an answer line that
    differs from the working, the working alone, a cut answer line (0)."""
    gold = problem.answer
    solution = problem.solution or f"#### {gold}"
    working = solution.rpartition("####")[0].rstrip()
    offset = rng.choice([-3, -2, -1, 1, 2, 3, 10, -10])
    wrong = str(int(gold) + offset) if gold.lstrip("-").isdigit() else f"{gold}0"
    out = [(solution, 1.0), (solution, 1.0), (f"#### {gold}", 1.0)]
    if working:
        bad_working = working.replace(f"= {gold}", f"= {wrong}")
        out += [
            (f"{bad_working}\n#### {wrong}", 0.0),
            (f"{working}\n#### {wrong}", 0.0),
            (working, 0.0),
            (f"{working}\n##", 0.0),
        ]
    else:
        out += [(f"#### {wrong}", 0.0), ("##", 0.0)]
    return out


def examples(cfg: ExperimentConfig, tokenizer: Any, split: str, seed: int = 0) -> list[Example]:
    """Prompt + constructed completion of every problem of `split`, with its label."""
    data = cfg.data
    instruction = data.instruction
    if instruction is None:
        instruction = DEFAULT_INSTRUCTIONS[data.dataset]
    rng = random.Random(f"rm:{seed}:{split}")
    out = []
    for p in load_problems(data, split):
        prompt = render_prompt(p.question, tokenizer, data.use_chat_template, instruction)
        out += [Example(prompt + c, y) for c, y in completions(p, rng)]
    return out


# ---------------------------------------------------------------- model
def build_tiny_reward_model(
    tiny: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised Qwen3 sequence classifier (one label, regression) of the
    tiny policy's shape (deterministic in `seed`)."""
    import torch
    from transformers import Qwen3ForSequenceClassification

    from areal_hex.models import tiny_qwen3_config

    config = tiny_qwen3_config(tiny, tokenizer, num_labels=1, problem_type="regression")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForSequenceClassification(config)


def load_reward_model(path: str | Path, device: str = "cpu", dtype: str = "float32") -> Any:
    """An HF sequence-classification model in eval mode; refused unless it has one label
    (its output is the reward)."""
    from transformers import AutoModelForSequenceClassification

    from areal_hex.models import torch_dtype

    model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch_dtype(dtype))
    if model.config.num_labels != 1:
        raise ValueError(
            f"reward model {path}: {model.config.num_labels} labels; expected a sequence "
            "classifier with num_labels 1 (its one output is the reward)"
        )
    if model.config.pad_token_id is None:
        raise ValueError(f"reward model {path}: config has no pad_token_id (batching needs one)")
    return model.to(device).eval()


def score_ids(model: Any, pad_id: int, ids: Sequence[Sequence[int]], max_batch: int) -> list:
    """The model's output for each token id list, `max_batch` at a time: one list of
    `num_labels` floats per input."""
    import torch

    from areal_hex.models import pad_batch

    device = next(model.parameters()).device
    out: list[list[float]] = []
    with torch.inference_mode():
        for i in range(0, len(ids), max_batch):
            x, mask = pad_batch(ids[i : i + max_batch], pad_id, str(device))
            logits = model(input_ids=x, attention_mask=mask).logits  # (B, num_labels)
            out += logits.float().cpu().tolist()
    return out


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def accuracy(model: Any, tokenizer: Any, data: Sequence[Example]) -> float:
    """Share of `data` whose score falls on the label's side of 0.5."""
    ids = encode_texts(tokenizer, [e.text for e in data])
    scores = score_ids(model, tokenizer.pad_token_id, ids, 256)
    right = sum((s[0] > 0.5) == (e.label > 0.5) for s, e in zip(scores, data, strict=True))
    return right / max(1, len(data))


# ---------------------------------------------------------------- training
def train(
    model: Any, tokenizer: Any, data: Sequence[Example], steps: int, seed: int = 0
) -> list[float]:
    """Regression of the score on the labels: `steps` AdamW steps of `BATCH` examples
    drawn with a seeded generator, the learning rate decayed linearly to 0. Returns the
    loss per step."""
    import torch

    from areal_hex.models import pad_batch

    gen = torch.Generator().manual_seed(seed)
    ids = encode_texts(tokenizer, [e.text for e in data])
    labels = torch.tensor([e.label for e in data])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(ids), (BATCH,), generator=gen).tolist()
        x, mask = pad_batch([ids[i] for i in idx], tokenizer.pad_token_id)
        loss = model(input_ids=x, attention_mask=mask, labels=labels[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


# ---------------------------------------------------------------- the tiny one, cached
def cache_root() -> Path:
    """`<cache>/reward_models`, the cache being the profiles' (hexctl/profile/cache.py):
    $AREAL_HEX_CACHE_DIR, else $XDG_CACHE_HOME/areal-hex, else ~/.cache/areal-hex."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "areal-hex"
    return Path(os.environ.get("AREAL_HEX_CACHE_DIR") or xdg) / "reward_models"


def tiny_shape(cfg: ExperimentConfig) -> TinyModelConfig:
    """The tiny reward model's shape: `rollout.reward_model.tiny`, else the tiny policy's."""
    return cfg.rollout.reward_model.tiny or cfg.model.tiny or TinyModelConfig()


def tiny_key(cfg: ExperimentConfig) -> tuple[str, dict[str, Any]]:
    """What the tiny reward model depends on, and its digest."""
    from areal_hex.models import ALPHABET, SPECIAL_TOKENS

    tiny = tiny_shape(cfg)
    parts = {
        "format": FORMAT,
        "data": cfg.data.model_dump(mode="json", exclude={"split", "eval_split", "limit"}),
        "shape": tiny.model_dump(mode="json", exclude={"sft_steps", "sft_lr", "sft_batch_size"}),
        "tokenizer": [SPECIAL_TOKENS, ALPHABET],
        "steps": cfg.rollout.reward_model.tiny_train_steps,
        "seed": cfg.model.seed,
    }
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16], parts


def train_tiny(cfg: ExperimentConfig, out: Path) -> dict[str, Any]:
    """Train the tiny reward model of `cfg` into `out` (an HF directory with its
    tokenizer and `reward_model.json`); returns what that file holds."""
    import torch

    from areal_hex.models import build_tokenizer

    if cfg.model.path is not None:
        raise ValueError(
            "rollout.reward_model.path is unset and model.path is set: the tiny reward model "
            "uses the tiny model's tokenizer; expected rollout.reward_model.path (an HF "
            "sequence-classification directory) for this model"
        )
    t0 = time.monotonic()
    tok = build_tokenizer()
    model = build_tiny_reward_model(tiny_shape(cfg), tok, cfg.model.seed)
    train_set = examples(cfg, tok, cfg.data.split, cfg.model.seed)
    test_set = examples(cfg, tok, cfg.data.eval_split, cfg.model.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same result on any machine, and no contention
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.model.seed)
            steps = cfg.rollout.reward_model.tiny_train_steps
            losses = train(model, tok, train_set, steps, cfg.model.seed)
    finally:
        torch.set_num_threads(threads)
    info = {
        "key": tiny_key(cfg)[0],
        "steps": steps,
        "train_examples": len(train_set),
        "test_examples": len(test_set),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 5),
        "train_accuracy": round(accuracy(model, tok, train_set), 4),
        "heldout_accuracy": round(accuracy(model, tok, test_set), 4),
        # of the right answers (label 1) and of the wrong ones (label 0) alone
        "heldout_accuracy_right": round(accuracy(model, tok, [e for e in test_set if e.label]), 4),
        "heldout_accuracy_wrong": round(
            accuracy(model, tok, [e for e in test_set if not e.label]), 4
        ),
        "train_seconds": round(time.monotonic() - t0, 2),
    }
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def tiny_reward_model(cfg: ExperimentConfig, root: Path | None = None) -> Path:
    """The cached tiny reward model of `cfg`, trained first if absent. Written under a
    temporary name and renamed, so concurrent builders (two instances starting at once)
    never see half a model: the first rename wins, the other copy is discarded."""
    key, _ = tiny_key(cfg)
    base = root or cache_root()
    final = base / key
    if (final / INFO_FILE).is_file():
        return final
    tmp = base / f".{key}.{uuid.uuid4().hex[:8]}"
    try:
        train_tiny(cfg, tmp)
        try:
            tmp.rename(final)
        except OSError:  # another builder got there first
            if not (final / INFO_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def reward_model_path(cfg: ExperimentConfig) -> str:
    """`rollout.reward_model.path`, else the tiny reward model (built if absent)."""
    path = cfg.rollout.reward_model.path
    return path if path is not None else str(tiny_reward_model(cfg))


def read_info(path: str | Path) -> dict[str, Any] | None:
    f = Path(path) / INFO_FILE
    return json.loads(f.read_text()) if f.is_file() else None
