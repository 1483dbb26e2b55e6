"""Fetch libvirt's RelaxNG schemas from Debian trixie-backports and cache them outside the repo.

The hook writes XML (`<iommufd>`, `<driver iommufd=…>`) that only libvirt >= 12.1/12.2 knows, and
Debian bookworm's libvirt 9.0 cannot validate it. Debian's `libvirt-common` from trixie-backports
ships libvirt 12.9's schemas, so this downloads that one package with a private apt configuration
(its own sources list, on the Debian mirror the machine's apt sources name, with lists and archive
cache under the cache directory; the machine's own apt sources and state stay untouched) and
unpacks it with `dpkg-deb -x`: about a second and ~2 MB the first time, then cached.

Run as a script to warm the cache (`python tests/launcher_hook/fetch_libvirt_schemas.py`);
tests call `ensure_schemas()` from a session fixture. `KUBEVIRT_IOMMUFD_LIBVIRT_SCHEMAS=<dir>`
points at schemas already on disk (a directory holding `domain.rng`) instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Run as a script, only this directory is on sys.path; tests/apt_sources.py is one up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from apt_sources import NoMirrorError, debian_mirror

SUITE = "trixie-backports"
PACKAGE = "libvirt-common"
# The oldest libvirt whose schema knows both the domain <iommufd> and <driver iommufd>.
MINIMUM = (12, 2)
OVERRIDE_ENV = "KUBEVIRT_IOMMUFD_LIBVIRT_SCHEMAS"
SCHEMAS_IN_PACKAGE = Path("usr/share/libvirt/schemas")
_DEB_VERSION = re.compile(r"^(?:\d+:)?(\d+)\.(\d+)")


class SchemaFetchError(RuntimeError):
    """The schemas could not be fetched; the message says what to do instead."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kubevirt-iommufd"


def ensure_schemas() -> Path:
    """The directory holding libvirt's `domain.rng` and the files it includes."""
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        found = Path(override)
        if not (found / "domain.rng").is_file():
            raise SchemaFetchError(f"{OVERRIDE_ENV}={override} holds no domain.rng")
        return found
    root = cache_root()
    cached = _cached(root)
    if cached is not None:
        return cached
    return _fetch(root)


def _cached(root: Path) -> Path | None:
    # A finished fetch is renamed into place last, so any directory found here is complete.
    found = sorted(root.glob("libvirt-schemas-*/domain.rng"))
    return found[-1].parent if found else None


def _fetch(root: Path) -> Path:
    try:
        mirror = debian_mirror()
    except NoMirrorError as error:
        raise SchemaFetchError(f"{error}, or set {OVERRIDE_ENV}") from None
    apt_dir = root / "apt"
    for sub in ("lists/partial", "archives/partial", "etc/preferences.d"):
        (apt_dir / sub).mkdir(parents=True, exist_ok=True)
    sources = apt_dir / "etc/sources.list"
    sources.write_text(
        f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {mirror} {SUITE} main\n"
    )
    options = [
        f"-oDir::Etc::sourcelist={sources}",
        "-oDir::Etc::sourceparts=-",
        f"-oDir::Etc::preferencesparts={apt_dir / 'etc/preferences.d'}",
        f"-oDir::Etc::preferences={apt_dir / 'etc/preferences'}",
        f"-oDir::State::Lists={apt_dir / 'lists'}",
        f"-oDir::Cache={apt_dir / 'cache'}",
        f"-oDir::Cache::archives={apt_dir / 'archives'}",
        "-oAcquire::Languages=none",
        "-oAPT::Get::List-Cleanup=0",
        # _apt cannot enter a root-owned cache under $HOME; the download is a signed index and
        # one .deb checked against it, so running it as the caller loses nothing.
        "-oAPT::Sandbox::User=root",
        "-qq",
    ]
    _run(["apt-get", *options, "update"], f"apt-get update ({SUITE} index from {mirror})")
    with tempfile.TemporaryDirectory(dir=root, prefix="download-") as scratch:
        _run(
            ["apt-get", *options, "download", f"{PACKAGE}/{SUITE}"],
            f"apt-get download {PACKAGE}/{SUITE}",
            cwd=scratch,
        )
        debs = list(Path(scratch).glob(f"{PACKAGE}_*.deb"))
        if len(debs) != 1:
            raise SchemaFetchError(f"apt-get download left {len(debs)} {PACKAGE} packages")
        version = debs[0].name.split("_")[1].replace("%3a", ":")
        _check_version(version)
        unpacked = Path(scratch) / "root"
        _run(["dpkg-deb", "-x", str(debs[0]), str(unpacked)], f"dpkg-deb -x {debs[0].name}")
        schemas = unpacked / SCHEMAS_IN_PACKAGE
        if not (schemas / "domain.rng").is_file():
            raise SchemaFetchError(f"{debs[0].name} holds no {SCHEMAS_IN_PACKAGE}/domain.rng")
        target = root / f"libvirt-schemas-{version.replace(':', '_')}"
        staged = Path(scratch) / "schemas"
        shutil.copytree(schemas, staged)
        try:
            staged.rename(target)
        except OSError:
            # Another test run finished the same fetch first; its copy is as good as ours.
            if not (target / "domain.rng").is_file():
                raise
    return target


def _check_version(version: str) -> None:
    match = _DEB_VERSION.match(version)
    if match is None or (int(match[1]), int(match[2])) < MINIMUM:
        raise SchemaFetchError(
            f"{SUITE} offers {PACKAGE} {version}, older than libvirt"
            f" {MINIMUM[0]}.{MINIMUM[1]}; its schema does not know iommufd"
        )


def _run(command: list[str], what: str, cwd: str | None = None) -> None:
    if shutil.which(command[0]) is None:
        raise SchemaFetchError(f"{what}: {command[0]} not found (needs a Debian system)")
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()[-2000:]
        raise SchemaFetchError(
            f"{what} failed (exit {done.returncode}): {detail}; check access to the mirror, or"
            f" set {OVERRIDE_ENV} to a directory with libvirt >= 12.2 schemas"
        )


if __name__ == "__main__":
    try:
        print(ensure_schemas())
    except SchemaFetchError as error:
        print(f"fetch_libvirt_schemas: {error}", file=sys.stderr)
        sys.exit(1)
