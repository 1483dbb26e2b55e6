#!/usr/bin/env python3
"""The hook's golden outputs against a real libvirt 12.9: its parser and its QEMU command line.

Run as root on a Debian bookworm machine: ``./dev.sh libvirt-check`` (or
``.venv/bin/python tests/system/libvirt12.py``). Recipe: ../shared/system/README.md §6. It

1. builds, once, a Debian trixie chroot (``debootstrap --variant=minbase`` from the mirror the
   machine already uses; debootstrap is installed with apt-get when missing) with
   ``libvirt-clients libvirt-daemon libvirt-daemon-driver-qemu qemu-system-x86 libxml2-utils``
   from trixie-backports, and caches it OUTSIDE the repository, keyed by the recipe:
   ``/var/cache/kubevirt-iommufd/libvirt-trixie/<key>/`` (built under a lock in a ``build-*``
   directory, renamed into place when complete, reused afterwards);
2. in a private mount namespace (``unshare --mount --propagation private``; every mount goes
   away with it, also on a failure or a kill) gives the chroot ``proc``, a small tmpfs ``/dev``
   (``null zero random urandom``, ``kvm`` mode 666 so libvirt keeps its QEMU capability cache
   instead of re-probing QEMU for ~70 s on every call, a placeholder ``vfio/vfio``), a tmpfs
   ``/sys`` holding an empty ``kernel/iommu_groups/0/devices`` (else "VFIO PCI device assignment
   is not supported by the host") and a tmpfs ``/run`` with the files to check bind-mounted;
3. for each golden output ``tests/launcher_hook/data/golden/*.xml`` (or the files named):
   ``virsh -c test:///default "define --validate FILE"`` and ``virt-xml-validate FILE domain``
   on a copy without the ``type='pci'`` KubeVirt writes on a hostdev's source ``<address>``
   (libvirt's schema rejects it), and ``virsh -c 'qemu:///embed?root=DIR' domxml-to-native
   qemu-argv FILE`` on a copy that also runs the chroot's QEMU instead of KubeVirt's RHEL
   emulator and machine type, has no ``ethernet`` interface (it needs ``/dev/net/tun``) and
   has each ``<interface type='hostdev'>`` as the ``<hostdev>`` libvirt makes of it at start
   (domxml-to-native cannot build that interface: it turns it into a tap).
   DIR lives in the chroot and is kept between runs (the capability cache). The golden files
   themselves are never touched;
4. checks the argv against the hook's ``<metadata>`` decision record: each hostdev marked
   ``backend="iommufd"`` is a vfio-pci ``-device`` with ``"iommufd":"iommufd0"`` next to an
   ``-object {"qom-type":"iommufd","id":"iommufd0"}``; each marked ``legacy`` has
   ``"host":"<BDF>"`` and no ``iommufd``; mdev hostdevs never use iommufd, nor do PCI devices
   the record does not list (``<interface type='hostdev'>``) unless the domain enables iommufd
   domain-wide. An iommufd ``-object`` no device uses is reported as a note, not a failure;
5. prints a report table and exits non-zero on any failure.

Options: ``--prepare`` only builds the chroot; ``--cache DIR`` moves the cache (also
``KUBEVIRT_IOMMUFD_CACHE``); ``--argv`` prints each QEMU command line; files to check instead of
the golden outputs may be given as arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lxml import etree

# The machine's apt sources are read by tests/apt_sources.py, one directory up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from run import apt_install, installed_version, locked

from apt_sources import NoMirrorError, debian_mirror

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GOLDEN = REPO / "tests/launcher_hook/data/golden"
DEFAULT_CACHE = Path(os.environ.get("KUBEVIRT_IOMMUFD_CACHE", "/var/cache/kubevirt-iommufd"))

SUITE = "trixie"
BACKPORTS = "trixie-backports"
PACKAGES = (
    "libvirt-clients",
    "libvirt-daemon",
    "libvirt-daemon-driver-qemu",
    "qemu-system-x86",
    "libxml2-utils",
)
# Bump when the way the chroot is built changes: a new key builds a new chroot.
RECIPE_VERSION = "1"
READY = ".kubevirt-iommufd-ready.json"
MINIMUM_LIBVIRT = (12, 2)  # the oldest libvirt with both <iommufd> and <driver iommufd>

# Paths inside the chroot.
EMBED_ROOT = "/var/lib/kubevirt-iommufd-embed"  # kept between runs: QEMU capability cache
CHECK_DIR = "/run/kubevirt-iommufd-check"  # the files to check, bind-mounted per run
QEMU_BINARY = "/usr/bin/qemu-system-x86_64"
MACHINE = "q35"

DECISION_NS = "https://kubevirt-iommufd.io/xmlns/decision/v1"
IOMMUFD_ID = "iommufd0"
CHROOT_ENV = {
    "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LC_ALL": "C.UTF-8",
    "LANG": "C.UTF-8",
}

# Character devices of the chroot's /dev: name -> (major, minor, mode).
DEVICES = {
    "null": (1, 3, 0o666),
    "zero": (1, 5, 0o666),
    "full": (1, 7, 0o666),
    "random": (1, 8, 0o666),
    "urandom": (1, 9, 0o666),
    "tty": (5, 0, 0o666),
    "kvm": (10, 232, 0o666),
    "vfio/vfio": (10, 196, 0o666),
}


def log(message: str) -> None:
    print(f"==> {message}", file=sys.stderr, flush=True)


def run_logged(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    log("$ " + shlex.join(argv))
    return subprocess.run(argv, check=True, text=True, **kwargs)


# --------------------------------------------------------------------------- the chroot


def recipe_key() -> str:
    recipe = json.dumps([RECIPE_VERSION, SUITE, BACKPORTS, PACKAGES]).encode()
    return f"r{RECIPE_VERSION}-{hashlib.sha256(recipe).hexdigest()[:12]}"


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` in this mount namespace."""
    prefix = str(path.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return found


def remove_tree(path: Path) -> None:
    """rm -rf that never crosses into a mount (a chroot's /proc or /sys)."""
    if mounts := mounts_under(path):
        raise RuntimeError(f"{path} still has mounts {mounts}; not removing it")
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=True)


