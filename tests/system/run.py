#!/usr/bin/env python3
"""Real-kernel system test: the whole iommufd path under QEMU (issue 7).

Run as root on a Debian bookworm machine: ``./dev.sh system-test`` (or
``.venv/bin/python tests/system/run.py``). It

1. installs what is missing: QEMU >= 10 from bookworm-backports (a sources entry on the mirror
   the machine already uses), the kernel build tools and ``linux-source-6.12``;
2. builds, once, a Linux 6.12 kernel from ``make tinyconfig`` plus ``iommufd-kernel.config``
   (beside this file) and caches it OUTSIDE the repository, keyed by the source package version
   and a hash of the fragment: ``/var/cache/kubevirt-iommufd/kernel-<version>-<hash>/bzImage``;
3. installs virtme-ng into its own virtualenv in the same cache (the project's .venv stays
   exactly what ``pyproject.toml`` says);
4. boots that kernel under TCG with an emulated Intel IOMMU and QEMU ``edu`` PCI devices, the
   host's root filesystem shared read-only, and runs ``guest.py`` there: the project's own code
   on the real sysfs, ``/dev/iommu`` and VFIO cdevs;
5. prints a short report (kernel, devices, each check with pass/fail and its time) and exits
   non-zero if anything failed.

Options: ``--prepare`` only installs and builds (no boot); ``--edu N`` sets the number of edu
devices (default 2); ``--cache DIR`` moves the cache (also ``KUBEVIRT_IOMMUFD_CACHE``);
``--bind auto|cli|sysfs`` picks how the guest binds the devices (auto: `kubevirt-iommufd bind`
once the CLI has it, else sysfs writes); ``--timeout S`` bounds the VM's run (default 1500 s;
then vng and QEMU are killed).
See docs/system-test.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# tests/apt_sources.py is shared with the libvirt check and the schema fetch (one reader of the
# machine's apt sources); as a script this file only has its own directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from apt_sources import NoMirrorError, debian_mirror

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FRAGMENT = HERE / "iommufd-kernel.config"
GUEST = HERE / "guest.py"
DEFAULT_CACHE = Path(os.environ.get("KUBEVIRT_IOMMUFD_CACHE", "/var/cache/kubevirt-iommufd"))

KERNEL_SOURCE_PACKAGE = "linux-source-6.12"
BUILD_PACKAGES = ("flex", "bison", "libelf-dev", "bc", "build-essential", "xz-utils")
# The guest runs the host's binaries. virtme-ng's init only finds its script I/O ports
# (/dev/virtio-ports/virtme.*, which carry the command's output and exit code) when udevd runs.
GUEST_PACKAGES = ("udev",)
QEMU_MIN_MAJOR = 10
QEMU_BACKPORTS = (
    "qemu-system-x86",
    "qemu-system-common",
    "qemu-system-data",
    "seabios",
)
BACKPORTS_SOURCES = Path("/etc/apt/sources.list.d/kubevirt-iommufd-bookworm-backports.sources")
VIRTME_NG = "virtme-ng==1.42"
REPORT_PREFIX = "SYSTEM-TEST-REPORT "
STARTED_MARKER = "SYSTEM-TEST-GUEST-STARTED"  # guest.py prints it first
# QEMU's own fatal messages ("qemu-system-x86_64: system/physmem.c:…: Assertion … failed").
QEMU_ERROR = re.compile(r"^qemu-system-\w+: ")
BOOT_ATTEMPTS = 3

# Kernel command line and QEMU options of the recipe (../shared/system/README.md, copied into
# docs/system-test.md): a module-less kernel needs root=/dev/root; iommu=pt gives identity groups.
# no_timer_check: on a busy host TCG runs the kernel's early IO-APIC timer probe too slowly, and
# the boot panics ("timer doesn't work through Interrupt-remapped IO-APIC").
KERNEL_ARGS = "root=/dev/root intel_iommu=on iommu=pt no_timer_check"
IOMMU_DEVICE = "-device intel-iommu,intremap=on,caching-mode=on"
# QEMU 10.0's multi-threaded TCG with the emulated intel-iommu and 2 vCPUs sometimes aborts early
# in the boot (physmem.c iotlb_to_section: `section_index < d->map.sections_nb`); one TCG thread
# for both vCPUs avoids it. docs/system-test.md has the counts and the cost.
QEMU_ACCEL = "-accel tcg,thread=single"
VCPUS = "2"


def log(message: str) -> None:
    print(f"==> {message}", file=sys.stderr, flush=True)


def run(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    log("$ " + shlex.join(argv))
    return subprocess.run(argv, check=True, text=True, **kwargs)


# --------------------------------------------------------------------------- Debian packages


def installed_version(package: str) -> str | None:
    result = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}\t${Version}", package],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        return None
    status, _, version = result.stdout.partition("\t")
    return version if status == "install ok installed" else None


def apt_install(packages: Sequence[str], *, update: bool = True) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if update:
        run(["apt-get", "update", "-qq"], env=env)
    run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
        env=env,
        stdout=subprocess.DEVNULL,
    )


def qemu_major(binary: str = "qemu-system-x86_64") -> int:
    path = shutil.which(binary)
    if path is None:
        return 0
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"version (\d+)\.", out)
    return int(match.group(1)) if match else 0


def ensure_packages() -> None:
    need_root = os.geteuid() != 0
    missing = [
        p
        for p in (*BUILD_PACKAGES, *GUEST_PACKAGES, KERNEL_SOURCE_PACKAGE)
        if not installed_version(p)
    ]
    old_qemu = qemu_major() < QEMU_MIN_MAJOR
    if not missing and not old_qemu:
        return
    if need_root:
        sys.exit(
            f"system-test: run as root to install {missing or []}"
            f"{' and QEMU >= 10 from bookworm-backports' if old_qemu else ''}"
        )
    if old_qemu and not BACKPORTS_SOURCES.exists():
        try:
            mirror = debian_mirror()
        except NoMirrorError as error:
            sys.exit(f"system-test: {error}")
        log(f"adding bookworm-backports on {mirror} ({BACKPORTS_SOURCES})")
        BACKPORTS_SOURCES.write_text(
            "Types: deb\n"
            f"URIs: {mirror}\n"
            "Suites: bookworm-backports\n"
            "Components: main\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
        )
    wanted = list(missing)
    if old_qemu:
        wanted += [f"{package}/bookworm-backports" for package in QEMU_BACKPORTS]
    apt_install(wanted)
    if qemu_major() < QEMU_MIN_MAJOR:
        sys.exit(f"system-test: QEMU is still older than {QEMU_MIN_MAJOR} after installing")


# --------------------------------------------------------------------------- kernel


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fragment_options(text: str) -> dict[str, str]:
    """CONFIG_X -> 'y' / value / 'n' (for '# CONFIG_X is not set')."""
    options: dict[str, str] = {}
    for line in text.splitlines():
        if match := re.fullmatch(r"(CONFIG_\w+)=(.*)", line.strip()):
            options[match.group(1)] = match.group(2)
        elif match := re.fullmatch(r"# (CONFIG_\w+) is not set", line.strip()):
            options[match.group(1)] = "n"
    return options


def kernel_dir(cache: Path) -> Path:
    version = installed_version(KERNEL_SOURCE_PACKAGE)
    if version is None:
        sys.exit(f"system-test: {KERNEL_SOURCE_PACKAGE} is not installed")
    digest = hashlib.sha256(FRAGMENT.read_bytes()).hexdigest()[:16]
    return cache / f"kernel-{version}-{digest}"


def ensure_kernel(cache: Path) -> tuple[Path, float | None]:
    """The cached bzImage, building it when missing; also the build time (None: cache hit)."""
    target = kernel_dir(cache)
    bzimage = target / "bzImage"
    with locked(cache / "kernel.lock"):
        if bzimage.is_file():
            log(f"kernel: cached {bzimage}")
            return bzimage, None
        started = time.monotonic()
        for stale in cache.glob("kernel-build-*"):
            log(f"kernel: removing {stale}, left by an interrupted build")
            shutil.rmtree(stale, ignore_errors=True)
        tarball = Path(f"/usr/src/{KERNEL_SOURCE_PACKAGE}.tar.xz")
        with tempfile.TemporaryDirectory(prefix="kernel-build-", dir=cache) as build_root:
            log(f"kernel: unpacking {tarball}")
            run(["tar", "-xaf", str(tarball), "-C", build_root])
            (source,) = [p for p in Path(build_root).iterdir() if p.is_dir()]
            jobs = str((os.cpu_count() or 1) + 1)
            log(f"kernel: building in {source} with -j{jobs} (about 10 minutes on 2 cores)")
            run(["make", "-C", str(source), "tinyconfig"], stdout=subprocess.DEVNULL)
            run(
                ["scripts/kconfig/merge_config.sh", "-m", ".config", str(FRAGMENT)],
                cwd=source,
                stdout=subprocess.DEVNULL,
            )
            run(["make", "-C", str(source), "olddefconfig"], stdout=subprocess.DEVNULL)
            check_config(source / ".config")
            run(["make", "-C", str(source), f"-j{jobs}", "bzImage"], stdout=subprocess.DEVNULL)
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / ".config", target / "config")
            partial = target / "bzImage.partial"
            shutil.copy2(source / "arch/x86/boot/bzImage", partial)
            partial.rename(bzimage)
        elapsed = time.monotonic() - started
        (target / "build-seconds").write_text(f"{elapsed:.0f}\n")
        log(f"kernel: built {bzimage} in {elapsed:.0f} s")
        return bzimage, elapsed


def check_config(config: Path) -> None:
    """Every option the fragment turns on must survive olddefconfig (a silent drop = no IOMMU).

    The fragment's ``is not set`` lines only trim the build; other options may select them back.
    """
    wanted = fragment_options(FRAGMENT.read_text())
    got = fragment_options(config.read_text())
    lost = [
        f"{key}={value} (got {got.get(key, 'n')})"
        for key, value in wanted.items()
        if value != "n" and got.get(key, "n") != value
    ]
    if lost:
        sys.exit("system-test: the kernel config lost options: " + ", ".join(lost))


# --------------------------------------------------------------------------- virtme-ng


def ensure_vng(cache: Path) -> Path:
    venv = cache / "virtme-ng-venv"
    vng = venv / "bin" / "vng"
    stamp = venv / f".installed-{VIRTME_NG}"
    with locked(cache / "virtme-ng.lock"):
        if vng.exists() and stamp.exists():
            return vng
        log(f"installing {VIRTME_NG} into {venv}")
        run([sys.executable, "-m", "venv", "--clear", str(venv)])
        run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", VIRTME_NG])
        stamp.touch()
    return vng


# --------------------------------------------------------------------------- boot


def guest_python() -> Path:
    python = REPO / ".venv" / "bin" / "python"
    return python if python.exists() else Path(sys.executable)


def bind_method(choice: str) -> str:
    """`cli` once `kubevirt-iommufd bind` exists (asked here: ~0.3 s, not ~15 s under TCG)."""
    if choice != "auto":
        return choice
    cli = guest_python().parent / "kubevirt-iommufd"
    probe = subprocess.run([str(cli), "bind", "--help"], capture_output=True, check=False)
    return "cli" if probe.returncode == 0 else "sysfs"


def cpu_loop_ms() -> float:
    """The same fixed work guest.py times in the VM (best of 3 here, on an idle interpreter)."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        sum(i * i for i in range(200_000))
        best = min(best, (time.perf_counter() - started) * 1000)
    return best


