"""Configuration files as the components read them: YAML, or JSON when the name ends in `.json`,
decoded safely, with any problem told in one line naming the file (and, where the decoder knows
it, the line and column).

Whatever the file holds, reading it ends in a value or a `DocumentError`, never in another
exception, and costs bounded time and memory:
- at most 1 MiB is read (a node's config or reservations list is a few KiB);
- nesting deeper than 64 levels is refused (the decoders would recurse until RecursionError,
  and so would anything walking the value);
- numbers have at most 100 digits (Python refuses to convert more than 4,300, and no setting
  needs more than a few);
- YAML aliases (`*name`, and so `<<: *name` merges) are refused: each alias is one more
  reference to a shared node, so a few lines of them make a value whose walk or printout never
  ends ("billion laughs");
- a value YAML's own tags cannot construct (`!!int abc`, `2001-02-30`), and text that is not
  UTF-8 or (in JSON) not Unicode at all, are errors like any other;
- a key given twice in one mapping (a second `resources:`) is refused with both places: the
  decoders would keep the second and drop the first without a word.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from json.decoder import JSONObject  # type: ignore[attr-defined]  # stable since 2.6, untyped
from json.scanner import py_make_scanner  # type: ignore[attr-defined]
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.error import Mark
from yaml.events import Event
from yaml.nodes import MappingNode, Node, ScalarNode

from hostdev.errors import HostdevError

MAX_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_NUMBER_DIGITS = 100


class DocumentError(HostdevError, ValueError):
    """A file that cannot be read or does not parse."""


def read_document(path: Path, what: str) -> object:
    """The decoded document; `what` names the file in messages ("config", "reservations")."""
    text = _read_text(path, what)
    if path.suffix == ".json":
        data = _decode_json(text, path, what)
    else:
        data = _decode_yaml(text, path, what)
    problem = _shape_problem(data)
    if problem is not None:
        raise DocumentError(f"{what} {path}: {problem}")
    return data


def _read_text(path: Path, what: str) -> str:
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_BYTES + 1)
    except OSError as error:
        raise DocumentError(f"cannot read {what} {path}: {error.strerror or error}") from error
    if len(raw) > MAX_BYTES:
        raise DocumentError(
            f"{what} {path} is larger than {MAX_BYTES >> 20} MiB; is it the right file?"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DocumentError(
            f"cannot read {what} {path}: not UTF-8 ({error.reason} at byte {error.start})"
        ) from error


class _NumberTooLong(ValueError):
    pass


def _json_int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > MAX_NUMBER_DIGITS:
        raise _NumberTooLong(_too_long(digits))
    return int(text)


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object, with the lines of both."""

    def __init__(self, key: str, first_line: int, line: int) -> None:
        super().__init__(key)
        self.key, self.first_line, self.line = key, first_line, line


class _JsonDecoder(json.JSONDecoder):
    """json's decoder with the number limit, refusing a key given twice in one object with the
    lines of both. Only the pure-Python scanner lets objects be built here (about ten times
    slower than the C one, a fraction of a second for the largest file read)."""

    def __init__(self) -> None:
        super().__init__(parse_int=_json_int)
        self.parse_object = self._parse_object
        self.scan_once = py_make_scanner(self)

    @staticmethod
    def _parse_object(
        text_and_end: tuple[str, int],
        strict: bool,
        scan_once: Any,
        object_hook: Any,
        object_pairs_hook: Any,
        memo: Any = None,
    ) -> tuple[dict[str, object], int]:
        # JSONObject scans each value once, right after its key's colon: where values start
        # tells where their keys are.
        starts: list[int] = []

        def scan_value(text: str, start: int) -> Any:
            starts.append(start)
            return scan_once(text, start)

        pairs, end = JSONObject(text_and_end, strict, scan_value, None, list, memo)
        built: dict[str, object] = {}
        first: dict[str, int] = {}
        for (key, value), start in zip(pairs, starts, strict=True):
            if key in first:
                text = text_and_end[0]
                raise _DuplicateKey(key, _key_line(text, first[key]), _key_line(text, start))
            first[key] = start
            built[key] = value
        return built, end


def _key_line(text: str, value_start: int) -> int:
    """The line of the key whose value starts at `value_start` (its closing quote's: a JSON
    string holds no newline)."""
    colon = text.rindex(":", 0, value_start)
    return text.count("\n", 0, len(text[:colon].rstrip())) + 1


