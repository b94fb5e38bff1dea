"""The one YAML reader and the bounded error messages every config, spec and plan goes
through (`areal_hex/config/base.py`)."""

from __future__ import annotations

import time

import pytest

from areal_hex.config.base import (
    MAX_YAML_NODES,
    SHOWN_CHARS,
    ConfigError,
    Section,
    build,
    load_yaml_text,
    shorten,
)


def _bomb(depth: int) -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, depth + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_anchors_within_reason_load() -> None:
    got = load_yaml_text("base: &b {x: 1}\nother: *b\nlist: [*b, *b]\n", "t")
    assert got == {"base": {"x": 1}, "other": {"x": 1}, "list": [{"x": 1}, {"x": 1}]}
    assert load_yaml_text("", "t") is None


@pytest.mark.parametrize("text", [_bomb(9), "a: &x [*x]\n"], ids=["billion_laughs", "recursive"])
def test_alias_bombs_are_refused_before_they_are_built(text: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=f"more than {MAX_YAML_NODES:,} values"):
        load_yaml_text(text, "bomb.yaml")
    assert time.perf_counter() - t0 < 2


def test_malformed_yaml_is_one_line_with_its_position() -> None:
    with pytest.raises(ConfigError) as exc:
        load_yaml_text("name: x\nzones: [a, b\nnode_groups: {\n", "c.yaml")
    msg = str(exc.value)
    assert msg.startswith("c.yaml: not valid YAML: line 3, column 12: ")
    assert "\n" not in msg


class _Small(Section):
    n: int = 1
    rate: float = 1.0


def test_validation_errors_quote_a_bounded_piece_of_the_value() -> None:
    data = load_yaml_text(_bomb(5), "b.yaml") | {"rate": float("inf")}
    with pytest.raises(ConfigError) as exc:
        build(_Small, data, "b.yaml")
    msg = str(exc.value)
    assert "l5: unknown key" in msg and "rate: Input should be a finite number" in msg
    assert len(msg) < 8 * (SHOWN_CHARS + 80)
    assert len(shorten("x" * 10_000)) <= SHOWN_CHARS