@dataclass(frozen=True)
class Guest:
    """What the guest is given: its edu devices, how to bind them, and the libvirt chroot."""

    edu: int
    bind: str
    strict: bool
    chroot: Path


def guest_command(guest: Guest) -> str:
    return shlex.join(
        [
            "env",
            "PYTHONDONTWRITEBYTECODE=1",
            "PYTHONUNBUFFERED=1",
            str(guest_python()),
            str(GUEST),
            "--expect-edu",
            str(guest.edu),
            "--bind",
            bind_method(guest.bind),
            f"--host-loop-ms={cpu_loop_ms():.2f}",
            f"--libvirt-chroot={guest.chroot}",
            *(["--strict-latency"] if guest.strict else []),
        ]
    )


@dataclass(frozen=True)
class Boot:
    """One vng run: its exit code, the guest's report, and how it ended."""

    code: int
    report: dict[str, Any] | None
    seconds: float
    guest_started: bool
    timed_out: bool
    qemu_error: str  # QEMU's own last error line, when it printed one

    @property
    def retriable(self) -> bool:
        """The emulator failed, not the code under test: the VM ended without a report and
        without running out of time, before the guest started or with QEMU's own error."""
        return (
            self.report is None
            and not self.timed_out
            and (not self.guest_started or bool(self.qemu_error))
        )

    def summary(self) -> str:
        when = "after the guest started" if self.guest_started else "before the guest started"
        return f"vng exit {self.code} after {self.seconds:.1f} s, {when}: " + (
            self.qemu_error or "no error line from QEMU"
        )


