"""Datasets and prompts: GSM8K, MATH-500, generated arithmetic, chat templating.

A `Problem` is a question with its gold final answer; a `Prompt` is a problem rendered
(chat template or plain text) and tokenized, ready for the rollout controller.

- GSM8K: the HF hub dataset `openai/gsm8k` (config `main`) when the `datasets` package is
  installed and online, or local parquet/jsonl files with `question` and `answer`
  columns (answer = "reasoning ... #### N").
- MATH-500: `HuggingFaceH4/MATH-500`, or local parquet/jsonl with `problem`, `answer` and
  `solution` columns (answer missing: the last \\boxed{} of the solution).
- arithmetic: generated GSM8K-format problems ("What is 3 + 4?" -> "3 + 4 = 7\\n#### 7"),
  seeded, with train and test splits that never overlap, for runs with no downloads.

pyarrow and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_hex.config.data import ArithmeticConfig, DataConfig
from areal_hex.math_check import last_boxed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

GSM8K_HUB = ("openai/gsm8k", "main")
MATH500_HUB = ("HuggingFaceH4/MATH-500", None)
DEFAULT_INSTRUCTIONS = {
    "arithmetic": "",
    "gsm8k": 'Let\'s think step by step and output the final answer after "####".',
    "math500": "Please reason step by step, and put your final answer within \\boxed{}.",
}
# Enumerate the arithmetic problem space when it is at most this large, else sample.
_ENUMERATE_LIMIT = 1_000_000


class DataError(ValueError):
    """A dataset that cannot be loaded or used; the message says where and what."""


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str  # gold final answer (e.g. "7", "\\frac{1}{2}")
    solution: str = ""  # full reference solution (GSM8K: "... #### N")


@dataclass(frozen=True)
class Prompt:
    id: str
    input_ids: list[int]
    answer: str
    text: str  # the rendered prompt the ids encode


@dataclass
class PromptSet:
    prompts: list[Prompt]
    skipped_overlong: int = 0  # problems whose prompt exceeded data.max_prompt_tokens
    skipped_ids: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- answers
def gsm8k_final_answer(solution: str) -> str:
    """The number after the last `####` of a GSM8K solution, commas removed."""
    if "####" not in solution:
        raise DataError(f"GSM8K answer has no '#### N' final answer: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


# ---------------------------------------------------------------- local files
@dataclass(frozen=True)
class Row:
    """A record with where it came from (`file:line` for JSON lines, `file row N`
    otherwise), for errors that name it."""

    where: str
    data: dict[str, Any]

    def field(self, name: str, expected: Sequence[str]) -> str:
        """Field `name` as text; a missing or empty one is a DataError naming the row,
        the field and the fields a row of this dataset has."""
        value = self.data.get(name)
        if value is None or (isinstance(value, str) and not value.strip()):
            what = "no" if name not in self.data else f"an empty ({value!r})"
            raise DataError(
                f"{self.where}: {what} field {name!r}; expected fields {list(expected)}, "
                f"found {sorted(self.data)}"
            )
        if isinstance(value, (dict, list)):
            raise DataError(
                f"{self.where}: field {name!r} is a {type(value).__name__}; expected text "
                "or a number"
            )
        return str(value)


def read_records(path: str | Path, split: str) -> list[dict[str, Any]]:
    """Rows of a parquet/jsonl/json file, or of the `*<split>*` files of a directory."""
    return [row.data for row in read_rows(path, split)]


def read_rows(path: str | Path, split: str) -> list[Row]:
    """`read_records` with where each row came from."""
    p = Path(path)
    if p.is_dir():
        files = sorted(
            f
            for f in p.rglob(f"*{split}*")
            if f.is_file() and f.suffix in (".parquet", ".jsonl", ".json")
        )
        if not files:
            raise DataError(
                f"data.path {p}: no parquet/jsonl/json file with {split!r} in its name "
                f"(expected e.g. {p}/{split}.parquet or {p}/{split}.jsonl)"
            )
        return [row for f in files for row in read_rows(f, split)]
    if not p.is_file():
        raise DataError(f"data.path {p}: no such file or directory")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(p).to_pylist()
        return [Row(f"{p} row {n}", r) for n, r in enumerate(records, 1)]
    if p.suffix in (".jsonl", ".json"):
        return _read_json_rows(p)
    raise DataError(f"data.path {p}: unsupported file type {p.suffix!r} (parquet, jsonl, json)")


def _read_json_rows(p: Path) -> list[Row]:
    text = p.read_text()
    rows: list[Row] = []
    if p.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}:{exc.lineno}: not valid JSON: {exc.msg}") from None
        rows = [Row(f"{p} row {n}", r) for n, r in enumerate(records, 1)]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(Row(f"{p}:{n}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{p}:{n}: not valid JSON: {exc}") from None
    for row in rows:
        if not isinstance(row.data, dict):
            raise DataError(f"{row.where}: a {type(row.data).__name__}, expected an object")
    return rows


def _hub_rows(name: str, config: str | None, split: str) -> list[Row]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"loading {name} from the HF hub needs the `datasets` package "
            f"(pip install datasets) and network access; or set data.path to a local "
            f"parquet/jsonl file or directory"
        ) from None
    ds = datasets.load_dataset(name, config, split=split)
    return [Row(f"{name}:{split} row {n}", dict(r)) for n, r in enumerate(ds, 1)]


def _rows(path: str | Path | None, hub: tuple[str, str | None], split: str) -> list[Row]:
    rows = read_rows(path, split) if path is not None else _hub_rows(*hub, split)
    if not rows:
        where = str(path) if path is not None else f"{hub[0]}:{split}"
        raise DataError(f"{where}: no rows")
    return rows


# ---------------------------------------------------------------- loaders
GSM8K_FIELDS = ("question", "answer")
MATH500_FIELDS = ("problem", "answer or a \\boxed{} in solution")


def load_gsm8k(path: str | Path | None, split: str = "train") -> list[Problem]:
    """GSM8K problems from local files (question/answer columns) or the HF hub."""
    out = []
    for i, row in enumerate(_rows(path, GSM8K_HUB, split)):
        question = row.field("question", GSM8K_FIELDS)
        solution = row.field("answer", GSM8K_FIELDS)
        try:
            gold = gsm8k_final_answer(solution)
        except DataError as exc:
            raise DataError(f"{row.where}: field 'answer': {exc}") from None
        out.append(Problem(f"gsm8k/{split}/{i}", question, gold, solution))
    return out


def load_math500(path: str | Path | None, split: str = "test") -> list[Problem]:
    """MATH-500 problems from local files (problem/answer/solution) or the HF hub."""
    out = []
    for i, row in enumerate(_rows(path, MATH500_HUB, split)):
        problem = row.field("problem", MATH500_FIELDS)
        solution = str(row.data.get("solution") or "")
        gold = row.data.get("answer")
        gold = str(gold) if gold not in (None, "") else last_boxed(solution)
        if not gold:
            raise DataError(
                f"{row.where}: no answer; expected field 'answer', or a \\boxed{{}} in "
                f"field 'solution'; found {sorted(row.data)}"
            )
        pid = str(row.data.get("unique_id") or f"math500/{split}/{i}")
        out.append(Problem(pid, problem, gold, solution))
    return out


def generate_arithmetic(
    n: int, split: str = "train", seed: int = 0, cfg: ArithmeticConfig | None = None
) -> list[Problem]:
    """Up to `n` distinct arithmetic problems of `split` ("train" or "test").

    A problem belongs to the test split iff a hash of its expression falls below
    `cfg.test_fraction`, so the splits never overlap for any sizes or seeds. The result
    is shorter than `n` when the split has fewer distinct problems.
    """
    cfg = cfg or ArithmeticConfig()
    if split not in ("train", "test"):
        raise DataError(f"arithmetic dataset: split {split!r} must be 'train' or 'test'")
    rng = random.Random(f"arith:{seed}:{split}")
    want_test = split == "test"
    k, ops, values = cfg.num_operands, cfg.ops, range(cfg.max_value + 1)
    space = len(values) ** k * len(ops) ** (k - 1)
    exprs: list[tuple[tuple[int, ...], tuple[str, ...]]] = []
    if space <= _ENUMERATE_LIMIT:
        for nums in itertools.product(values, repeat=k):
            for opseq in itertools.product(ops, repeat=k - 1):
                if _is_test(nums, opseq, cfg.test_fraction) == want_test:
                    exprs.append((nums, opseq))
        rng.shuffle(exprs)
        exprs = exprs[:n]
    else:  # too many to list: rejection-sample distinct ones
        seen: set[tuple[tuple[int, ...], tuple[str, ...]]] = set()
        for _ in range(50 * n):
            if len(exprs) >= n:
                break
            e = (
                tuple(rng.choice(values) for _ in range(k)),
                tuple(rng.choice(ops) for _ in range(k - 1)),
            )
            if e not in seen and _is_test(*e, cfg.test_fraction) == want_test:
                seen.add(e)
                exprs.append(e)
    return [_arith_problem(nums, opseq, split) for nums, opseq in exprs]


def _expr_text(nums: Sequence[int], opseq: Sequence[str]) -> str:
    parts = [str(nums[0])]
    for op, x in zip(opseq, nums[1:], strict=True):
        parts += [op, str(x)]
    return " ".join(parts)


def _is_test(nums: Sequence[int], opseq: Sequence[str], fraction: float) -> bool:
    h = hashlib.sha256(_expr_text(nums, opseq).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def _arith_problem(nums: Sequence[int], opseq: Sequence[str], split: str) -> Problem:
    """Worked solution: products first, then sums/differences left to right."""
    steps: list[str] = []
    terms: list[int] = [nums[0]]
    signs: list[str] = []
    for op, x in zip(opseq, nums[1:], strict=True):
        if op == "*":
            steps.append(f"{terms[-1]} * {x} = {terms[-1] * x}")
            terms[-1] *= x
        else:
            signs.append(op)
            terms.append(x)
    acc = terms[0]
    for op, x in zip(signs, terms[1:], strict=True):
        new = acc + x if op == "+" else acc - x
        steps.append(f"{acc} {op} {x} = {new}")
        acc = new
    expr = _expr_text(nums, opseq)
    solution = "\n".join([*steps, f"#### {acc}"]) if steps else f"{expr} = {acc}\n#### {acc}"
    return Problem(f"arith/{expr.replace(' ', '')}", f"What is {expr}?", str(acc), solution)


def _split_tokens(name: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", name.lower()))


def _one_file_split(cfg: DataConfig, split: str, problems: list[Problem]) -> list[Problem]:
    """Apply `data.file_split` when data.path is one file: without a rule, every split
    would read the same rows, and a run would train on its test set without a word."""
    path = Path(cfg.path) if cfg.path is not None else None
    if path is None or not path.is_file() or cfg.file_split == "as_is":
        return problems
    if cfg.file_split == "hash":
        if split not in ("train", "test"):
            raise DataError(f"data.file_split=hash: split {split!r} must be 'train' or 'test'")
        want_test = split == "test"
        return [
            p
            for p in problems
            if (_hash_fraction(p.question) < cfg.file_test_fraction) == want_test
        ]
    if split.lower() not in _split_tokens(path.stem):
        raise DataError(
            f"data.path {path} is one file and its name does not name split {split!r}: it "
            "would serve every split alike (train and test from the same rows). Point "
            "data.path at a directory of <split> files, or set data.file_split=hash (hold "
            "out data.file_test_fraction by a hash of each question) or data.file_split="
            "as_is (use this file for any split)"
        )
    return problems


def _hash_fraction(text: str) -> float:
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def load_problems(cfg: DataConfig, split: str | None = None) -> list[Problem]:
    """The configured dataset's problems of `split` (default `data.split`), limited."""
    split = split or cfg.split
    if cfg.dataset == "arithmetic":
        if cfg.path is not None:
            problems = load_gsm8k(cfg.path, split)  # saved arithmetic data is GSM8K-format
        else:
            problems = generate_arithmetic(cfg.num_generated, split, cfg.seed, cfg.arithmetic)
    elif cfg.dataset == "gsm8k":
        problems = load_gsm8k(cfg.path, split)
    else:
        problems = load_math500(cfg.path, split)
    problems = _one_file_split(cfg, split, problems)
    if cfg.limit is not None:
        problems = problems[: cfg.limit]
    if not problems:
        raise DataError(f"data.dataset={cfg.dataset} split {split!r}: no problems")
    return problems


