"""No tracked file names a package mirror: the tooling reads it from the machine's apt sources.

A host written into the repository breaks every machine that sits behind another mirror or a
proxy, and leaks where the development machines fetch from. Forbidden: each host this machine's
apt sources name (URIs and comments), and every Debian mirror host (`*.debian.org`,
`*.debian.net`). Also here: the reader of the apt sources that the system test, the libvirt
chroot and the schema fetch share (tests/apt_sources.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from apt_sources import NoMirrorError, apt_source_hosts, debian_mirror, read_apt_sources

REPO = Path(__file__).resolve().parents[1]
# Written so that this file does not match itself (also the sample names below).
DEBIAN_HOSTS = r"(?:[a-z0-9-]+\.)*debian\.(?:org|net)"
SAMPLE_DEBIAN_HOSTS = ("ftp.de.debian" + ".org", "deb.debian" + ".net")


def forbidden_pattern(hosts: set[str]) -> re.Pattern[str]:
    names = [DEBIAN_HOSTS, *(re.escape(host) for host in sorted(hosts))]
    return re.compile(r"(?<![\w.-])(?:" + "|".join(names) + r")(?![\w-])", re.I)


def find_hosts(files: list[Path], pattern: re.Pattern[str], base: Path = REPO) -> list[str]:
    """`path:line: host` for each mention (paths relative to `base`)."""
    found = []
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except (IsADirectoryError, FileNotFoundError):
            continue  # a submodule, or deleted but not yet committed
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(base)}:{number}: {m[0]}" for m in pattern.finditer(line)]
    return found


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True
    ).stdout
    return [REPO / name for name in listed.decode().split("\0") if name]


def test_no_tracked_file_names_a_mirror_host() -> None:
    files = tracked_files()
    assert len(files) > 100, f"only {len(files)} tracked files: the listing is wrong"
    found = find_hosts(files, forbidden_pattern(apt_source_hosts()))
    assert not found, (
        "mirror host names in the repository (read the mirror with"
        " tests/apt_sources.py's debian_mirror() instead):\n" + "\n".join(found)
    )


def write_apt(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


DEB822 = """\
Types: deb
# mirror.example.net/snapshot comments count too: http://old.example.org/archive
URIs: http://mirror.example.com/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 Comment: not a field
 -----END PGP PUBLIC KEY BLOCK-----

Types: deb
URIs: http://security.example.com/debian-security
Suites: bookworm-security
Components: main
"""


def test_the_mirror_is_the_deb_source_for_the_machines_release(tmp_path: Path) -> None:
    etc_apt = write_apt(
        tmp_path / "apt",
        {
            "sources.list": "deb [arch=amd64] https://vendor.example.io/apt cloud-bookworm main\n",
            "sources.list.d/debian.sources": DEB822,
            "sources.list.d/old.list": "# deb http://commented.example.org/debian bookworm main\n",
        },
    )
    release = tmp_path / "os-release"
    release.write_text('PRETTY_NAME="Debian"\nVERSION_CODENAME=bookworm\n')
    assert debian_mirror(etc_apt, release) == "http://mirror.example.com/debian"
    release.write_text("VERSION_CODENAME=bookworm-security\n")
    assert debian_mirror(etc_apt, release) == "http://security.example.com/debian-security"
    assert [s.uri for s in read_apt_sources(etc_apt)] == [
        "https://vendor.example.io/apt",
        "http://mirror.example.com/debian/",
        "http://security.example.com/debian-security",
    ]


def test_one_line_sources_and_disabled_stanzas(tmp_path: Path) -> None:
    etc_apt = write_apt(
        tmp_path / "apt",
        {
            "sources.list": "deb-src http://src.example.com/debian trixie main\n"
            "deb [ signed-by=/k.gpg ] http://list.example.com/debian trixie main # the one\n",
            "sources.list.d/a.sources": "Enabled: no\nTypes: deb\nURIs: http://off.example.com/d\n"
            "Suites: trixie\n",
            "sources.list.d/ignored.save": "deb http://backup.example.com/debian trixie main\n",
        },
    )
    release = tmp_path / "os-release"
    release.write_text("VERSION_CODENAME=trixie\n")
    assert debian_mirror(etc_apt, release) == "http://list.example.com/debian"
    release.write_text("VERSION_CODENAME=forky\n")
    with pytest.raises(NoMirrorError, match="no enabled `deb` source for forky"):
        debian_mirror(etc_apt, release)


def test_hosts_of_the_apt_sources_are_found_in_files(tmp_path: Path) -> None:
    etc_apt = write_apt(
        tmp_path / "apt",
        {
            "sources.list.d/debian.sources": DEB822,
            "sources.list": "deb http://localhost:3142/debian bookworm main\n"
            "deb http://cacher/debian bookworm main\n",
        },
    )
    hosts = apt_source_hosts(etc_apt)
    assert hosts == {"mirror.example.com", "old.example.org", "security.example.com"}
    pattern = forbidden_pattern(hosts)
    lines = {
        "URIs: http://Mirror.Example.com/debian": "Mirror.Example.com",
        "see {} or {}".format(*SAMPLE_DEBIAN_HOSTS): SAMPLE_DEBIAN_HOSTS[0],
        "not.mirror.example.com nor mirror.example.community": None,
        "/usr/share/keyrings/debian-archive-keyring.gpg": None,
    }
    for line, first in lines.items():
        match = pattern.search(line)
        assert (match[0] if match else None) == first, line
    assert pattern.findall("see {} or {}".format(*SAMPLE_DEBIAN_HOSTS)) == list(SAMPLE_DEBIAN_HOSTS)


def test_find_hosts_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "setup.md"
    doc.write_text("one\nfetch from http://security.example.com/x\n")
    pattern = forbidden_pattern({"security.example.com"})
    found = find_hosts([doc, tmp_path / "docs", tmp_path / "gone"], pattern, tmp_path)
    assert found == ["docs/setup.md:2: security.example.com"]