def ensure_chroot(parent: Path) -> tuple[Path, dict[str, Any], bool]:
    """The cached chroot, building it when missing; also its record and whether it was built now."""
    target = parent / recipe_key()
    ready = target / READY
    with locked(parent / "build.lock"):
        if ready.is_file():
            return target, json.loads(ready.read_text()), False
        if os.geteuid() != 0:
            sys.exit("libvirt12: run as root to build the libvirt 12.9 chroot")
        for stale in [*parent.glob("build-*"), target]:
            if stale.exists():
                log(f"removing {stale}, left by an interrupted build")
                try:
                    remove_tree(stale)
                except RuntimeError as error:
                    sys.exit(f"libvirt12: {error}")
        try:
            mirror = debian_mirror()
        except NoMirrorError as error:
            sys.exit(f"libvirt12: {error}")
        if not installed_version("debootstrap"):
            apt_install(["debootstrap"])
        started = time.monotonic()
        build = Path(tempfile.mkdtemp(prefix="build-", dir=parent))
        build.chmod(0o755)  # the chroot's /: apt's _apt user and libvirt-qemu must traverse it
        try:
            # debootstrap and the postinst scripts mount things inside the target: do all of it in
            # a private mount namespace, so nothing can stay mounted under the cache.
            run_logged(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "--",
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--inside-build",
                    str(build),
                    mirror,
                ]
            )
            record = chroot_record(build)
            record["build_seconds"] = round(time.monotonic() - started, 1)
            (build / READY).write_text(json.dumps(record, indent=2) + "\n")
            build.rename(target)
        except BaseException:
            with contextlib.suppress(Exception):
                remove_tree(build)
            raise
        log(f"chroot: built {target} in {record['build_seconds']:.0f} s")
        return target, record, True


def chroot_record(root: Path) -> dict[str, Any]:
    versions = subprocess.run(
        ["chroot", str(root), "dpkg-query", "-W", "-f=${Package}\t${Version}\n", *PACKAGES],
        capture_output=True,
        text=True,
        check=True,
        env=CHROOT_ENV,
    ).stdout
    packages = dict(line.split("\t", 1) for line in versions.splitlines() if "\t" in line)
    libvirt = packages.get("libvirt-daemon", "0")
    major, minor = (int(part) for part in libvirt.split(":")[-1].split(".")[:2])
    if (major, minor) < MINIMUM_LIBVIRT:
        raise RuntimeError(f"the chroot got libvirt {libvirt}, older than {MINIMUM_LIBVIRT}")
    return {"key": recipe_key(), "packages": packages}