def write_jsonl(problems: Sequence[Problem], path: str | Path) -> Path:
    """Save problems GSM8K-style (question, answer=solution) as jsonl."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for pr in problems:
            f.write(json.dumps({"question": pr.question, "answer": pr.solution}) + "\n")
    return p


# ---------------------------------------------------------------- prompts
def render_prompt(
    question: str,
    tokenizer: PreTrainedTokenizerBase,
    use_chat_template: bool,
    instruction: str = "",
) -> str:
    """The prompt text: the user turn through the tokenizer's chat template (with the
    assistant turn opened), or the bare question."""
    content = f"{question}\n{instruction}" if instruction else question
    if not use_chat_template:
        return content
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.use_chat_template=true but the tokenizer has no chat template; "
            "set data.use_chat_template=false or use a tokenizer with one"
        )
    messages = [{"role": "user", "content": content}]
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def build_prompts(
    problems: Sequence[Problem], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig
) -> PromptSet:
    """Render and tokenize; prompts over `data.max_prompt_tokens` are skipped and counted
    (or fail, with `data.overlong=error`)."""
    instruction = cfg.instruction
    if instruction is None:
        instruction = DEFAULT_INSTRUCTIONS[cfg.dataset]
    out = PromptSet(prompts=[])
    for pr in problems:
        text = render_prompt(pr.question, tokenizer, cfg.use_chat_template, instruction)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) > cfg.max_prompt_tokens:
            if cfg.overlong == "error":
                raise DataError(
                    f"prompt {pr.id} has {len(ids)} tokens > data.max_prompt_tokens="
                    f"{cfg.max_prompt_tokens} (raise it, or set data.overlong=skip)"
                )
            out.skipped_overlong += 1
            out.skipped_ids.append(pr.id)
            continue
        out.prompts.append(Prompt(pr.id, ids, pr.answer, text))
    if out.skipped_overlong:
        log.warning(
            "skipped %d of %d prompts longer than data.max_prompt_tokens=%d",
            out.skipped_overlong,
            len(problems),
            cfg.max_prompt_tokens,
        )
    if not out.prompts:
        raise DataError(
            f"all {len(problems)} prompts exceed data.max_prompt_tokens={cfg.max_prompt_tokens}"
        )
    return out


def iterate_prompts(
    prompts: Sequence[Prompt], seed: int = 0, shuffle: bool = True
) -> Iterator[tuple[int, Prompt]]:
    """(epoch, prompt) forever: each epoch is a fresh seeded permutation."""
    if not prompts:
        raise DataError("no prompts to iterate")
    for epoch in itertools.count():
        order = list(range(len(prompts)))
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(order)
        for i in order:
            yield epoch, prompts[i]
