from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hostdev.documents import DocumentError, read_document
from kubevirt_iommufd.cli import main


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
    text = refusal(path, content)
    assert text.startswith(message.format(path=path))
    assert "\n" not in text


def refusal(path: Path, content: bytes) -> str:
    """What reading `content` from `path` as a config is refused with."""
    path.write_bytes(content)
    with pytest.raises(DocumentError) as caught:
        read_document(path, "config")
    return str(caught.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DocumentError, match=r"cannot read reservations .*nope.yaml: No such file"):
        read_document(tmp_path / "nope.yaml", "reservations")


# What each hostile file does to the decoders on their own: RecursionError, ValueError (Python's
# 4,300-digit limit), KeyError, AttributeError, or a value whose walk never ends.
HOSTILE: list[tuple[str, bytes, str]] = [
    ("deep.json", b"[" * 100_000, "{path}: nested deeper than 64 levels"),
    ("deep-closed.json", b"[" * 900 + b"]" * 900, "{path}: nested deeper than 64 levels"),
    ("deep.yaml", b"a: " + b"[" * 2000 + b"]" * 2000, "{path} at line 1, column 67: nested deeper"),
    (
        "deep-block.yaml",
        b"".join(b"  " * i + b"a:\n" for i in range(100)) + b"  " * 100 + b"x\n",
        "{path} at line 64, column 127: nested deeper than 64 levels",
    ),
    (
        "huge-int.json",
        b'{"a": ' + b"7" * 5000 + b"}",
        "{path}: a number of 5000 digits (7777",
    ),
    ("huge-negative.json", b"[-" + b"7" * 5000 + b"]", "{path}: a number of 5000 digits"),
    ("huge-int.yaml", b"a: " + b"7" * 5000, "{path} at line 1, column 4: a number of 5000"),
    (
        "huge-hex.yaml",
        b"a: 0x" + b"f" * 5000,
        "{path} at line 1, column 4: a number of 5002",
    ),
    (
        "sexagesimal.yaml",
        b"a: " + b":".join([b"59"] * 100_000),
        "{path} at line 1, column 4: a number of 299999 digits",
    ),
    ("alias.yaml", b"a: &x [1]\nb: *x\n", "{path} at line 2, column 4: YAML aliases (*name) are"),
    (
        "billion-laughs.yaml",
        b"a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
        + b"".join(
            b"%c: &%c [%s]\n" % (name, name, b", ".join([b"*%c" % (name - 1)] * 9))
            for name in range(ord("b"), ord("k"))
        ),
        "{path} at line 2, column 8: YAML aliases (*name) are not supported here",
    ),
    ("merge-key.yaml", b"a: &x {b: 1}\nc:\n  <<: *x\n", "{path} at line 3, column 7: YAML aliases"),
    (
        "bad-date.yaml",
        b"a: 2001-02-30\n",
        "{path} at line 1, column 4: cannot read '2001-02-30'",
    ),
    (
        "bool-tag.yaml",
        b"a: !!bool maybe\n",
        "{path} at line 1, column 4: cannot read 'maybe' as",
    ),
    ("int-tag.yaml", b"a: !!int abc\n", "{path} at line 1, column 4: cannot read 'abc' as !!int"),
    ("float-tag.yaml", b"a: !!float x\n", "{path} at line 1, column 4: cannot read 'x' as !!float"),
    ("stamp-tag.yaml", b"a: !!timestamp x\n", "{path} at line 1, column 4: cannot read 'x' as"),
    ("surrogate.json", b'{"a": "\\ud800"}', "{path}: a string holds '\\ud800', which is not a"),
    ("not-utf8.json", b'{"a": "\xff"}', "cannot read config {path}: not UTF-8 (invalid start byte"),
    ("control.yaml", b"a: \x07\n", "{path} is not valid YAML: unacceptable character #x0007"),
    (
        "bom.json",
        b"\xef\xbb\xbf{}",
        "{path} is not valid JSON at line 1, column 1: Unexpected",
    ),
    (
        "duplicate.yaml",
        b"resources: []\nresources: []\n",
        "{path} at line 2, column 1: duplicate key 'resources' (first at line 1, column 1)",
    ),
    ("two-docs.yaml", b"a: 1\n---\nb: 2\n", "{path} is not valid YAML at line 2, column 1"),
    ("large.yaml", b"a: " + b"x" * (1 << 20), "{path} is larger than 1 MiB"),
    ("directory.yaml", b"", "cannot read config {path}: Is a directory"),
]


