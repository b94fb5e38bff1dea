"""Checking a final answer against the gold one: the pure functions a reward worker runs.

Kept apart from the pool (`areal_hex.rewards`) so that a spawned worker imports only
this, math-verify and `areal_hex.lifetime`, not the config and data modules the pool's
own imports bring (a third of a second of CPU at every worker's start).

The final answer is the content of the completion's last `\\boxed{}`, else what follows
its last `####` (GSM8K style) on that line; a completion with neither scores 0.
`math_reward` parses both as `\\boxed{}` with math-verify. `plain_integer_reward` gives
its result without math-verify when both are plain integers; `ParseMemo` remembers
math-verify's parse of each answer text a process has seen.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence

from areal_hex.lifetime import die_with_parent

RewardFn = Callable[[str, str], float]
PARSED = 4096  # parsed answers (and gold answers) a process remembers
_PLAIN_INT = re.compile(r"0|-?[1-9][0-9]{0,8}")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: no usable answer


def extract_final_answer(completion: str) -> str | None:
    """The last \\boxed{} content, else the rest of the line after the last `####`."""
    boxed = last_boxed(completion)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1].strip()
        line = tail.splitlines()[0].strip() if tail else ""
        line = line.rstrip(".").lstrip("$").strip()
        return line or None
    return None


def plain_integer_reward(answer: str, gold: str) -> float | None:
    """`math_reward` of a final answer against a gold answer when both are plain integers
    (`_PLAIN_INT`: an optional minus, no leading zero, at most 9 digits), without
    math-verify: it parses each to a SymPy Integer and compares them exactly, and a plain
    integer's text is the only one of its value, so the reward is 1.0 exactly when the
    texts are equal. None when either is not a plain integer."""
    if _PLAIN_INT.fullmatch(answer) and _PLAIN_INT.fullmatch(gold):
        return 1.0 if answer == gold else 0.0
    return None


def math_reward(completion: str, gold: str) -> float:
    """1.0 when the completion's final answer equals `gold` per math-verify, else 0.0."""
    return _math_reward_parsed(completion, _parse_boxed(gold))


class ParseMemo:
    """math-verify's parse of `\\boxed{answer}`, remembered for the last `size` answers.

    The parse is a pure function of the answer's text, and it is most of a check's cost
    (an ANTLR LaTeX parse and a SymPy conversion); the same few answers come back for
    every gold answer (`17` scored against many prompts' golds). An empty parse, which
    a parse that timed out also gives, is not remembered: the text is parsed again."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"ParseMemo: size must be > 0, got {size}")
        self.size = size
        self._known: OrderedDict[str, list] = OrderedDict()
        self.hits = self.misses = 0

    def __call__(self, answer: str) -> list:
        got = self._known.get(answer)
        if got is not None:
            self._known.move_to_end(answer)
            self.hits += 1
            return got
        from math_verify import parse

        self.misses += 1
        got = parse(f"\\boxed{{{answer}}}")
        if got:
            self._known[answer] = got
            if len(self._known) > self.size:
                self._known.popitem(last=False)
        return got


_parse_boxed = ParseMemo(PARSED)  # one per process: each reward worker keeps its own


def _math_reward_parsed(completion: str, gold_parsed: list) -> float:
    from math_verify import verify

    pred = extract_final_answer(completion)
    if pred is None or not gold_parsed:
        return 0.0
    pred_parsed = _parse_boxed(pred)
    if not pred_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, pred_parsed) else 0.0


def score_each(fn: RewardFn, completions: Sequence[str], gold: str) -> list[float | str]:
    """One worker call for a group's answers: each answer's reward, or the exception it
    raised as a string (the pool scores it 0 and counts it). For `math_reward` the gold
    answer is parsed once."""
    out: list[float | str] = []
    gold_parsed = None
    for c in completions:
        try:
            if fn is math_reward:
                if gold_parsed is None:
                    gold_parsed = _parse_boxed(gold)
                out.append(_math_reward_parsed(c, gold_parsed))
            else:
                out.append(float(fn(c, gold)))
        except Exception as exc:  # noqa: BLE001  (the reward function's own failure)
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def worker_init(parent: int) -> None:
    # a worker must not outlive the process that scores through it (a SIGKILLed
    # controller would leave it idle forever)
    hook = die_with_parent()
    if hook is not None:
        hook()
    if os.getppid() != parent:  # the parent died before the hook took effect
        os._exit(0)
    import math_verify  # noqa: F401  (import once per worker, not inside the timed call)


def ping() -> int:
    return os.getpid()
