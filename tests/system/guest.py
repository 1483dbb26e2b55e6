#!/usr/bin/env python3
"""The guest side of the system test: runs inside the virtme-ng VM that run.py boots.

Everything here is the project's own code against the real kernel (`--root /`): real sysfs, real
`/dev/iommu`, real VFIO cdevs, the emulated Intel IOMMU and QEMU `edu` PCI devices. The host's
root filesystem is shared read-only, so scratch files go to a tmpfs (`/tmp` or `/run`).

Checks, in order (each one PASS/FAIL with its time; later ones run even after a failure when
they can):
  DRA             (guest_dra.py) the DRA driver binds the last edu, on no driver, to vfio-pci
                  for a claim and gives it back; refused while a process holds the device;
                  health: the first edu on vfio-pci unprepared, then the last one prepared,
                  unbound and bound again, the stream and the slice's taint following (target
                  1 s); an upgrade (a second instance, the first stopped) with claims throughout;
                  both edus left on no driver; the migration: a `deviceName` VMI's launcher
                  pod served by the DRA driver through the scheduler's extended-resource
                  claim, its VM started through libvirt 12.9 as virt-launcher starts it
                  (launcher_libvirt.py)
  bind            the edu devices go to vfio-pci: `kubevirt-iommufd bind` when the CLI has it
                  (run.py passes --bind cli), else sysfs driver_override + drivers_probe
  inspect         `kubevirt-iommufd inspect --json` calls each one assignable over iommufd
  plugin          the device plugin registers with the kubelet stand-in, devices Healthy
  allocate        Allocate gives the real /dev/vfio/devices/vfioN and /dev/iommu
  health flips    unbinding a device turns it Unhealthy in ListAndWatch, binding it back
                  Healthy, each within the plugin's 100 ms target (10 cycles, latencies measured)
  iommufd fd      the iommufd resource hands over a real /dev/iommu fd: RLIMIT_MODE 1,
                  IOMMU_IOAS_ALLOC, VFIO_DEVICE_BIND_IOMMUFD + ATTACH_IOMMUFD_PT of each cdev
  DMA             a second hand-off fd: IOMMU_IOAS_MAP a buffer, edu DMA RAM -> device -> RAM
  hook            (launcher.py) the launcher hook, on the real sysfs and a launcher's /dev
                  without device B's cdev node, writes a mixed domain: A iommufd, B legacy
  nested qemu     (launcher.py) QEMU started as libvirt starts it: the plugin's handed-off
                  iommufd fd, A's cdev fd, B by host=; QMP and /proc/<pid>/fd say exactly that
  libvirt start   (launcher_libvirt.py) the same VMI's VM started by libvirt 12.9 as 107:107
                  with no capabilities, on device A and the plugin's handed-off fd: QEMU holds
                  exactly that fd, and VmLck = VmPin (its RAM charged to its own memlock);
                  started again on an fd left per-user (as libvirt opens /dev/iommu): VmLck 0
  plugin stops    SIGTERM: exit 0, no sockets left
  lifecycle       bind/unbind/refused bind with the CLI, reset where the kernel can

The first line is `SYSTEM-TEST-GUEST-STARTED` (run.py boots again when the VM ends before it);
the last is `SYSTEM-TEST-REPORT <json>` for run.py; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import uapi
from guest_dra import check_dra_on_demand
from guestkit import (
    CLI,
    Check,
    CheckFailed,
    Edu,
    Report,
    Runner,
    bind_vfio,
    cpu_loop_ms,
    find_edu,
    receive_fd,
    require,
    say,
    unbind,
)
from launcher import IOMMUFD_RESOURCE, RESOURCE, VMI, check_hook, check_launcher_qemu
from launcher_libvirt import edits_from_allocate, public_dir, start_as_launcher

from hostdev.bdf import is_bdf
from hostdev.iommu_ioctl import RLIMIT_MODE_PER_PROCESS, read_rlimit_mode
from hostdev.iommufd_handoff import QEMU_GID, QEMU_UID
from hostdev.naming import pci_resource_env
from sim.kubelet import KubeletStandIn

# Printed first thing: run.py retries a boot that ends before the guest said this.
STARTED_MARKER = "SYSTEM-TEST-GUEST-STARTED"
REPORT_PREFIX = "SYSTEM-TEST-REPORT "
# The plugin's health propagation target (bench/plugin.py: "< 100 ms both ways"). Under TCG every
# guest instruction is emulated, and a busy host slows it further: over the target is reported,
# and fails the check only with --strict-latency. Over HEALTH_LIMIT_S always fails: that is no
# longer event-driven (a missed event waits for the 30 s re-scan).
HEALTH_TARGET_S = 0.100
HEALTH_LIMIT_S = 1.0
# A slow guest (TCG) starts Python and gRPC slowly: generous limits for everything but latency.
REGISTER_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 10.0
HEALTH_CYCLES = 10
HEALTH_SETTLE_S = 0.3
# Slots the earlier checks have not used (launcher.LAUNCHER_SLOT is iommufd-002).
LIBVIRT_SLOT = "iommufd-003"


def qemu_version() -> str:
    path = shutil.which("qemu-system-x86_64")
    if path is None:
        return "qemu-system-x86_64 not found"
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


def scratch_dir() -> Path:
    """A writable tmpfs directory (the shared root is read-only)."""
    for base in ("/tmp", "/run", "/dev/shm"):  # noqa: S108 - a throwaway VM's tmpfs
        with contextlib.suppress(OSError):
            return Path(tempfile.mkdtemp(prefix="kvi-system-", dir=base))
    raise RuntimeError("no writable tmpfs in the guest")


# --------------------------------------------------------------------------- checks


def check_bind(run: Runner, edus: list[Edu], method: str) -> None:
    """`kubevirt-iommufd bind` when the host's CLI has it (run.py asks), else the sysfs writes."""
    with run.check(f"bind edu devices to vfio-pci ({method})") as check:
        if method == "kubevirt-iommufd bind":
            argv = [CLI, "bind", "--root", "/", "--driver", "vfio-pci", *(e.bdf for e in edus)]
            say("$ " + shlex.join(argv))
            out = subprocess.run(argv, capture_output=True, text=True, check=False)
            say(out.stdout + out.stderr)
            require(out.returncode == 0, f"exit {out.returncode}: {out.stderr.strip()[-300:]}")
        else:
            for edu in edus:
                bind_vfio(edu)
        for edu in edus:
            require(edu.driver() == "vfio-pci", f"{edu.bdf} is bound to {edu.driver()}")
            edu.cdev = edu.read_cdev()
            require(bool(edu.cdev), f"{edu.bdf} has no vfio-dev/vfioN in sysfs")
            require(Path(edu.cdev_path).exists(), f"{edu.cdev_path} does not exist")
            edu.group = (edu.sysfs / "iommu_group").readlink().name
            require(Path(f"/dev/vfio/{edu.group}").exists(), f"/dev/vfio/{edu.group} missing")
        check.detail = ", ".join(f"{e.bdf}->{e.cdev}" for e in edus)