def _decode_json(text: str, path: Path, what: str) -> object:
    try:
        return json.loads(text, cls=_JsonDecoder)
    except _NumberTooLong as error:
        raise DocumentError(f"{what} {path}: {error}") from None
    except _DuplicateKey as error:
        raise DocumentError(
            f"{what} {path} at line {error.line}:"
            f" {_duplicate(error.key, f'line {error.first_line}')}"
        ) from None
    except json.JSONDecodeError as error:
        raise DocumentError(
            f"{what} {path} is not valid JSON at line {error.lineno}, column {error.colno}:"
            f" {error.msg}"
        ) from error
    except RecursionError:
        raise DocumentError(f"{what} {path}: {_too_deep()}") from None


def _decode_yaml(text: str, path: Path, what: str) -> object:
    try:
        # The loader checks every character as it is made.
        loader = _BoundedLoader(text)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except _Refused as error:
        raise DocumentError(f"{what} {path}{_where(error)}: {error.problem}") from None
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise DocumentError(f"{what} {path} is not valid YAML{_where(error)}: {problem}") from error


class _Refused(ConstructorError):
    """Valid YAML that this reader will not take (an alias, deep nesting, a huge number, a value
    its tag cannot hold)."""


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader with the limits above, and every value its tags cannot construct told as
    a YAML error at the value's place."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self.check_event(yaml.AliasEvent):
            raise _Refused(
                None,
                None,
                "YAML aliases (*name) are not supported here; write the value out",
                self._next_mark(),
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(None, None, _too_deep(), self._next_mark())
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def _next_mark(self) -> Mark | None:
        event: Event = self.peek_event()  # type: ignore[no-untyped-call]
        # The pure-Python parser (this loader's) makes yaml.error marks.
        return event.start_mark if isinstance(event.start_mark, Mark) else None

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        first: dict[object, Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` values give way to the mapping's own keys: YAML's rule
            key = self.construct_object(key_node, deep)
            if not isinstance(key, Hashable):
                continue  # refused as such by the constructor
            mark = first.setdefault(key, key_node.start_mark)
            if mark is not key_node.start_mark:
                where = f"line {mark.line + 1}, column {mark.column + 1}"
                raise _Refused(None, None, _duplicate(key, where), key_node.start_mark)
        return super().construct_mapping(node, deep)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as error:
            # PyYAML's constructors let Python's own errors out for values their tag's pattern
            # did not rule out (`!!bool maybe`, the date 2001-02-30); only a ValueError says why.
            shown = repr(node.value)[:40] if isinstance(node, ScalarNode) else "this value"
            tag = str(node.tag).replace("tag:yaml.org,2002:", "!!")
            why = f" ({error})" if type(error) is ValueError else ""
            raise _Refused(
                None, None, f"cannot read {shown} as {tag}{why}", node.start_mark
            ) from None


def _construct_int(loader: _BoundedLoader, node: ScalarNode) -> int:
    text = str(node.value).replace("_", "").lstrip("+-")
    if len(text) > MAX_NUMBER_DIGITS:
        raise _Refused(None, None, _too_long(text), node.start_mark)
    return loader.construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def _duplicate(key: object, first: str) -> str:
    return f"duplicate key {repr(key)[:40]} (first at {first}): give each key once"


def _where(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _too_deep() -> str:
    return f"nested deeper than {MAX_DEPTH} levels; no setting is nested that deep"


def _too_long(digits: str) -> str:
    return (
        f"a number of {len(digits)} digits ({digits[:12]}…); numbers here have at most"
        f" {MAX_NUMBER_DIGITS}"
    )


def _shape_problem(data: object) -> str | None:
    """Nesting too deep, or a string no UTF-8 file can hold (JSON's lone surrogate escapes,
    which would break any UTF-8 log or terminal they reach)."""
    pending: list[tuple[object, int]] = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_DEPTH:
            return _too_deep()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as error:
                return f"a string holds {error.object[error.start]!a}, which is not a character"
        elif isinstance(value, dict | list | tuple | set | frozenset):
            items = (
                [x for pair in value.items() for x in pair] if isinstance(value, dict) else value
            )
            pending.extend((item, depth + 1) for item in items)
    return None
