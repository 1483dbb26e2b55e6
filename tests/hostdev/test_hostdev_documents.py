from __future__ import annotations

from pathlib import Path

import pytest

from hostdev.documents import DocumentError, read_document


def test_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("devices:\n  - match: '10de:2330'\n")
    (tmp_path / "a.json").write_text('{"devices": []}')
    assert read_document(tmp_path / "a.yaml", "config") == {"devices": [{"match": "10de:2330"}]}
    assert read_document(tmp_path / "a.json", "config") == {"devices": []}


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.yaml", b"a: [\n", "config {path} is not valid YAML at line 2, column 1: expected"),
        ("bad.json", b'{"a": }', "config {path} is not valid JSON at line 1, column 7: Expecting"),
        ("latin.yaml", b"a: \xe9\n", "cannot read config {path}: not UTF-8"),
        ("tags.yaml", b"a: !!python/object:os.system ls\n", "config {path} is not valid YAML"),
    ],
    ids=["yaml", "json", "not-utf8", "unsafe-tag"],
)
def test_problems_are_one_line_naming_file_and_place(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DocumentError) as caught:
        read_document(path, "config")
    assert str(caught.value).startswith(message.format(path=path))
    assert "\n" not in str(caught.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match=r"cannot read reservations .*nope.yaml: No such file"):
        read_document(tmp_path / "nope.yaml", "reservations")