def check_inspect(run: Runner, edus: list[Edu]) -> None:
    with run.check("inspect --json: assignable over iommufd") as check:
        out = subprocess.run(
            [CLI, "inspect", "--json", "--root", "/"], capture_output=True, text=True, check=False
        )
        require(out.returncode == 0, f"exit {out.returncode}: {out.stderr.strip()[-300:]}")
        document = json.loads(out.stdout)
        require(document.get("schema") == "kubevirt-iommufd/inspect/v1", "unexpected schema")
        host = document["host"]
        devnum = Path("/sys/class/misc/iommu/dev").read_text().strip()
        require(host["iommu"] is True, f"host iommu {host['iommu']}")
        require(host["iommufd"] is True, f"host iommufd {host['iommufd']}")
        require(host["iommufd_node"] == "/dev/iommu", f"iommufd_node {host['iommufd_node']}")
        require(host["iommufd_devnum"] == devnum, f"devnum {host['iommufd_devnum']} != {devnum}")
        require(host["vfio_cdev"] is True, f"host vfio_cdev {host['vfio_cdev']}")
        functions = {
            f["bdf"]: (group, f) for group in document["groups"] for f in group["functions"]
        }
        for edu in edus:
            require(edu.bdf in functions, f"{edu.bdf} not listed")
            group, function = functions[edu.bdf]
            seen = (
                function["assignable"],
                function["backend"],
                function["vfio_cdev"],
                function["vfio_cdev_path"],
                function["vfio_cdev_present"],
                function["iommu_group"],
                function["driver"],
            )
            wanted = (True, "iommufd", edu.cdev, edu.cdev_path, True, int(edu.group), "vfio-pci")
            require(seen == wanted, f"{edu.bdf}: got {seen}, wanted {wanted} ({function})")
            require(group["viable"] is True, f"group {edu.group} not viable")
        summary = document["summary"]
        require(
            summary["iommufd"] == len(edus),
            f"{summary['iommufd']} functions over iommufd, wanted only the {len(edus)} edu",
        )
        check.detail = (
            f"kernel {host['kernel']}, /dev/iommu {devnum}; "
            f"{document['summary']['iommufd']} of {document['summary']['functions']}"
            " functions over iommufd"
        )


