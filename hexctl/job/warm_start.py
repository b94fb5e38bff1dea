"""The tiny model's supervised warm start: which texts it sees (`areal-hex run` and the
deploy `prepare` step build the same initial weights from the same config)."""

from __future__ import annotations

import random

from areal_hex.config import ExperimentConfig


def sft_texts(cfg: ExperimentConfig, tokenizer: object) -> list[str]:
    """Prompt + reference solution + end-of-turn for the tiny model's warm start, from the
    first `run.warm_start_fraction` of the training split (the rest is left for RL to
    learn; the held-out split is never seen). A `run.warm_start_answer_fraction` share of
    the solutions keeps the final `#### answer` line; the others end after the working."""
    from areal_hex.data import DEFAULT_INSTRUCTIONS, load_problems, render_prompt

    problems = load_problems(cfg.data, cfg.data.split)
    problems = problems[: max(1, int(len(problems) * cfg.run.warm_start_fraction))]
    instruction = cfg.data.instruction
    if instruction is None:
        instruction = DEFAULT_INSTRUCTIONS[cfg.data.dataset]
    eos = str(getattr(tokenizer, "eos_token", "") or "")
    keep = random.Random(cfg.run.seed)
    out = []
    for p in problems:
        prompt = render_prompt(p.question, tokenizer, cfg.data.use_chat_template, instruction)
        solution = p.solution or f"#### {p.answer}"
        if keep.random() >= cfg.run.warm_start_answer_fraction:
            solution = without_answer_line(solution)
        out.append(prompt + solution + eos)
    return out


def without_answer_line(solution: str) -> str:
    """A GSM8K-style solution without its final `#### answer` line (unchanged if it has
    none, or if nothing would be left)."""
    head, sep, _ = solution.rpartition("####")
    return head.rstrip() if sep and head.strip() else solution