@pytest.mark.parametrize(("name", "content", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_files_are_one_line_errors(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    path = tmp_path / name
    if name.startswith("directory"):
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(DocumentError) as caught:
        read_document(path, "config")
    text = str(caught.value)
    expected = message.format(path=path)
    assert text.startswith(expected if expected.startswith("cannot") else f"config {expected}")
    assert "\n" not in text and len(text) < 300


# A key given twice in one mapping: the decoders keep the last and drop the first, silently.
DUPLICATES: list[tuple[str, str, str]] = [
    (
        "top.yaml",
        "resources:\n  - resourceName: a/b\ndeviceMode: both\nresources: []\n",
        "at line 4, column 1: duplicate key 'resources' (first at line 1, column 1)",
    ),
    (
        "nested.yaml",
        "devices:\n  - pciAddress: 0000:3b:00.0\n    driver: vfio-pci\n    driver: nvidia\n",
        "at line 4, column 5: duplicate key 'driver' (first at line 3, column 5)",
    ),
    (
        "flow.yaml",
        "iommufd: {enabled: true, slots: 4,\n  enabled: false}\n",
        "at line 2, column 3: duplicate key 'enabled' (first at line 1, column 11)",
    ),
    (
        "quoted.yaml",
        'a: 1\n"a": 2\n',
        "at line 2, column 1: duplicate key 'a' (first at line 1, column 1)",
    ),
    (
        "equal.yaml",
        "1: a\n0x1: b\n",
        "at line 2, column 1: duplicate key 1 (first at line 1, column 1)",
    ),
    (
        "set.yaml",
        "!!set\n? a\n? a\n",
        "at line 3, column 3: duplicate key 'a' (first at line 2, column 3)",
    ),
    (
        "top.json",
        '{"resources": [],\n "deviceMode": "both",\n "resources": [{"resourceName": "a/b"}]}',
        "at line 3: duplicate key 'resources' (first at line 1)",
    ),
    (
        "nested.json",
        '{"devices": [\n  {"pciAddress": "0000:3b:00.0",\n   "driver": "x"\n   ,\n'
        '   "driver"\n   :\n "y"}]}',
        "at line 5: duplicate key 'driver' (first at line 3)",
    ),
    ("escaped.json", '{"a": 1, "\\u0061": 2}', "at line 1: duplicate key 'a' (first at line 1)"),
]


@pytest.mark.parametrize(("name", "content", "message"), DUPLICATES, ids=[d[0] for d in DUPLICATES])
def test_a_key_given_twice_is_refused_naming_both_places(
    tmp_path: Path, name: str, content: str, message: str
) -> None:
    path = tmp_path / name
    assert refusal(path, content.encode()) == f"config {path} {message}: give each key once"


def test_keys_that_only_look_alike_are_not_duplicates(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("a: 1\nb: {a: 2}\nc: [{a: 3}, {a: 4}]\n'1': x\n1: y\n")
    (tmp_path / "a.json").write_text('{"a": 1, "b": {"a": 2}, "c": [{"a": 3}, {"a": 4}], "A": 5}')
    (tmp_path / "merge.yaml").write_text("a: {<<: {b: 1, c: 2}, b: 3}\n")
    assert read_document(tmp_path / "a.yaml", "config") == {
        "a": 1,
        "b": {"a": 2},
        "c": [{"a": 3}, {"a": 4}],
        "1": "x",
        1: "y",
    }
    assert read_document(tmp_path / "a.json", "config") == {
        "a": 1,
        "b": {"a": 2},
        "c": [{"a": 3}, {"a": 4}],
        "A": 5,
    }
    # A merge key's values give way to the mapping's own: YAML's rule, not a duplicate.
    assert read_document(tmp_path / "merge.yaml", "config") == {"a": {"b": 3, "c": 2}}


def test_the_limits_leave_every_real_document_alone(tmp_path: Path) -> None:
    (tmp_path / "ok.json").write_text("[" * 63 + "7" * 100 + "]" * 63)
    (tmp_path / "ok.yaml").write_text(
        "a: &x [0x1F, 1_000, -12, 2001-02-03, !!binary aGk=]\n" + "b: " + "[" * 62 + "]" * 62
    )
    assert read_document(tmp_path / "ok.json", "config") is not None
    data = read_document(tmp_path / "ok.yaml", "config")
    assert isinstance(data, dict) and data["a"][:3] == [31, 1000, -12]


# Each command that reads a config file, with its documented exit status for a bad one.
COMMANDS = {
    "bind": (["bind", "--from-config", "{file}", "--root", "{root}"], 2, "reservations {file}"),
    "plugin": (["plugin", "--config", "{file}", "--root", "{root}"], 2, "config {file}"),
    "webhook": (
        ["webhook", "--config", "{file}", "--cert", "{root}/c.pem", "--key", "{root}/k.pem"],
        1,
        "config file {file}",
    ),
}
COMMAND_FILES = [
    h
    for h in HOSTILE
    if h[0].split(".")[0] in {"deep", "huge-int", "billion-laughs", "bad-date", "duplicate"}
]


def argv_for(command: str, file: Path, root: Path) -> tuple[list[str], int, str]:
    template, code, names = COMMANDS[command]
    argv = [a.format(file=file, root=root) for a in template]
    return argv, code, names.format(file=file)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(
    ("name", "content", "message"), COMMAND_FILES, ids=[h[0] for h in COMMAND_FILES]
)
def test_each_command_says_one_line_and_exits_with_its_code(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    name: str,
    content: bytes,
    message: str,
) -> None:
    file = tmp_path / name
    file.write_bytes(content)
    argv, code, names = argv_for(command, file, tmp_path)
    assert main(argv) == code
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith(f"kubevirt-iommufd {command}: ")
    assert names in line
    assert message.format(path="").split(": ", 1)[-1][:20] in line


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_as_a_process_there_is_no_traceback(tmp_path: Path, command: str) -> None:
    file = tmp_path / "deep.json"
    file.write_text('{"a": ' + "[" * 100_000)
    argv, code, names = argv_for(command, file, tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "kubevirt_iommufd", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (code, "")
    assert done.stderr.splitlines() == [
        f"kubevirt-iommufd {command}: {'error: ' if command != 'plugin' else ''}{names}:"
        " nested deeper than 64 levels; no setting is nested that deep"
    ]