class Plugin:
    """`kubevirt-iommufd plugin` as a child process, against the kubelet stand-in."""

    def __init__(self, scratch: Path) -> None:
        self.kubelet_dir = scratch / "device-plugins"
        self.socket_dir = scratch / "iommufd"
        self.log_path = scratch / "plugin.log"
        self.config = scratch / "plugin.json"
        self.config.write_text(
            json.dumps(
                {
                    "resources": [
                        {
                            "resourceName": RESOURCE,
                            "selectors": {"vendors": ["1234"], "devices": ["11e8"]},
                        }
                    ],
                    "iommufd": {
                        "socketDir": str(self.socket_dir),
                        "socketOwner": {"uid": QEMU_UID, "gid": QEMU_GID},
                    },
                }
            )
        )
        self.kubelet = KubeletStandIn(self.kubelet_dir)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.kubelet.start()
        argv = [
            CLI,
            "plugin",
            "--root",
            "/",
            "--kubelet-dir",
            str(self.kubelet_dir),
            "--config",
            str(self.config),
            "--log-level",
            "debug",
        ]
        say("$ " + shlex.join(argv))
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> int | None:
        code = None
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                code = self.process.wait()
        self.kubelet.stop()
        return code

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_health(self, bdf: str, state: str, since: float) -> float:
        """Seconds from `since` to the first snapshot (received after `since`) where `bdf` is in
        `state`; the stand-in stamps each snapshot with time.monotonic() on arrival."""

        def seen() -> float | None:
            registration = self.kubelet.latest(RESOURCE)
            if registration is None:
                return None
            for at, devices in list(registration.snapshots):
                if at >= since and devices.get(bdf) == state:
                    return at
            return None

        self.kubelet.wait_for(lambda: seen() is not None, HEALTH_TIMEOUT_S)
        at = seen()
        assert at is not None
        return at - since


def check_plugin(run: Runner, edus: list[Edu], plugin: Plugin) -> bool:
    registered = False
    with run.check("plugin registers; edu devices Healthy") as check:
        started = time.monotonic()
        plugin.start()
        try:
            plugin.kubelet.wait_registered(RESOURCE, timeout=REGISTER_TIMEOUT_S)
            plugin.kubelet.wait_registered(IOMMUFD_RESOURCE, timeout=REGISTER_TIMEOUT_S)
        except AssertionError as error:
            raise CheckFailed(f"not registered: {error}\n{plugin.log_tail()}") from None
        registered = True
        took = time.monotonic() - started
        wanted = {edu.bdf: "Healthy" for edu in edus}
        try:
            plugin.kubelet.wait_for(lambda: plugin.kubelet.health(RESOURCE) == wanted, 10)
        except AssertionError:
            raise CheckFailed(
                f"health {plugin.kubelet.health(RESOURCE)}, wanted {wanted}"
            ) from None
        slots = plugin.kubelet.health(IOMMUFD_RESOURCE)
        require(
            bool(slots) and set(slots.values()) == {"Healthy"},
            f"{IOMMUFD_RESOURCE} not all Healthy: {set(slots.values())}",
        )
        check.detail = (
            f"both resources registered {took:.1f} s after start; {RESOURCE}: {wanted};"
            f" {IOMMUFD_RESOURCE}: {len(slots)} Healthy slots"
        )
    return registered


