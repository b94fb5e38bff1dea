from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_hex.config import DataConfig
from areal_hex.config.data import ArithmeticConfig
from areal_hex.data import (
    DataError,
    build_prompts,
    generate_arithmetic,
    gsm8k_final_answer,
    iterate_prompts,
    last_boxed,
    load_gsm8k,
    load_math500,
    load_problems,
    render_prompt,
    write_jsonl,
)
from areal_hex.models import build_tokenizer

GSM_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A car costs 1,200 and a bike 34.", "answer": "1200 + 34 = 1234\n#### 1,234"},
]
MATH_ROWS = [
    {
        "problem": "Half of one?",
        "answer": "\\frac{1}{2}",
        "solution": "It is \\boxed{\\frac{1}{2}}.",
        "unique_id": "test/algebra/1.json",
    },
    {"problem": "Two plus two?", "answer": "", "solution": "So \\boxed{4}."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _write(rows: list[dict], path: Path) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_gsm8k_local(tmp_path: Path, suffix: str) -> None:
    probs = load_gsm8k(_write(GSM_ROWS, tmp_path / f"train{suffix}"), "train")
    assert [p.answer for p in probs] == ["7", "1234"]
    assert probs[0].question.startswith("Tom has 3")
    assert probs[1].solution.endswith("#### 1,234")
    assert probs[0].id == "gsm8k/train/0"


def test_gsm8k_directory_picks_split(tmp_path: Path) -> None:
    d = tmp_path / "main"
    d.mkdir()
    _write(GSM_ROWS, d / "train-00000-of-00001.parquet")
    _write(GSM_ROWS[:1], d / "test-00000-of-00001.parquet")
    assert len(load_gsm8k(tmp_path, "train")) == 2
    assert len(load_gsm8k(tmp_path, "test")) == 1
    with pytest.raises(DataError, match="validation"):
        load_gsm8k(tmp_path, "validation")


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_math500_local(tmp_path: Path, suffix: str) -> None:
    probs = load_math500(_write(MATH_ROWS, tmp_path / f"test{suffix}"), "test")
    assert [p.answer for p in probs] == ["\\frac{1}{2}", "4"]  # 2nd: from the solution's box
    assert probs[0].id == "test/algebra/1.json" and probs[1].id == "math500/test/1"


def test_loader_errors(tmp_path: Path) -> None:
    bad = _write([{"q": "x", "a": "y"}], tmp_path / "train.jsonl")
    with pytest.raises(
        DataError,
        match=r"train.jsonl:1: no field 'question'; expected fields \['question', 'answer'\], "
        r"found \['a', 'q'\]",
    ):
        load_gsm8k(bad, "train")
    no_final = _write([{"question": "x", "answer": "42"}], tmp_path / "t.jsonl")
    with pytest.raises(DataError, match="t.jsonl:1: field 'answer': .*####"):
        load_gsm8k(no_final, "train")
    (tmp_path / "broken.jsonl").write_text('{"question": 1}\nnot json\n')
    with pytest.raises(DataError, match="broken.jsonl:2"):
        load_gsm8k(tmp_path / "broken.jsonl", "train")
    with pytest.raises(DataError, match="no such file"):
        load_gsm8k(tmp_path / "missing.parquet", "train")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_gsm8k(_write([], tmp_path / "x.csv"), "train")


GOOD = {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_a_bad_row_after_good_ones_names_file_row_and_field(tmp_path: Path, suffix) -> None:
    """Not only the first row is checked: the third row (line 3 of a jsonl) without its
    question, or with an empty one, names its file, row and the field expected."""
    where = "train.jsonl:3" if suffix == ".jsonl" else "train.parquet row 3"
    rows = [GOOD, GOOD, {"answer": "#### 2", "question": None}]
    path = _write(rows, tmp_path / f"train{suffix}")
    with pytest.raises(DataError, match=rf"{where}: an empty \(None\) field 'question'; exp"):
        load_gsm8k(path, "train")
    path = _write([GOOD, {"question": "x", "answer": "#### 1"}, {"answer": "#### 2"}], path)
    if suffix == ".jsonl":
        with pytest.raises(DataError, match=rf"{where}: no field 'question'; expected"):
            load_gsm8k(path, "train")
    (tmp_path / "m").mkdir()
    _write([{"problem": "p", "answer": "1"}, {"answer": "2"}], tmp_path / "m" / "test.jsonl")
    with pytest.raises(DataError, match=r"m/test.jsonl:2: no field 'problem'; expected"):
        load_math500(tmp_path / "m", "test")
    (tmp_path / "arr.json").write_text('[{"question": "x", "answer": "#### 1"}, {"question": []}]')
    with pytest.raises(DataError, match=r"arr.json row 2: field 'question' is a list"):
        load_gsm8k(tmp_path / "arr.json", "train")


def test_hub_without_datasets_is_a_clear_error() -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="needs the `datasets` package"):
            load_gsm8k(None, "train")
    else:
        pytest.skip("`datasets` is installed; the hub path would try the network")


def test_answers() -> None:
    assert gsm8k_final_answer("a\n#### 1,000") == "1000"
    assert last_boxed("x \\boxed{\\frac{a}{b}} y") == "\\frac{a}{b}"
    assert last_boxed("\\boxed{1") is None
    assert last_boxed("none") is None


def test_arithmetic_deterministic_disjoint_and_correct() -> None:
    a = generate_arithmetic(50, "train", seed=3)
    assert a == generate_arithmetic(50, "train", seed=3)
    assert a != generate_arithmetic(50, "train", seed=4)
    train = generate_arithmetic(10_000, "train", seed=0)
    test = generate_arithmetic(10_000, "test", seed=0)
    # 2 single-digit operands: 100 problems, split by hash, never overlapping.
    assert len(train) + len(test) == 100 and len(test) >= 1
    assert not {p.question for p in train} & {p.question for p in test}
    for p in train + test:
        x, y = (int(t) for t in p.question.removeprefix("What is ").rstrip("?").split(" + "))
        assert p.answer == str(x + y) and p.solution.endswith(f"#### {x + y}")
    # Different seeds draw different orders of the same split membership.
    other = generate_arithmetic(10_000, "test", seed=9)
    assert {p.id for p in other} == {p.id for p in test}


def test_arithmetic_knobs() -> None:
    cfg = ArithmeticConfig(num_operands=4, max_value=50, ops="+-*")
    probs = generate_arithmetic(200, "train", seed=1, cfg=cfg)
    assert len(probs) == 200 and len({p.id for p in probs}) == 200
    for p in probs:
        expr = p.question.removeprefix("What is ").rstrip("?")
        assert len(expr.split()) == 7
        assert int(p.answer) == eval(expr)  # standard precedence
        assert max(int(t) for t in expr.split()[::2]) <= 50
    test = generate_arithmetic(200, "test", seed=1, cfg=cfg)
    assert not {p.id for p in probs} & {p.id for p in test}
    with pytest.raises(ValueError, match="operators"):
        ArithmeticConfig(ops="/")


def test_arithmetic_jsonl_roundtrip(tmp_path: Path) -> None:
    probs = generate_arithmetic(20, "train")
    path = write_jsonl(probs, tmp_path / "train.jsonl")
    again = load_problems(DataConfig(dataset="arithmetic", path=str(path)))
    assert [(p.question, p.answer) for p in again] == [(p.question, p.answer) for p in probs]


def test_templating(tokenizer) -> None:
    text = render_prompt("What is 3 + 4?", tokenizer, use_chat_template=True)
    assert text == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt("Q?", tokenizer, False, "Think.") == "Q?\nThink."
    probs = generate_arithmetic(5, "train")
    ps = build_prompts(probs, tokenizer, DataConfig())
    assert len(ps.prompts) == 5 and ps.skipped_overlong == 0
    p = ps.prompts[0]
    assert tokenizer.decode(p.input_ids) == p.text and p.answer == probs[0].answer
    plain = build_prompts(probs, tokenizer, DataConfig(use_chat_template=False))
    assert tokenizer.decode(plain.prompts[0].input_ids) == probs[0].question


def test_overlong_skip_and_error(tokenizer) -> None:
    probs = generate_arithmetic(3, "train")
    long = [*probs[:2], probs[2].__class__("long", "What is " + "1 + " * 40 + "1?", "41")]
    ps = build_prompts(long, tokenizer, DataConfig(max_prompt_tokens=60))
    assert ps.skipped_overlong == 1 and ps.skipped_ids == ["long"] and len(ps.prompts) == 2
    with pytest.raises(DataError, match="prompt long has .* > data.max_prompt_tokens=60"):
        build_prompts(long, tokenizer, DataConfig(max_prompt_tokens=60, overlong="error"))
    with pytest.raises(DataError, match="all 3 prompts exceed"):
        build_prompts(long, tokenizer, DataConfig(max_prompt_tokens=5))


def test_iterate_prompts_cycles_epochs(tokenizer) -> None:
    ps = build_prompts(generate_arithmetic(4, "train"), tokenizer, DataConfig()).prompts
    it = iterate_prompts(ps, seed=1)
    first = [next(it) for _ in range(12)]
    assert [e for e, _ in first] == [0] * 4 + [1] * 4 + [2] * 4
    for e in range(3):
        assert sorted(p.id for ep, p in first if ep == e) == sorted(p.id for p in ps)
    again = iterate_prompts(ps, seed=1)
    assert [next(again)[1].id for _ in range(12)] == [p.id for _, p in first]
