"""Reading a spec's YAML (a job spec, a chaos scenario, a `--set` value) with errors a user
can act on: the file and the byte that is not UTF-8, a mapping key given twice (PyYAML keeps
the last one silently), an integer no 64-bit field holds, each with its field path and line.
`-` as the file reads standard input. Otherwise the values are `yaml.safe_load`'s.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

STDIN = "<stdin>"  # the source named in errors for a spec read from `-`
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_INT_TAG = "tag:yaml.org,2002:int"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_MAX_INT_DIGITS = 40  # a YAML integer longer than this is refused before it is built


class SpecError(ValueError):
    """A job spec that cannot be used; ``errors`` holds one line per problem."""

    def __init__(self, source: str, errors: list[str]):
        self.source = source
        self.errors = errors
        super().__init__(f"{source}: " + "; ".join(errors))


def read_text(path: str | Path) -> tuple[str, str]:
    """(source, text) of the file `path`, `-` being standard input; SpecError when it
    cannot be read or is not UTF-8 (naming the byte, its offset and its line)."""
    if str(path) == "-":
        source = STDIN
        stream = getattr(sys.stdin, "buffer", None)
        try:
            raw = stream.read() if stream is not None else sys.stdin.read().encode()
        except OSError as e:
            raise SpecError(source, [f"cannot read: {e.strerror or e}"]) from None
    else:
        source = str(path)
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise SpecError(source, [f"cannot read: {e.strerror or e}"]) from None
    try:
        return source, raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise SpecError(
            source,
            [
                f"not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} (line {line}, "
                f"column {column}); save the file as UTF-8"
            ],
        ) from None


def read_yaml(path: str | Path) -> Any:
    """The YAML document in the file `path` (`-`: standard input), checked as `load_yaml`."""
    source, text = read_text(path)
    return load_yaml(text, source)


def load_yaml(text: str, source: str, prefix: str = "") -> Any:
    """`yaml.safe_load(text)`, refusing what it would accept silently: a key given twice in
    a mapping, an integer of more than 40 digits. Errors name the field path (after
    `prefix`, for a `--set` value) and the line; SpecError(source, ...)."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as e:
            raise SpecError(source, [f"not valid YAML: {e}"]) from None
        if node is None:
            return None
        problems: list[str] = []
        _check_node(node, [prefix] if prefix else [], problems, set())
        if problems:
            raise SpecError(source, problems)
        try:
            return loader.construct_document(node)
        except yaml.YAMLError as e:
            raise SpecError(source, [f"not valid YAML: {e}"]) from None
        except ValueError as e:  # what a constructor raises on a value it cannot build
            raise SpecError(source, [f"not valid YAML: {e}"]) from None
    finally:
        loader.dispose()


def _where(path: list[str]) -> str:
    return ".".join(path) or "the document"


def _check_node(node: yaml.Node, path: list[str], problems: list[str], seen: set[int]) -> None:
    if id(node) in seen:  # an alias of a node already checked (or a recursive one)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if key.tag == _MERGE_TAG:  # `<<: *base`: its keys may be overridden here
                _check_node(value, path, problems, seen)
                continue
            name = key.value if isinstance(key, yaml.ScalarNode) else "?"
            line = key.start_mark.line + 1
            if isinstance(key, yaml.ScalarNode):
                if (key.tag, key.value) in first:
                    problems.append(
                        f"{_where([*path, name])}: duplicate key at line {line} (first at line "
                        f"{first[key.tag, key.value]}); YAML would keep only the last value"
                    )
                else:
                    first[key.tag, key.value] = line
            _check_node(value, [*path, name], problems, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_node(item, [*path, str(i)], problems, seen)
    elif node.tag == _INT_TAG:
        digits = sum(c.isdigit() for c in node.value)
        if digits > _MAX_INT_DIGITS:
            problems.append(
                f"{_where(path)}: a {digits}-digit integer at line {node.start_mark.line + 1}"
                f" is too large (integers must fit in 64 bits, at most {INT64_MAX})"
            )


def int_text(n: int) -> str:
    """An integer as an error message shows it: its digits, or how many there are."""
    if n.bit_length() <= 133:  # at most 40 digits
        return str(n)
    return f"an integer of about {int(n.bit_length() * 0.30103) + 1} digits"


def oversized_ints(data: Any, path: str = "") -> list[tuple[str, str]]:
    """(field path, error line) for every integer in `data` (bools aside) outside int64:
    no field holds one, and torch, numpy and JSON consumers overflow or lose it."""
    found: list[tuple[str, str]] = []
    if isinstance(data, bool):
        return found
    if isinstance(data, int):
        if not INT64_MIN <= data <= INT64_MAX:
            where = path or "the document"
            found.append(
                (
                    where,
                    f"{where}: {int_text(data)} is too large (integers must fit in 64 bits, "
                    f"at most {INT64_MAX})",
                )
            )
    elif isinstance(data, dict):
        for key, value in data.items():
            found += oversized_ints(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list | tuple):
        for i, value in enumerate(data):
            found += oversized_ints(value, f"{path}.{i}" if path else str(i))
    return found