def check_allocate(run: Runner, edus: list[Edu], plugin: Plugin) -> None:
    with run.check("Allocate: real cdev and /dev/iommu") as check:
        response = plugin.kubelet.allocate(RESOURCE, [edu.bdf for edu in edus])
        (container,) = response.container_responses
        nodes = [d.host_path for d in container.devices]
        for spec in container.devices:
            require(spec.container_path == spec.host_path, f"{spec} maps to another path")
            require(spec.permissions == "mrw", f"{spec.host_path}: permissions {spec.permissions}")
            require(Path(spec.host_path).exists(), f"{spec.host_path} handed out but missing")
        for edu in edus:
            require(edu.cdev_path in nodes, f"{edu.cdev_path} not in {nodes}")
        require("/dev/iommu" in nodes, f"/dev/iommu not in {nodes}")
        envs = dict(container.envs)
        bdfs = ",".join(edu.bdf for edu in edus)
        require(bdfs in envs.values(), f"no env names {bdfs}: {envs}")
        check.detail = f"devices {nodes}; env {envs}"


def plugin_causes(plugin: Plugin, bdf: str, state: str, skip: int) -> list[str]:
    """The `cause=` of each "device <state> … device=<bdf>" line the plugin logged, after the
    first `skip` such lines: which watch told it."""
    causes = []
    for line in plugin.log_path.read_text(errors="replace").splitlines():
        if f"device {state} " in line and f"device={bdf}" in line:
            match = re.search(r"cause='(.*)'$", line) or re.search(r'cause="(.*)"$', line)
            causes.append(match.group(1) if match else "?")
    return causes[skip:]


def first_events(causes: list[str]) -> str:
    """How often each kind of event came first: a uevent (UdevWatch) or a /dev node (inotify)."""
    kinds = Counter(
        "uevent" if is_bdf(cause.split("; ")[0].split(" ")[0]) else "/dev inotify"
        for cause in causes
    )
    return ", ".join(f"{kind} {count}x" for kind, count in kinds.most_common()) or "none logged"


def check_health_flip(run: Runner, edu: Edu, plugin: Plugin, cycles: int, strict: bool) -> None:
    """Unbind and rebind `cycles` times; each flip must reach the kubelet within the target.

    No inotify event exists for a sysfs driver link: on `--root /` the plugin learns of an unbind
    from the kernel's uevent (UdevWatch, netlink) and from the cdev node's removal under /dev
    (inotify), whichever comes first; the plugin's log says which (`cause=`).
    """
    latencies: dict[str, list[float]] = {"Unhealthy": [], "Healthy": []}
    seen_before = {
        "unhealthy": len(plugin_causes(plugin, edu.bdf, "unhealthy", 0)),
        "healthy": len(plugin_causes(plugin, edu.bdf, "healthy", 0)),
    }
    with run.check(f"unbind/rebind {edu.bdf} x{cycles}: health flips (target 100 ms)") as check:
        for cycle in range(cycles):
            for state, flip in (("Unhealthy", unbind), ("Healthy", bind_vfio)):
                since = time.monotonic()
                flip(edu)
                try:
                    latency = plugin.wait_health(edu.bdf, state, since)
                except AssertionError:
                    raise CheckFailed(
                        f"cycle {cycle}: not {state} within {HEALTH_TIMEOUT_S:g} s:"
                        f" {plugin.kubelet.health(RESOURCE)}"
                    ) from None
                latencies[state].append(latency)
                # Let the late events of this flip (the uevent follows the /dev node change)
                # settle, so each flip's causes are its own; the state must hold meanwhile.
                time.sleep(HEALTH_SETTLE_S)
                now = plugin.kubelet.health(RESOURCE).get(edu.bdf)
                require(now == state, f"cycle {cycle}: {state} flapped back to {now}")
        edu.cdev = edu.read_cdev()
        parts = []
        for state in ("Unhealthy", "Healthy"):
            values = sorted(latencies[state])
            causes = plugin_causes(plugin, edu.bdf, state.lower(), seen_before[state.lower()])
            parts.append(
                f"{state}: median {statistics.median(values) * 1000:.0f} ms,"
                f" max {values[-1] * 1000:.0f} ms"
                f" (all: {', '.join(f'{v * 1000:.0f}' for v in latencies[state])});"
                f" first event of the batch that flipped it: {first_events(causes)}"
            )
        check.detail = " | ".join(parts)
        limit = HEALTH_TARGET_S if strict else HEALTH_LIMIT_S
        slow = {
            state: f"{max(values) * 1000:.0f} ms"
            for state, values in latencies.items()
            if max(values) > limit
        }
        require(not slow, f"over {limit * 1000:.0f} ms: {slow}")
        over = [s for s, values in latencies.items() if max(values) > HEALTH_TARGET_S]
        if over:
            check.detail = f"OVER THE 100 ms TARGET under TCG ({', '.join(over)}) | " + (
                check.detail
            )


