"""`python -m hexctl.bench.system.trl_worker SPEC.json`: one TRL GRPOTrainer run for `bench trl`,
in a process of its own (as each `areal-hex run` is).

SPEC: `v0` (HF directory: the initial weights and tokenizer), `rows` (JSONL: prompt
text, its token ids as the rollout controller has them, gold answer; in the
controller's order), `grpo` (trl.GRPOConfig arguments, `hexctl.bench.system.trl
.grpo_config_kwargs`), `threads` (torch threads, null: torch's default), `final` (where
the trained model and tokenizer go, for `areal-hex eval`) and `result` (this run's
figures, JSON).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def gsm8k_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """The run's reward (`areal_hex.rewards.math_reward`: the final `#### answer` or
    `\\boxed{}` checked by math-verify) for TRL's batch of decoded completions."""
    from areal_hex.rewards import math_reward

    return [math_reward(c, a) for c, a in zip(completions, answer, strict=True)]


def load_rows(path: Path, tokenizer: Any) -> list[dict[str, str]]:
    """The prompts as TRL will see them; each must tokenize (TRL's way: the processing
    class on the text) to exactly the ids the controller sends."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    ids = tokenizer(text=[r["prompt"] for r in rows])["input_ids"]
    for r, got in zip(rows, ids, strict=True):
        if list(got) != r["ids"]:
            raise SystemExit(f"prompt {r['prompt']!r}: TRL's tokens differ from the controller's")
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]


def main(spec_path: str) -> int:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    if spec["threads"]:
        torch.set_num_threads(int(spec["threads"]))
    tokenizer = AutoTokenizer.from_pretrained(spec["v0"])
    model = AutoModelForCausalLM.from_pretrained(spec["v0"], dtype=torch.float32)
    data = Dataset.from_list(load_rows(Path(spec["rows"]), tokenizer))
    step_times: list[float] = []
    first_step: list[float] = []  # wall clock, for the start-up from the bench's launch

    class StepClock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step_times.append(time.perf_counter())
            if not first_step:
                first_step.append(time.time())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[gsm8k_reward],
        args=GRPOConfig(**spec["grpo"]),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    t0 = time.perf_counter()
    trainer.train()
    rl_s = time.perf_counter() - t0
    trainer.save_model(spec["final"])
    tokenizer.save_pretrained(spec["final"])
    out = figures(trainer, spec["grpo"], step_times, rl_s)
    if first_step and spec.get("t_launch"):
        out["startup_s"] = round(first_step[0] - float(spec["t_launch"]), 2)
    Path(spec["result"]).write_text(json.dumps(out))
    return 0


def figures(trainer: Any, grpo: dict[str, Any], step_times: list[float], rl_s: float) -> dict:
    """The run's figures, defined as `bench trl` defines areal-hex's."""
    import torch

    batch = grpo["per_device_train_batch_size"] * grpo["gradient_accumulation_steps"]
    steps = int(trainer.state.global_step)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    k = max(1, len(rewards) // 5)  # areal-hex's final_reward: the last 20 % of steps
    steady = None
    if len(step_times) > 1 and step_times[-1] > step_times[0]:
        steady = (len(step_times) - 1) * batch / (step_times[-1] - step_times[0])
    return {
        "samples_per_s": steps * batch / rl_s,
        "steady_samples_per_s": steady,
        "rl_s": round(rl_s, 2),
        "steps": steps,
        "samples_trained": steps * batch,
        "final_reward": sum(rewards[-k:]) / k if rewards else None,
        "first_reward": rewards[0] if rewards else None,
        "torch_threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
