"""Config plumbing: strict pydantic sections, YAML loading, `key.sub=value` overrides.

Every section forbids unknown keys, so a typo fails at load time with the field's dotted
path and what was expected, before any process starts.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound=BaseModel)

# A config, cluster spec or plan of any size the project handles has a few thousand values;
# a YAML document past this many (aliases expanded) is refused before it is built.
MAX_YAML_NODES = 1_000_000
SHOWN_CHARS = 200  # the most of one value an error message quotes
SHOWN_ERRORS = 20  # the most problems one message lists


def _short_repr() -> reprlib.Repr:
    """A repr that stops after a few items and levels, so quoting a value costs little
    however large it is."""
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 8, 8, 8, 8
    r.maxstring = r.maxother = r.maxlong = SHOWN_CHARS
    return r


_REPR = _short_repr()


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    # inf and nan are never a setting: a budget, rate or size of inf is a typo or an attack
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def refuse_renamed(data: Any, renamed: dict[str, str]) -> Any:
    """For a `model_validator(mode="before")`: a key an earlier version wrote under
    another name is refused with its new name, rather than as an unknown key (the file
    is an old one, not a typo). Returns `data` unchanged otherwise."""
    if isinstance(data, dict):
        for old, new in renamed.items():
            if old in data:
                raise ValueError(f"key {old!r} is now {new!r}: rename it in the file")
    return data


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field path and the expectation."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (["a", "b", "c"], value); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY.SUB=VALUE (e.g. trainer.lr=1e-5)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty key component in {key!r}")
    value = load_yaml_text(raw, f"override {text!r}") if raw.strip() else ""
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with each `key.sub=value` override applied in order."""
    out = _deep_copy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {text!r}: {where} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def format_validation_error(exc: ValidationError, source: str, what: str = "config") -> str:
    """One line per problem: `source: field.path: message (got value)`, under `invalid
    {what} ({source}):` (what the file is: a config, a box, a plan, ...)."""
    lines = [f"invalid {what} ({source}):"]
    errors = exc.errors()
    if len(errors) > SHOWN_ERRORS:
        lines[0] += f" {len(errors)} problems, the first {SHOWN_ERRORS}:"
    for err in errors[:SHOWN_ERRORS]:
        path = shorten(".".join(str(p) for p in err["loc"]) or "<root>")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "value_error":  # a validator's own sentence, without the label
            msg = msg.removeprefix("Value error, ")
        got = err.get("input")
        shown = "" if isinstance(got, dict) else f" (got {shorten(_REPR.repr(got))})"
        lines.append(f"  {path}: {msg}{shown}")
    return "\n".join(lines)


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` cut to `limit` characters: an error message quotes what it got, never all of
    a value someone made large (a YAML alias bomb expands to gigabytes when printed)."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}... ({len(text):,} chars)"


def _expanded_size(node: yaml.Node, limit: int) -> int:
    """Nodes of the document with every alias spelled out, counting stops past `limit`.
    Shared subtrees are counted once per reference (what a consumer walking the data
    visits); a node that contains itself counts as past the limit."""
    sizes: dict[int, int] = {}
    busy: set[int] = set()

    def size(n: yaml.Node) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in busy:
            return limit + 1  # recursive alias
        busy.add(key)
        total = 1
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [c for pair in n.value for c in pair]
        else:
            children = []
        for c in children:
            total += size(c)
            if total > limit:
                break
        busy.discard(key)
        sizes[key] = min(total, limit + 1)
        return sizes[key]

    return size(node)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """`line L, column C: problem` from PyYAML's several-line report."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "not valid YAML"
        if mark is not None:
            return f"line {mark.line + 1}, column {mark.column + 1}: {what}"
        return str(what)
    return shorten(str(exc).replace("\n", " "))


def load_yaml_text(text: str, source: str) -> Any:
    """The one YAML reader of the project: safe tags only, and a document refused before
    it is built when, with its aliases spelled out, it has more than `MAX_YAML_NODES`
    nodes (a billion-laughs alias bomb is a few hundred bytes that expand to 10^9)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, MAX_YAML_NODES) > MAX_YAML_NODES:
            raise ConfigError(
                f"{source}: the document has more than {MAX_YAML_NODES:,} values with its "
                "aliases (&anchor / *alias) expanded; refused"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read: {shorten(str(exc))}") from None
    data = load_yaml_text(text, str(p)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(data).__name__}")
    return data


def build(model: type[T], data: dict[str, Any], source: str, what: str = "config") -> T:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, what)) from None


def dump_yaml(model: BaseModel) -> str:
    return yaml.safe_dump(model.model_dump(mode="json"), sort_keys=False)