def check_iommufd_handoff(run: Runner, edus: list[Edu], plugin: Plugin) -> None:
    with run.check("iommufd fd hand-off: RLIMIT_MODE, IOAS, bind cdevs") as check:
        response = plugin.kubelet.allocate(IOMMUFD_RESOURCE, ["iommufd-000"])
        (container,) = response.container_responses
        nodes = [d.host_path for d in container.devices]
        require(nodes == ["/dev/iommu"], f"devices {nodes}")
        (mount,) = container.mounts
        require(
            mount.container_path == "/var/run/kubevirt/iommufd.sock",
            f"mounted at {mount.container_path}",
        )
        iommufd = receive_fd(mount.host_path)
        steps: list[str] = []
        opened: list[int] = []
        try:
            stat = os.fstat(iommufd)
            devnum = f"{os.major(stat.st_rdev)}:{os.minor(stat.st_rdev)}"
            real = Path("/sys/class/misc/iommu/dev").read_text().strip()
            require(devnum == real, f"received fd is {devnum}, /dev/iommu is {real}")
            steps.append(f"fd is /dev/iommu {devnum}")
            mode = read_rlimit_mode(iommufd)
            require(mode == RLIMIT_MODE_PER_PROCESS, f"IOMMU_OPTION GET RLIMIT_MODE = {mode}")
            steps.append(f"RLIMIT_MODE={mode}")
            ioas = uapi.ioas_alloc(iommufd)
            steps.append(f"IOAS {ioas}")
            for edu in edus:
                device = os.open(edu.cdev_path, os.O_RDWR | os.O_CLOEXEC)
                opened.append(device)
                devid = uapi.bind_iommufd(device, iommufd)
                pt = uapi.attach_pt(device, ioas)
                flags, regions, irqs = uapi.device_info(device)
                require(bool(flags & uapi.VFIO_DEVICE_FLAGS_PCI), f"{edu.cdev} flags {flags:#x}")
                steps.append(
                    f"{edu.cdev} bound devid {devid}, attached pt {pt}"
                    f" ({regions} regions, {irqs} irqs)"
                )
            require(not Path(mount.host_path).exists(), "the one-shot socket is still there")
        finally:
            for device in opened:
                os.close(device)
            os.close(iommufd)
        check.detail = "; ".join(steps)


# QEMU's edu device (docs/specs/edu.rst): BAR0 registers and a 4 KiB buffer in its own address
# space at 0x40000; DMA addresses are masked to 28 bits, so the IOVA stays below 256 MiB.
EDU_IDENT, EDU_LIVENESS = 0x00, 0x04
EDU_DMA_SRC, EDU_DMA_DST, EDU_DMA_COUNT, EDU_DMA_CMD = 0x80, 0x88, 0x90, 0x98
EDU_DMA_START, EDU_DMA_TO_RAM = 0x1, 0x2
EDU_BUFFER = 0x40000
DMA_IOVA = 0x100000
PCI_COMMAND, PCI_COMMAND_MASTER = 0x04, 0x4


