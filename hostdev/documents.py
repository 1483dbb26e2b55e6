"""Configuration files as the components read them: YAML, or JSON when the name ends in `.json`,
decoded safely, with any problem told in one line naming the file, line and column."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from hostdev.errors import HostdevError


class DocumentError(HostdevError, ValueError):
    """A file that cannot be read or does not parse."""


def read_document(path: Path, what: str) -> object:
    """The decoded document; `what` names the file in messages ("config", "reservations")."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DocumentError(f"cannot read {what} {path}: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise DocumentError(f"cannot read {what} {path}: not UTF-8 ({error.reason})") from error
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise DocumentError(
                f"{what} {path} is not valid JSON at line {error.lineno}, column {error.colno}:"
                f" {error.msg}"
            ) from error
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise DocumentError(f"{what} {path} is not valid YAML{where}: {problem}") from error
