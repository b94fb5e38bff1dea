"""Checking a final answer against the gold one: the pure functions a reward worker runs.

Kept apart from the pool (`areal_hex.rewards`) so that a spawned worker imports only
this, math-verify and `areal_hex.lifetime`, not the config and data modules the pool's
own imports bring (a third of a second of CPU at every worker's start).

The final answer is the content of the completion's last `\\boxed{}`, else what follows
its last `####` (GSM8K style) on that line; a completion with neither scores 0.
`math_reward` parses both as `\\boxed{}` with math-verify. `plain_integer_reward` gives
its result without math-verify when both are plain integers; `ParseMemo` remembers
math-verify's parse of each answer text a process has seen; `polynomial_verdict` gives
math-verify's comparison of an integer gold answer with an answer that parsed to a
polynomial in integers and letters (`3r`, `a + 7`, `2^6`) without its simplifier.
`warm_up` checks `WARM_UP` once, when a worker starts.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import product
from typing import Any

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
    same = polynomial_verdict(gold_parsed, pred_parsed)
    if same is None:
        same = verify(gold_parsed, pred_parsed)
    return 1.0 if same else 0.0


# What a parsed letter may assume and still stand for infinitely many values: a
# polynomial that is not identically zero is then not zero for some of them.
_GENERIC = {
    "commutative": True,
    "complex": True,
    "extended_real": True,
    "finite": True,
    "hermitian": True,
    "imaginary": False,
    "infinite": False,
    "real": True,
}
POLY_NODES = 64  # larger answers are left to math-verify
POLY_DEGREE = 64


def polynomial_verdict(gold_parsed: list, pred_parsed: list) -> bool | None:
    """`math_verify.verify(gold_parsed, pred_parsed)` (its defaults) when every
    expression of the gold parse is an integer and every one of the answer's is a
    polynomial (`_degree`) that is not a lone letter; None otherwise (ask math-verify).

    verify is true when a pair of the two parses' items (expression or string) compares
    equal. Items of different kinds never do; two strings do when equal and non-empty
    once stripped. An integer g and a polynomial p (no relation, set, float or percent:
    math-verify's other branches do not apply) compare equal by structure (`g == p`), by
    value (`g == p.doit()`) or when `simplify(g - p)` is provably zero; each holds only
    if p is identically g, and a polynomial identically g simplifies to zero. So the
    pair is equal exactly when `expand(p.doit()) == g`: a polynomial's expansion is
    canonical, and its letters stand for infinitely many values (`_GENERIC`)."""
    from sympy import Basic, Integer, Symbol, expand
    from sympy.matrices import MatrixBase

    exprs = (Basic, MatrixBase)
    golds = [g for g in gold_parsed if isinstance(g, exprs)]
    preds = [p for p in pred_parsed if isinstance(p, exprs)]
    if not all(isinstance(g, Integer) for g in golds):
        return None
    if any(isinstance(p, Symbol) or _degree(p, [POLY_NODES]) is None for p in preds):
        return None
    for g, p in product(gold_parsed, pred_parsed):
        if isinstance(g, str) and isinstance(p, str):
            if g.strip() and g.strip() == p.strip():
                return True
        elif isinstance(g, exprs) and isinstance(p, exprs) and expand(p.doit()) == g:
            return True
    return False


def _degree(expr: Any, budget: list[int]) -> int | None:
    """A bound on the degree of `expr`, counting an integer as a letter (so that powers
    of integers stay small too), when it is a polynomial built from integers and generic
    letters by +, * and powers, within `budget[0]` nodes (spent as counted) and that
    bound POLY_DEGREE; None when it is not one."""
    from sympy import Add, Integer, Mul, Pow, Symbol

    budget[0] -= 1
    if budget[0] < 0:
        return None
    if isinstance(expr, Integer):
        return 1
    if type(expr) is Symbol:
        return 1 if expr.assumptions0.items() <= _GENERIC.items() else None
    if type(expr) in (Add, Mul):
        parts = [_degree(a, budget) for a in expr.args]
        if any(d is None for d in parts):
            return None
        d = max(parts) if type(expr) is Add else sum(parts)  # type: ignore[arg-type]
    elif type(expr) is Pow and isinstance(expr.exp, Integer) and expr.exp >= 0:
        base = _degree(expr.base, budget)
        if base is None or int(expr.exp) > POLY_DEGREE:
            return None
        d = base * int(expr.exp)
    else:
        return None
    return d if d <= POLY_DEGREE else None


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


# Final answers of the kinds a sampling policy writes when it is not a plain integer
# (letters, digits, spaces and punctuation run together; none of them a plain integer).
# A process's first checks of such answers cost several times its later ones: the
# LaTeX parser builds its lexer's and parser's prediction tables as it meets new input,
# and SymPy imports modules on first use. Checking these once when a worker starts
# moves that cost out of the run (about 0.3 s of CPU; 78 answers of a README run then
# took 0.24-0.25 s instead of 0.42-0.48 s). Tables and imports change no result.
WARM_UP = (
    "x", "3a", "1 + 2", "# 5", "2?", "7 = 1", "4^b", "[3]", "9%", "6;", "1|2", "5\t2",
    "ab 3", "+ +", "12st", "1\\ 8", "{", "3-", "0 5", "w4", "Q",
)  # fmt: skip


def warm_up() -> int:
    """`math_reward` of each `WARM_UP` answer (against 17); returns how many were checked
    (exceptions included, as `score_each` scores them)."""
    return len(score_each(math_reward, [f"#### {a}" for a in WARM_UP], "17"))


def worker_init(parent: int, warm: bool = False) -> None:
    """A reward worker's start: tied to its parent's life, math-verify imported, and with
    `warm` its first checks made (`warm_up`)."""
    # a worker must not outlive the process that scores through it (a SIGKILLed
    # controller would leave it idle forever)
    hook = die_with_parent()
    if hook is not None:
        hook()
    if os.getppid() != parent:  # the parent died before the hook took effect
        os._exit(0)
    import math_verify  # noqa: F401  (import once per worker, not inside the timed call)

    if warm:
        warm_up()


def ping() -> int:
    return os.getpid()


def parse_misses() -> int:
    """Answers this process has parsed with math-verify (a new text each)."""
    return _parse_boxed.misses