def read32(fd: int, offset: int) -> int:
    return int.from_bytes(os.pread(fd, 4, offset), "little")


def write32(fd: int, offset: int, value: int) -> None:
    require(os.pwrite(fd, value.to_bytes(4, "little"), offset) == 4, f"short write at {offset:#x}")


def edu_dma(device: int, bar: int, src: int, dst: int, count: int, command: int) -> None:
    write32(device, bar + EDU_DMA_SRC, src)
    write32(device, bar + EDU_DMA_DST, dst)
    write32(device, bar + EDU_DMA_COUNT, count)
    write32(device, bar + EDU_DMA_CMD, command | EDU_DMA_START)
    deadline = time.monotonic() + 10
    while read32(device, bar + EDU_DMA_CMD) & EDU_DMA_START:
        require(time.monotonic() < deadline, "the edu DMA did not finish within 10 s")
        time.sleep(0.01)


def check_dma(run: Runner, edu: Edu, plugin: Plugin) -> None:
    """A second Allocate, a fresh hand-off fd, and real DMA through the emulated IOMMU with it."""
    with run.check(f"2nd hand-off fd: edu DMA round trip via IOMMU ({edu.bdf})") as check:
        response = plugin.kubelet.allocate(IOMMUFD_RESOURCE, ["iommufd-001"])
        (mount,) = response.container_responses[0].mounts
        iommufd = receive_fd(mount.host_path)
        memory = mmap.mmap(-1, 2 * mmap.PAGESIZE)
        anchor = ctypes.c_char.from_buffer(memory)
        device = -1
        try:
            ioas = uapi.ioas_alloc(iommufd)
            device = os.open(edu.cdev_path, os.O_RDWR | os.O_CLOEXEC)
            uapi.bind_iommufd(device, iommufd)
            uapi.attach_pt(device, ioas)
            _flags, _size, bar = uapi.region_info(device, uapi.VFIO_PCI_BAR0_REGION_INDEX)
            _flags, _size, config = uapi.region_info(device, uapi.VFIO_PCI_CONFIG_REGION_INDEX)
            ident = read32(device, bar + EDU_IDENT)
            require(ident & 0xFF == 0xED, f"BAR0 identification {ident:#x}, not an edu")
            write32(device, bar + EDU_LIVENESS, 0x12345678)
            alive = read32(device, bar + EDU_LIVENESS)
            require(alive == 0x12345678 ^ 0xFFFFFFFF, f"liveness answer {alive:#x}")
            command = int.from_bytes(os.pread(device, 2, config + PCI_COMMAND), "little")
            enabled = (command | PCI_COMMAND_MASTER).to_bytes(2, "little")
            os.pwrite(device, enabled, config + PCI_COMMAND)
            pattern = os.urandom(512)
            memory[: len(pattern)] = pattern
            iova = uapi.ioas_map(iommufd, ioas, ctypes.addressof(anchor), len(memory), DMA_IOVA)
            out_iova = iova + mmap.PAGESIZE
            edu_dma(device, bar, iova, EDU_BUFFER, len(pattern), 0)
            edu_dma(device, bar, EDU_BUFFER, out_iova, len(pattern), EDU_DMA_TO_RAM)
            back = memory[mmap.PAGESIZE : mmap.PAGESIZE + len(pattern)]
            require(back == pattern, "the bytes that came back differ from those sent")
            check.detail = (
                f"edu {ident >> 24}.{(ident >> 16) & 0xFF}: {len(pattern)} random bytes RAM ->"
                f" edu -> RAM through IOVA {iova:#x}/{out_iova:#x} of IOAS {ioas}, identical"
            )
        finally:
            if device >= 0:
                os.close(device)
            os.close(iommufd)
            del anchor
            memory.close()