def boot(vng: Path, bzimage: Path, guest: Guest, timeout: float) -> Boot:
    qemu_opts = " ".join([QEMU_ACCEL, IOMMU_DEVICE, *["-device edu"] * guest.edu])
    argv = [
        str(vng),
        "-r",
        str(bzimage),
        "--disable-kvm",
        "--disable-microvm",
        # virtme-ng's guest hides /var/cache under a tmpfs: the chroot is shared at its path.
        f"--rodir={guest.chroot}",
        "-m",
        "1G",
        "-p",
        VCPUS,
        "-a",
        KERNEL_ARGS,
        f"--qemu-opts={qemu_opts}",
        "-e",
        guest_command(guest),
    ]
    log("$ " + shlex.join(argv))
    started = time.monotonic()
    report: dict[str, Any] | None = None
    guest_started = False
    qemu_error = ""
    timed_out = threading.Event()
    # Pipe vng's output: sent straight to a file, its console streams overwrite each other.
    with subprocess.Popen(
        argv,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=dict(os.environ, PATH=f"{vng.parent}:{os.environ.get('PATH', '')}"),
        start_new_session=True,
    ) as process:
        assert process.stdout is not None

        def overdue() -> None:
            # vng runs QEMU as a child: end the whole session, not just vng.
            log(f"system-test: no result after {timeout:g} s; killing vng and QEMU")
            timed_out.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

        watchdog = threading.Timer(timeout, overdue)
        watchdog.start()
        for line in process.stdout:
            if REPORT_PREFIX in line:
                payload = line.split(REPORT_PREFIX, 1)[1]
                with contextlib.suppress(ValueError):
                    report = json.loads(payload)
                continue
            guest_started = guest_started or STARTED_MARKER in line
            if QEMU_ERROR.match(line):
                qemu_error = line.strip()
            sys.stdout.write("   | " + line)
            sys.stdout.flush()
        code = process.wait()
        watchdog.cancel()
    return Boot(
        code,
        report,
        time.monotonic() - started,
        guest_started,
        timed_out.is_set(),
        qemu_error,
    )


