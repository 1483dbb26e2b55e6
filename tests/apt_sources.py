"""The machine's own apt sources: which Debian mirror it uses, and every host they name.

The system test, the libvirt 12.9 chroot and the schema fetch all download from Debian. They take
the mirror from the machine's apt configuration, so the repository never names one: a CI machine
behind its own mirror or proxy just works, and `tests/test_no_mirror_hosts.py` keeps it that way
(it uses `apt_source_hosts`). Both the one-line format (`sources.list`, `*.list`) and deb822
(`*.sources`) are read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ETC_APT = Path("/etc/apt")
OS_RELEASE = Path("/etc/os-release")
# The release this project's tooling targets when the machine does not say (docs/system-test.md).
DEFAULT_CODENAME = "bookworm"
_LIST_LINE = re.compile(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)")
_URL_HOST = re.compile(r"\b[a-z][a-z0-9+.-]*://(?:[^@/\s]*@)?(\[[^\]]+\]|[^/\s:\]]+)", re.I)
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})


class NoMirrorError(RuntimeError):
    """No apt source of the machine points at a Debian mirror for its release."""


@dataclass(frozen=True)
class AptSource:
    """One enabled `deb` entry: its URI and suites."""

    uri: str
    suites: tuple[str, ...]


def source_files(etc_apt: Path = ETC_APT) -> list[Path]:
    """`sources.list` and the `*.list` / `*.sources` files of `sources.list.d`, in apt's order."""
    files = [etc_apt / "sources.list"]
    parts = etc_apt / "sources.list.d"
    if parts.is_dir():
        files += sorted(p for p in parts.iterdir() if p.suffix in (".list", ".sources"))
    return [p for p in files if p.is_file()]


def parse_sources(path: Path, text: str) -> list[AptSource]:
    """The enabled `deb` entries of one file (deb822 for `*.sources`, one-line otherwise)."""
    if path.suffix != ".sources":
        found = []
        for line in text.splitlines():
            if match := _LIST_LINE.match(line.split("#", 1)[0].strip()):
                found.append(AptSource(match[1], (match[2],)))
        return found
    sources = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            # Continuation lines (an inline Signed-By key) and comments hold no field.
            if line[:1] in ("#", " ", "\t") or ":" not in line:
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in fields.get("types", "").split():
            continue
        suites = tuple(fields.get("suites", "").split())
        sources += [AptSource(uri, suites) for uri in fields.get("uris", "").split()]
    return sources


def read_apt_sources(etc_apt: Path = ETC_APT) -> list[AptSource]:
    sources = []
    for path in source_files(etc_apt):
        sources += parse_sources(path, path.read_text(errors="replace"))
    return sources


def read_codename(os_release: Path = OS_RELEASE) -> str:
    try:
        text = os_release.read_text()
    except OSError:
        return DEFAULT_CODENAME
    match = re.search(r"^VERSION_CODENAME=\"?([\w-]+)\"?$", text, re.M)
    return match[1] if match else DEFAULT_CODENAME


def debian_mirror(etc_apt: Path = ETC_APT, os_release: Path = OS_RELEASE) -> str:
    """The URI of the first enabled `deb` source for the machine's release (`bookworm`, not
    `bookworm-security` or a third-party suite): the Debian mirror apt already uses."""
    codename = read_codename(os_release)
    for source in read_apt_sources(etc_apt):
        if codename in source.suites:
            return source.uri.rstrip("/")
    raise NoMirrorError(
        f"no enabled `deb` source for {codename} in {etc_apt}/sources.list or"
        f" {etc_apt}/sources.list.d: add one for your Debian mirror"
    )


def apt_source_hosts(etc_apt: Path = ETC_APT) -> set[str]:
    """Every host named in the machine's apt sources (URIs and comments alike), lower case;
    loopback names and names without a dot are left out (they are not mirrors anyone could
    mistake for the project's)."""
    hosts = set()
    for path in source_files(etc_apt):
        for match in _URL_HOST.finditer(path.read_text(errors="replace")):
            host = match[1].lower().rstrip(".")
            if host not in _LOCAL_HOSTS and "." in host:
                hosts.add(host)
    return hosts