# --------------------------------------------------------------------------- main


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [CLI, *argv]
    say("$ " + shlex.join(command))
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    say(out.stdout + out.stderr)
    return out


def check_lifecycle(run: Runner, edus: list[Edu]) -> None:
    """bind/unbind on the real sysfs (issue 8): nothing to do when bound, unbind and reprobe, a
    refused driver leaves the device as it was, bind again; then a reset where the kernel has a
    method for the device."""
    first, last = edus[0], edus[-1]
    with run.check("bind again, unbind --reprobe, refused bind, bind (CLI)") as check:
        out = cli("bind", "--root", "/", first.bdf)
        require(out.returncode == 0 and "nothing to do" in out.stdout, f"bound: {out.stdout}")
        out = cli("unbind", "--root", "/", "--reprobe", "--json", last.bdf)
        require(out.returncode == 0, f"unbind exit {out.returncode}: {out.stderr[-300:]}")
        require(last.driver() != "vfio-pci", f"{last.bdf} still on {last.driver()}")
        require(not Path(last.cdev_path).exists(), f"{last.cdev_path} still exists")
        before = last.driver()
        out = cli("bind", "--root", "/", "--driver", "no_such_vfio_driver", last.bdf)
        require(out.returncode != 0, "binding to a driver that does not exist succeeded")
        require(last.driver() == before, f"{last.bdf} moved to {last.driver()} on a refusal")
        out = cli("bind", "--root", "/", "--json", last.bdf)
        require(out.returncode == 0, f"bind exit {out.returncode}: {out.stderr[-300:]}")
        require(last.driver() == "vfio-pci", f"{last.bdf} is on {last.driver()}")
        last.cdev = last.read_cdev()
        require(Path(last.cdev_path).exists(), f"{last.cdev_path} missing after the bind")
        check.detail = f"{last.bdf}: vfio-pci -> {before or 'no driver'} -> vfio-pci ({last.cdev})"
    with run.check("reset through sysfs where the kernel can") as check:
        methods_file = first.sysfs / "reset_method"
        methods = methods_file.read_text().split() if methods_file.exists() else []
        if methods:
            (first.sysfs / "reset").write_text("1")
            check.detail = f"{first.bdf} reset ({' '.join(methods)})"
        else:
            # The emulated edu device offers none (no FLR, no PM, on the root bus): inspect
            # must say so rather than pretend.
            out = cli("inspect", "--root", "/", "--json", first.bdf)
            document = json.loads(out.stdout)
            (function,) = [
                f for g in document["groups"] for f in g["functions"] if f["bdf"] == first.bdf
            ]
            require(function["reset_methods"] == [], f"reset_methods {function['reset_methods']}")
            warned = any("no reset method" in w for w in function["warnings"])
            require(warned, f"no warning: {function['warnings']}")
            check.detail = f"{first.bdf} has no reset method; inspect warns"


def check_libvirt_start(run: Runner, edus: list[Edu], plugin: Plugin, chroot: Path) -> None:
    title = (
        "libvirt 12.9 starts the VM as virt-launcher (107:107): the plugin's fd, VmLck = VmPin;"
        " a per-user fd's VmLck 0"
    )
    with run.check(title) as check:
        responses = [
            plugin.kubelet.allocate(RESOURCE, [edus[0].bdf]),
            plugin.kubelet.allocate(IOMMUFD_RESOURCE, [LIBVIRT_SLOT]),
        ]
        edits = edits_from_allocate(responses, [public_dir()])
        check.detail = start_as_launcher(
            chroot, VMI, pci_resource_env(RESOURCE), edits, edus, control=True
        )