def boot_until_the_guest_reports(
    vng: Path, bzimage: Path, guest: Guest, timeout: float
) -> list[Boot]:
    """Every boot made, the last one counting: a boot the emulator ended (`Boot.retriable`) is
    made again, up to BOOT_ATTEMPTS in all, so CI does not fail by chance."""
    boots: list[Boot] = []
    while True:
        boots.append(boot(vng, bzimage, guest, timeout))
        if not boots[-1].retriable or len(boots) == BOOT_ATTEMPTS:
            return boots
        log(
            f"system-test: boot {len(boots)} of at most {BOOT_ATTEMPTS} failed in the emulator"
            f" ({boots[-1].summary()}); booting again"
        )


# --------------------------------------------------------------------------- report


def print_report(boots: list[Boot], build_seconds: float | None, bzimage: Path) -> bool:
    last = boots[-1]
    report, code = last.report, last.code
    ok = code == 0 and report is not None and all(c["ok"] for c in report["checks"])
    if build_seconds is not None:
        built = f"built now in {build_seconds:.0f} s"
    else:
        recorded = bzimage.parent / "build-seconds"
        took = recorded.read_text().strip() if recorded.exists() else "?"
        built = f"from the cache, built earlier in {took} s"
    lines = ["", "==================== kubevirt-iommufd system test ===================="]
    if report is None:
        lines.append(f"no report from the guest (vng exit code {code})")
    else:
        lines += [
            f"kernel:  {report['kernel']} ({bzimage}, {built})",
            f"qemu:    {report['qemu']} ({QEMU_ACCEL}, {VCPUS} vCPUs)",
            f"boot:    guest checks started {report['uptime_at_start']:.1f} s after kernel start",
            f"cpu:     a fixed Python loop took {report['loop_ms']:.0f} ms in the guest,"
            f" {report['host_loop_ms']:.0f} ms on the host"
            + (
                f" (TCG: x{report['loop_ms'] / report['host_loop_ms']:.0f})"
                if report["host_loop_ms"]
                else ""
            ),
            f"devices: {len(report['devices'])} edu -> "
            + ", ".join(f"{d['bdf']} group {d['group']} {d['cdev']}" for d in report["devices"]),
        ]
        for check in report["checks"]:
            status = "PASS" if check["ok"] else "FAIL"
            lines.append(f"  {status}  {check['name']:<58} {check['seconds']:6.2f} s")
            if check["detail"]:
                lines.append(f"        {check['detail']}")
    if len(boots) > 1:
        lines.append(f"retried: this is boot attempt {len(boots)} of at most {BOOT_ATTEMPTS}")
        lines += [f"  attempt {n}: {b.summary()}" for n, b in enumerate(boots[:-1], 1)]
    elif last.retriable:
        lines.append(f"the emulator failed: {last.summary()}")
    lines.append(f"total: vng wall time {last.seconds:.1f} s, exit code {code}")
    lines.append("RESULT: " + ("PASS" if ok else "FAIL"))
    print("\n".join(lines), flush=True)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--prepare", action="store_true", help="install and build only; no boot")
    parser.add_argument("--edu", type=int, default=2, help="number of edu devices (default: 2)")
    parser.add_argument(
        "--cache",
        type=Path,
        default=DEFAULT_CACHE,
        metavar="DIR",
        help=f"kernel and virtme-ng cache (default: {DEFAULT_CACHE})",
    )
    parser.add_argument(
        "--bind",
        choices=["auto", "cli", "sysfs"],
        default="auto",
        help="how the guest binds the devices: `kubevirt-iommufd bind` (cli), the sysfs writes,"
        " or cli when the CLI has it (auto, the default)",
    )
    parser.add_argument(
        "--strict-latency",
        action="store_true",
        help="fail when a health flip misses the plugin's 100 ms target (default: report it,"
        " fail only over 1 s: TCG emulation and a busy host slow the guest several-fold)",
    )
    parser.add_argument(
        "--timeout", type=float, default=1500.0, help="seconds the VM may run (default: 1500)"
    )
    args = parser.parse_args(argv)
    if args.edu < 1:
        parser.error("--edu must be at least 1")

    ensure_packages()
    bzimage, build_seconds = ensure_kernel(args.cache)
    vng = ensure_vng(args.cache)
    # libvirt12 imports this module's installers; imported here, once they are defined.
    from libvirt12 import ensure_chroot

    chroot, _record, _built = ensure_chroot(args.cache / "libvirt-trixie")
    if args.prepare:
        log(f"ready: {bzimage}, {vng}, {chroot}")
        return 0
    boots = boot_until_the_guest_reports(
        vng, bzimage, Guest(args.edu, args.bind, args.strict_latency, chroot), args.timeout
    )
    return 0 if print_report(boots, build_seconds, bzimage) else 1


if __name__ == "__main__":
    sys.exit(main())