def inside_build(root: Path, mirror: str) -> None:
    """In the private mount namespace: debootstrap, trixie-backports, the packages."""
    run_logged(["debootstrap", "--variant=minbase", SUITE, str(root), mirror])
    (root / "etc/apt/sources.list.d/trixie-backports.sources").write_text(
        "Types: deb\n"
        f"URIs: {mirror}\n"
        f"Suites: {BACKPORTS}\n"
        "Components: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    # No service may start from a package's postinst in the chroot.
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    resolv = root / "etc/resolv.conf"
    if not resolv.exists():
        resolv.unlink(missing_ok=True)  # a dangling symlink
        shutil.copyfile("/etc/resolv.conf", resolv)
    env = dict(CHROOT_ENV, DEBIAN_FRONTEND="noninteractive")
    with chroot_mounts(root):
        run_logged(["chroot", str(root), "apt-get", "update", "-qq"], env=env)
        run_logged(
            [
                "chroot",
                str(root),
                "apt-get",
                "install",
                "-y",
                "-qq",
                "--no-install-recommends",
                "-t",
                BACKPORTS,
                *PACKAGES,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        run_logged(["chroot", str(root), "apt-get", "clean"], env=env)
    (root / EMBED_ROOT.lstrip("/")).mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def chroot_mounts(root: Path, check_dir: Path | None = None) -> Iterator[None]:
    """proc, a tmpfs /dev, a tmpfs /sys with one empty IOMMU group, a tmpfs /run; undone after.

    Only ever called in a private mount namespace, which also drops them all when it ends.
    """
    mounted: list[Path] = []

    def mount(*argv: str) -> None:
        subprocess.run(["mount", *argv], check=True)
        mounted.append(Path(argv[-1]))

    try:
        mount("-t", "proc", "-o", "nosuid,nodev,noexec", "proc", str(root / "proc"))
        dev = root / "dev"
        mount("-t", "tmpfs", "-o", "nosuid,mode=0755,size=1m", "kubevirt-iommufd-dev", str(dev))
        for name, (major, minor, mode) in DEVICES.items():
            node = dev / name
            node.parent.mkdir(exist_ok=True)
            os.mknod(node, stat.S_IFCHR | mode, os.makedev(major, minor))
            node.chmod(mode)  # mknod honours the umask
        for name, target in {
            "fd": "/proc/self/fd",
            "stdin": "/proc/self/fd/0",
            "stdout": "/proc/self/fd/1",
            "stderr": "/proc/self/fd/2",
        }.items():
            (dev / name).symlink_to(target)
        (dev / "shm").mkdir()
        (dev / "pts").mkdir()
        mount(
            "-t", "devpts", "-o", "newinstance,ptmxmode=0666,mode=0620", "devpts", str(dev / "pts")
        )
        (dev / "ptmx").symlink_to("pts/ptmx")
        sys_dir = root / "sys"
        mount("-t", "tmpfs", "-o", "nosuid,nodev,noexec,mode=0755,size=1m", "kv-sys", str(sys_dir))
        (sys_dir / "kernel/iommu_groups/0/devices").mkdir(parents=True)
        run_dir = root / "run"
        mount("-t", "tmpfs", "-o", "nosuid,nodev,mode=0755,size=16m", "kv-run", str(run_dir))
        if check_dir is not None:
            inside = root / CHECK_DIR.lstrip("/")
            inside.mkdir(parents=True)
            mount("--bind", str(check_dir), str(inside))
        yield
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", "--lazy", str(point)], check=False)


# --------------------------------------------------------------------------- the copies


def schema_copy(domain: etree._Element) -> etree._Element:
    """KubeVirt's type='pci' on a hostdev's source <address>: libvirt's schema rejects it."""
    copy = etree.fromstring(etree.tostring(domain))
    for address in copy.iterfind("devices/hostdev/source/address[@type='pci']"):
        del address.attrib["type"]
    return copy


def argv_copy(domain: etree._Element) -> tuple[etree._Element, list[str]]:
    """The schema copy, runnable by the chroot's QEMU: also says what it changed."""
    copy = schema_copy(domain)
    changes = []
    for emulator in copy.iterfind("devices/emulator"):
        if emulator.text != QEMU_BINARY:
            changes.append(f"emulator {emulator.text} -> {QEMU_BINARY}")
            emulator.text = QEMU_BINARY
    for os_type in copy.iterfind("os/type[@machine]"):
        if os_type.get("machine") != MACHINE:
            changes.append(f"machine {os_type.get('machine')} -> {MACHINE}")
            os_type.set("machine", MACHINE)
    for interface in copy.iterfind("devices/interface[@type='ethernet']"):
        changes.append(f"dropped <interface type='ethernet'> {alias_of(interface)}")
        parent = interface.getparent()
        assert parent is not None
        parent.remove(interface)
    for interface in copy.iterfind("devices/interface[@type='hostdev']"):
        changes.append(f"<interface type='hostdev'> {alias_of(interface)} -> <hostdev>")
        interface.addnext(interface_as_hostdev(interface))
        parent = interface.getparent()
        assert parent is not None
        parent.remove(interface)
    return copy, changes


def alias_of(element: etree._Element) -> str:
    alias = element.find("alias")
    return str(alias.get("name")) if alias is not None else "?"


def interface_as_hostdev(interface: etree._Element) -> etree._Element:
    """The <hostdev> libvirt makes of an <interface type='hostdev'> when it starts the domain.

    domxml-to-native cannot take the interface itself: it makes it a tap (/dev/net/tun), then
    fails on the missing NIC model ("argument key 'driver' must not have null value"), and
    libvirt 12.9 aborts ("free(): invalid pointer") when a model is given.
    """
    hostdev = etree.Element(
        "hostdev", mode="subsystem", type="pci", managed=interface.get("managed", "no")
    )
    for tag in ("driver", "source", "alias", "address"):
        child = interface.find(tag)
        if child is None:
            continue
        if tag == "driver":  # an interface's driver name/queues do not apply to a hostdev
            if child.get("iommufd") is not None:
                etree.SubElement(hostdev, "driver", iommufd=str(child.get("iommufd")))
            continue
        hostdev.append(copy_element(child))
    for address in hostdev.iterfind("source/address[@type='pci']"):
        del address.attrib["type"]
    return hostdev


def copy_element(element: etree._Element) -> etree._Element:
    return etree.fromstring(etree.tostring(element))


# --------------------------------------------------------------------------- in the namespace


@dataclass
class Step:
    ok: bool
    seconds: float
    output: str


def chroot_call(root: Path, *argv: str) -> Step:
    started = time.monotonic()
    result = subprocess.run(
        ["chroot", str(root), *argv],
        capture_output=True,
        text=True,
        errors="replace",
        env=CHROOT_ENV,
        check=False,
    )
    output = (result.stdout + result.stderr).strip()
    return Step(result.returncode == 0, time.monotonic() - started, output)


def inside_check(root: Path, work: Path) -> None:
    """In the private mount namespace: run libvirt on every copy listed in work/files.json."""
    names: list[str] = json.loads((work / "files.json").read_text())
    results: dict[str, dict[str, Any]] = {}
    with chroot_mounts(root, work):
        for name in names:
            schema_file = f"{CHECK_DIR}/schema/{name}"
            argv_file = f"{CHECK_DIR}/argv/{name}"
            steps = {
                "define": chroot_call(
                    root, "virsh", "-q", "-c", "test:///default", f"define --validate {schema_file}"
                ),
                "validate": chroot_call(root, "virt-xml-validate", schema_file, "domain"),
                "argv": chroot_call(
                    root,
                    "virsh",
                    "-q",
                    "-c",
                    f"qemu:///embed?root={EMBED_ROOT}",
                    "domxml-to-native",
                    "qemu-argv",
                    argv_file,
                ),
            }
            results[name] = {key: asdict(step) for key, step in steps.items()}
    (work / "results.json").write_text(json.dumps(results))


# --------------------------------------------------------------------------- the argv


def parse_argv(command_line: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The JSON ``-device`` and ``-object`` arguments of libvirt's QEMU command line."""
    words = shlex.split(command_line)
    devices: list[dict[str, Any]] = []
    objects: list[dict[str, Any]] = []
    for option, value in itertools.pairwise(words):
        if option in ("-device", "-object") and value.startswith("{"):
            (devices if option == "-device" else objects).append(json.loads(value))
    return devices, objects


VFIO_DRIVERS = ("vfio-pci", "vfio-pci-nohotplug")  # -nohotplug: an mdev with ramfb


@dataclass
class ArgvCheck:
    problems: list[str] = field(default_factory=list)
    iommufd: int = 0
    legacy: int = 0
    mdev: int = 0
    other: int = 0
    iommufd_object: bool = False
    notes: list[str] = field(default_factory=list)


def check_record(record: etree._Element, device: dict[str, Any] | None, result: ArgvCheck) -> None:
    """One <hostdev> of the decision record against its -device."""
    alias, bdf, backend = record.get("alias"), record.get("bdf"), record.get("backend")
    if device is None:
        result.problems.append(f"{alias} ({bdf}, {backend} in the record): no vfio-pci -device")
    elif backend == "iommufd":
        result.iommufd += 1
        if device.get("iommufd") != IOMMUFD_ID:
            result.problems.append(
                f"{alias} ({bdf}) is iommufd in the record, but its -device is {json.dumps(device)}"
            )
        if not result.iommufd_object:
            result.problems.append(
                f"{alias} ({bdf}) is iommufd in the record, but there is no -object"
                f' {{"qom-type":"iommufd","id":"{IOMMUFD_ID}"}}'
            )
    elif backend == "legacy":
        result.legacy += 1
        if device.get("host") != bdf or "iommufd" in device:
            result.problems.append(
                f"{alias} ({bdf}) is legacy in the record, but its -device is {json.dumps(device)}"
            )
    else:
        result.problems.append(f"{alias} ({bdf}): backend {backend!r} in the record")


def check_argv(domain: etree._Element, command_line: str) -> ArgvCheck:
    """The QEMU argv against the hook's decision record (in the original domain)."""
    devices, objects = parse_argv(command_line)
    result = ArgvCheck()
    result.iommufd_object = any(
        o.get("qom-type") == "iommufd" and o.get("id") == IOMMUFD_ID for o in objects
    )
    vfio = [d for d in devices if d.get("driver") in VFIO_DRIVERS]
    by_id = {d.get("id"): d for d in vfio}
    by_host = {d.get("host"): d for d in vfio if "host" in d}
    listed: set[int] = set()
    for record in domain.iterfind(f"metadata/{{{DECISION_NS}}}decision/{{{DECISION_NS}}}hostdev"):
        device = by_id.get(record.get("alias")) or by_host.get(record.get("bdf"))
        if device is not None:
            listed.add(id(device))
        check_record(record, device, result)
    mdevs = {alias.get("name") for alias in domain.iterfind("devices/hostdev[@type='mdev']/alias")}
    domain_wide = domain.find("iommufd[@enabled='yes']") is not None
    for device in vfio:
        if id(device) in listed:
            continue
        if device.get("id") in mdevs or "/mdev/" in str(device.get("sysfsdev", "")):
            result.mdev += 1
            if "iommufd" in device:
                result.problems.append(f"an mdev hostdev uses iommufd: {json.dumps(device)}")
            continue
        # Not in the record (an <interface type='hostdev'>): libvirt applies only the domain-wide
        # default to it, and without one it must stay legacy.
        result.other += 1
        if "iommufd" in device and not domain_wide:
            result.problems.append(
                "a vfio-pci device the record does not list uses iommufd without a domain-wide"
                f" <iommufd enabled='yes'>: {json.dumps(device)}"
            )
    if result.iommufd_object and not any("iommufd" in d for d in vfio):
        # Not a failure: libvirt follows the domain's <iommufd enabled='yes'>; at a real start
        # QEMU then needs /dev/iommu (or the fdgroup's fd) although no device uses it.
        result.notes.append(
            f'-object {{"qom-type":"iommufd","id":"{IOMMUFD_ID}"}} although no device uses it'
            " (the domain keeps <iommufd enabled='yes'>)"
        )
    if len(mdevs) != result.mdev:
        result.problems.append(
            f"{len(mdevs)} mdev hostdevs in the domain, {result.mdev} in the argv"
        )
    return result


# --------------------------------------------------------------------------- report


@dataclass
class FileResult:
    name: str
    steps: dict[str, Step]
    changes: list[str]
    check: ArgvCheck | None

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps.values()) and (
            self.check is not None and not self.check.problems
        )


def status(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def print_report(
    results: list[FileResult],
    record: dict[str, Any],
    chroot: Path,
    built_now: bool,
    check_seconds: float,
    show_argv: bool,
) -> bool:
    packages = record["packages"]
    built = "built now" if built_now else "from the cache, built earlier"
    lines = [
        "",
        "================ kubevirt-iommufd: golden outputs on a real libvirt 12.9 ================",
        f"chroot:  {chroot} ({built} in {record.get('build_seconds', '?')} s)",
        f"libvirt: {packages.get('libvirt-daemon')}   qemu: {packages.get('qemu-system-x86')}",
        "",
        f"{'file':<34} {'define':<7} {'validate':<9} {'argv':<5} {'vfio-pci devices in argv':<48}"
        " time",
    ]
    for result in results:
        check = result.check
        if check is None:
            devices = "-"
        else:
            devices = (
                f"{check.iommufd} iommufd, {check.legacy} legacy, {check.mdev} mdev"
                + (f", {check.other} unlisted" if check.other else "")
                + (", +object" if check.iommufd_object else "")
                + ("" if not check.problems else " FAIL")
            )
        seconds = sum(s.seconds for s in result.steps.values())
        lines.append(
            f"{result.name:<34} {status(result.steps['define'].ok):<7}"
            f" {status(result.steps['validate'].ok):<9} {status(result.steps['argv'].ok):<5}"
            f" {devices:<48} {seconds:4.2f} s"
        )
    failed = [r for r in results if not r.ok]
    for result in failed:
        lines.append(f"--- {result.name}")
        for key, step in result.steps.items():
            if not step.ok:
                output = step.output.replace("\n", "\n" + " " * (len(key) + 6))
                lines.append(f"    {key}: {output}")
        for problem in result.check.problems if result.check else []:
            lines.append(f"    argv: {problem}")
    for result in results:
        for note in result.check.notes if result.check else []:
            lines.append(f"note: {result.name}: {note}")
    if show_argv:
        for result in results:
            lines.append(f"--- {result.name}: {'; '.join(result.changes) or 'no changes'}")
            lines.append("    " + result.steps["argv"].output)
    elif results:
        changes = sorted({c.split(" ->")[0] for r in results for c in r.changes})
        lines.append(f"argv copies: {', '.join(changes) or 'unchanged'} (--argv shows them)")
    lines.append(f"checked {len(results)} files in {check_seconds:.1f} s")
    lines.append("RESULT: " + ("PASS" if not failed and results else "FAIL"))
    print("\n".join(lines), flush=True)
    return not failed and bool(results)


def check_files(chroot: Path, files: Sequence[Path]) -> list[FileResult]:
    domains: dict[str, etree._Element] = {}
    changes: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="kubevirt-iommufd-libvirt12-") as tmp:
        work = Path(tmp)
        (work / "schema").mkdir()
        (work / "argv").mkdir()
        for path in files:
            domain = etree.parse(str(path)).getroot()
            domains[path.name] = domain
            (work / "schema" / path.name).write_bytes(etree.tostring(schema_copy(domain)))
            copy, changes[path.name] = argv_copy(domain)
            (work / "argv" / path.name).write_bytes(etree.tostring(copy))
        (work / "files.json").write_text(json.dumps(list(domains)))
        work.chmod(0o755)
        subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                sys.executable,
                str(Path(__file__).resolve()),
                "--inside-check",
                str(chroot),
                str(work),
            ],
            check=True,
        )
        raw: dict[str, dict[str, Any]] = json.loads((work / "results.json").read_text())
    results = []
    for name, domain in domains.items():
        steps = {key: Step(**value) for key, value in raw[name].items()}
        check = check_argv(domain, steps["argv"].output) if steps["argv"].ok else None
        results.append(FileResult(name, steps, changes[name], check))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("files", nargs="*", type=Path, help="domain XML files (default: goldens)")
    parser.add_argument("--prepare", action="store_true", help="build the chroot only")
    parser.add_argument("--argv", action="store_true", help="print each QEMU command line")
    parser.add_argument(
        "--cache",
        type=Path,
        default=DEFAULT_CACHE,
        metavar="DIR",
        help=f"cache holding libvirt-trixie/ (default: {DEFAULT_CACHE})",
    )
    parser.add_argument(
        "--inside-build", nargs=2, metavar=("ROOT", "MIRROR"), help=argparse.SUPPRESS
    )
    parser.add_argument("--inside-check", nargs=2, metavar=("ROOT", "WORK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside_build:
        inside_build(Path(args.inside_build[0]), args.inside_build[1])
        return 0
    if args.inside_check:
        inside_check(Path(args.inside_check[0]), Path(args.inside_check[1]))
        return 0

    if os.geteuid() != 0:
        sys.exit("libvirt12: run as root (chroot, mount namespaces, device nodes)")
    started = time.monotonic()
    chroot, record, built_now = ensure_chroot(args.cache / "libvirt-trixie")
    if args.prepare:
        log(f"ready: {chroot} ({time.monotonic() - started:.0f} s)")
        return 0
    files = [path.resolve() for path in args.files] or sorted(GOLDEN.glob("*.xml"))
    if len({path.name for path in files}) != len(files):
        sys.exit("libvirt12: the files to check need distinct names")
    checked = time.monotonic()
    results = check_files(chroot, files)
    ok = print_report(results, record, chroot, built_now, time.monotonic() - checked, args.argv)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