def run_checks(
    run: Runner,
    edus: list[Edu],
    scratch: Path,
    bind_method: str,
    strict: bool,
    chroot: Path | None,
) -> None:
    # First, while the devices are still on no driver (guest_dra.py); they are left so.
    check_dra_on_demand(run, edus, scratch, strict, chroot)
    check_bind(run, edus, bind_method)
    bound = all(c.ok for c in run.report.checks)
    run.report.devices = [asdict(edu) for edu in edus]
    check_inspect(run, edus)
    plugin = Plugin(scratch)
    try:
        registered = check_plugin(run, edus, plugin)
        if registered:
            check_allocate(run, edus, plugin)
            check_health_flip(run, edus[-1], plugin, HEALTH_CYCLES, strict)
            check_iommufd_handoff(run, edus, plugin)
            check_dma(run, edus[0], plugin)
        else:
            for name in ("Allocate", "unbind/rebind health", "iommufd fd hand-off", "DMA"):
                run.skip(name, "the plugin did not register")
        if not bound:
            say("devices were not bound; the hook and the nested QEMU will report why")
        plan = check_hook(run, edus, scratch)
        # The nested QEMU gets its iommufd from the plugin's one-shot socket, as in a launcher.
        if registered:
            check_launcher_qemu(run, edus, plan, plugin.kubelet, scratch)
        else:
            run.skip("nested qemu: launcher's iommufd fd", "the plugin did not register")
        if not registered:
            run.skip("libvirt 12.9 starts the VM", "the plugin did not register")
        elif chroot is None:
            run.skip("libvirt 12.9 starts the VM", "no --libvirt-chroot given")
        else:
            check_libvirt_start(run, edus, plugin, chroot)
    finally:
        code = plugin.stop()
        with run.check("plugin stops on SIGTERM with exit 0") as check:
            require(code == 0, f"exit {code}\n{plugin.log_tail()}")
            leftovers = sorted(p.name for p in plugin.kubelet_dir.glob("kubevirt-iommufd-*"))
            require(not leftovers, f"sockets left behind: {leftovers}")
            # Unhealthy devices are WARNINGs by design; anything else is worth a look.
            other = [
                line.split(" ", 2)[-1][:160]
                for line in plugin.log_path.read_text(errors="replace").splitlines()
                if (" WARNING " in line or " ERROR " in line or "Traceback" in line)
                and "device unhealthy" not in line
            ]
            check.detail = f"no sockets left; other warnings/errors in its log: {other or 'none'}"
    if bound:
        check_lifecycle(run, edus)


def main() -> int:
    parser = argparse.ArgumentParser(description="guest side of the system test")
    parser.add_argument("--expect-edu", type=int, default=2)
    parser.add_argument("--bind", choices=["cli", "sysfs"], default="sysfs")
    parser.add_argument("--strict-latency", action="store_true")
    parser.add_argument("--host-loop-ms", type=float, default=0.0)
    parser.add_argument(
        "--libvirt-chroot", type=Path, help="the libvirt 12.9 chroot (libvirt12.py), read-only"
    )
    args = parser.parse_args()
    say(STARTED_MARKER)
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    report = Report(
        kernel=platform.release(),
        qemu=qemu_version(),
        uptime_at_start=uptime,
        loop_ms=cpu_loop_ms(),
        host_loop_ms=args.host_loop_ms,
    )
    run = Runner(report)
    say(f"guest: kernel {report.kernel}, userspace up {uptime:.1f} s after boot")
    edus = find_edu()
    report.devices = [asdict(edu) for edu in edus]
    with run.check(f"find {args.expect_edu} edu devices (1234:11e8)") as check:
        check.detail = ", ".join(edu.bdf for edu in edus)
        require(len(edus) >= args.expect_edu, f"found {len(edus)}")
        require(Path("/dev/iommu").exists(), "no /dev/iommu: the kernel lacks CONFIG_IOMMUFD")
        groups = list(Path("/sys/kernel/iommu_groups").iterdir())
        require(bool(groups), "no IOMMU groups: intel_iommu is off")
    if report.checks[-1].ok:
        scratch = scratch_dir()
        try:
            method = "kubevirt-iommufd bind" if args.bind == "cli" else "sysfs"
            run_checks(run, edus, scratch, method, args.strict_latency, args.libvirt_chroot)
        except Exception as error:  # a bug in this script must still give a report
            traceback.print_exc()
            report.checks.append(Check("guest harness", False, 0.0, repr(error)))
    print(REPORT_PREFIX + json.dumps(asdict(report)), flush=True)
    return 0 if all(c.ok for c in report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
