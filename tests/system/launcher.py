"""The launcher's side of the system test: what KubeVirt's virt-launcher, libvirt and QEMU do.

1. `hook`: the launcher hook rewrites a KubeVirt-style domain with two edu hostdevs against the
   node's real sysfs and a launcher's-eye `/dev` in which device B's VFIO cdev node is missing
   (its group node is there): A goes to iommufd, B stays on legacy VFIO — a mixed domain, as the
   hook produces one.
2. `nested QEMU`: started as libvirt starts it for that domain. The iommufd is not opened by QEMU:
   it is a fresh fd from the device plugin's one-shot socket (virt-launcher's `ReceiveIOMMUFD`),
   handed over as `-object iommufd,id=iommufd0,fd=N`; libvirt opens device A's cdev itself and
   passes it as `-device vfio-pci,iommufd=iommufd0,fd=M` (libvirt 12.9's command line for an
   iommufd hostdev names no `host`: `{"driver":"vfio-pci","iommufd":"iommufd0",…}` in
   `./dev.sh libvirt-check --argv`); B keeps `-device vfio-pci,host=BDF` (QEMU opens its group
   and the container). QMP must show both devices realized, A's `iommufd`
   link on iommufd0 and B's empty; `/proc/<qemu>/fd` must hold `/dev/iommu` exactly once — the
   handed-off open file, proved by toggling O_NONBLOCK on our copy and reading QEMU's fdinfo —
   A's cdev (the same way), B's group node and `/dev/vfio/vfio`, and neither B's cdev nor A's
   group node.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import stat
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from guestkit import CLI, CheckFailed, Edu, Runner, receive_fd, require, say
from lxml import etree

from sim.kubelet import KubeletStandIn

IOMMUFD_RESOURCE = "devices.kubevirt.io/iommufd"
RESOURCE = "example.com/edu"
NESTED_QEMU_TIMEOUT_S = 120.0
DECISION = "{https://kubevirt-iommufd.io/xmlns/decision/v1}"
# A slot the earlier checks have not used: each Allocate prepares a fresh fd.
LAUNCHER_SLOT = "iommufd-002"


EMULATOR = "/usr/libexec/qemu-kvm"


def domain_xml(edus: list[Edu]) -> str:
    """A cut-down domain as KubeVirt's virt-launcher writes it, with the edu devices."""
    hostdevs = []
    for index, edu in enumerate(edus):
        domain, bus, slot_function = edu.bdf.split(":")
        slot, function = slot_function.split(".")
        hostdevs.append(
            f"""    <hostdev type="pci" managed="no" mode="subsystem">
      <source>
        <address type="pci" domain="0x{domain}" bus="0x{bus}" slot="0x{slot}"
                 function="0x{function}"/>
      </source>
      <alias name="ua-hostdevice-edu{index}"/>
    </hostdev>"""
        )
    devices = "\n".join(hostdevs)
    return f"""<domain type="kvm" xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0">
  <name>default_vmi-edu</name>
  <uuid>7d3e4c8a-1b2f-4a6e-9c0d-5e8f7a6b5c4d</uuid>
  <memory unit="b">134217728</memory>
  <os>
    <type arch="x86_64" machine="pc-q35-rhel9.6.0">hvm</type>
  </os>
  <devices>
    <emulator>{EMULATOR}</emulator>
{devices}
    <controller type="usb" index="0" model="none"/>
    <memballoon model="none"/>
  </devices>
  <metadata>
    <kubevirt xmlns="http://kubevirt.io">
      <uid>9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d</uid>
    </kubevirt>
  </metadata>
  <features>
    <acpi/>
  </features>
  <vcpu placement="static">1</vcpu>
</domain>
"""


VMI = {
    "apiVersion": "kubevirt.io/v1",
    "kind": "VirtualMachineInstance",
    "metadata": {"name": "vmi-edu", "namespace": "default", "annotations": {}},
    "spec": {
        "domain": {
            "devices": {
                "hostDevices": [{"name": "edu0", "deviceName": RESOURCE}],
            }
        }
    },
}


def iommufd_devices(rewritten: bytes) -> list[tuple[str, bool]]:
    """(BDF, uses iommufd) of each PCI hostdev, as libvirt reads the rewritten domain: the
    domain-wide `<iommufd enabled='yes'/>` unless the device's `<driver iommufd=…>` says
    otherwise."""
    root = etree.fromstring(rewritten)
    element = root.find("iommufd")
    domain_wide = element is not None and element.get("enabled") == "yes"
    found = []
    for hostdev in root.iterfind("devices/hostdev[@type='pci']"):
        address = hostdev.find("source/address")
        assert address is not None
        parts = [int(address.get(k, "0"), 16) for k in ("domain", "bus", "slot", "function")]
        bdf = "{:04x}:{:02x}:{:02x}.{:x}".format(*parts)
        driver = hostdev.find("driver")
        override = None if driver is None else driver.get("iommufd")
        found.append((bdf, override == "yes" if override is not None else domain_wide))
    return found


@contextlib.contextmanager
def launcher_view(scratch: Path, edus: list[Edu]) -> Iterator[Path]:
    """A root for `hook --root`: the node's real /sys (bind-mounted) and a /dev with /dev/iommu,
    /dev/vfio/vfio, every edu's group node and the cdev node of each but the LAST edu — as in a
    launcher that got the last device by its group only."""
    root = Path(scratch) / "launcher-root"
    nodes = ["/dev/iommu", "/dev/vfio/vfio", *(f"/dev/vfio/{e.group}" for e in edus)]
    nodes += [e.cdev_path for e in edus[:-1]]
    for node in nodes:
        target = root / node.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(target, 0o600 | stat.S_IFCHR, Path(node).stat().st_rdev)
    (root / "sys").mkdir()
    subprocess.run(["mount", "--bind", "/sys", str(root / "sys")], check=True)
    try:
        yield root
    finally:
        subprocess.run(["umount", str(root / "sys")], check=False)


def run_hook(vmi: Mapping[str, object], domain: str, root: Path) -> bytes:
    """`hook on-define-domain` on a launcher's view under `root`: the rewritten domain."""
    out = subprocess.run(
        [
            CLI,
            "hook",
            "on-define-domain",
            "--vmi",
            json.dumps(vmi),
            "--domain",
            domain,
            "--root",
            str(root),
            "--cdev-check",
            "node",
            "--libvirt-version",
            "12.9.0",
        ],
        capture_output=True,
        check=False,
    )
    require(
        out.returncode == 0,
        f"hook exit {out.returncode}: {out.stderr.decode(errors='replace')[-400:]}",
    )
    return out.stdout


def check_hook(run: Runner, edus: list[Edu], scratch: Path) -> list[tuple[str, bool]]:
    """The hook decides per device on the real sysfs: A (cdev visible) iommufd, B legacy."""
    plan: list[tuple[str, bool]] = []
    first, last = edus[0], edus[-1]
    with run.check("hook: mixed domain (A iommufd, B legacy: no cdev node)") as check:
        require(len(edus) >= 2, "a mixed domain needs two edu devices (--edu 2 or more)")
        with launcher_view(scratch, edus) as root:
            rewritten = run_hook(VMI, domain_xml(edus), root)
        document = etree.fromstring(rewritten)
        decisions = document.findall(f"metadata/{DECISION}decision/{DECISION}hostdev")
        by_bdf = {d.get("bdf"): d for d in decisions}
        wanted_backend = {edu.bdf: "iommufd" for edu in edus[:-1]} | {last.bdf: "legacy"}
        for bdf, backend in wanted_backend.items():
            decision = by_bdf.get(bdf)
            require(decision is not None, f"no decision recorded for {bdf}")
            assert decision is not None
            require(
                decision.get("backend") == backend,
                f"{bdf}: backend {decision.get('backend')}, wanted {backend}"
                f" ({decision.get('reason')})",
            )
        reason = by_bdf[first.bdf].get("reason") or ""
        require(f"cdev {first.cdev}" in reason, f"{first.bdf}: reason {reason!r}")
        reason = by_bdf[last.bdf].get("reason") or ""
        require(last.cdev_path in reason, f"{last.bdf}: reason {reason!r}")
        plan = iommufd_devices(rewritten)
        wanted = [(edu.bdf, edu is not last) for edu in edus]
        require(plan == wanted, f"libvirt would use {plan}, wanted {wanted}")
        record = document.find(f"metadata/{DECISION}decision")
        assert record is not None
        check.detail = f"domain-iommufd={record.get('domain-iommufd')}; " + "; ".join(
            f"{d.get('bdf')}: {d.get('backend')} ({d.get('reason')})" for d in decisions
        )
        say(rewritten.decode())
    return plan


class Qmp:
    """QEMU's monitor socket: one command at a time, events skipped."""

    def __init__(self, path: Path) -> None:
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.settimeout(30)
        self._conn.connect(str(path))
        self._stream = self._conn.makefile("rwb")
        self._read()  # greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        while True:
            line = self._stream.readline()
            if not line:
                raise CheckFailed("QMP closed the connection")
            message: dict[str, Any] = json.loads(line)
            if "event" not in message:
                return message

    def execute(self, command: str, **arguments: Any) -> Any:
        request: dict[str, Any] = {"execute": command}
        if arguments:
            request["arguments"] = arguments
        self._stream.write(json.dumps(request).encode() + b"\n")
        self._stream.flush()
        answer = self._read()
        if "error" in answer:
            raise CheckFailed(f"QMP {command} {arguments}: {answer['error']}")
        return answer["return"]

    def close(self) -> None:
        self._stream.close()
        self._conn.close()


def wait_path(path: Path, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise CheckFailed(f"QEMU exited with {process.returncode} before its QMP socket")
        if time.monotonic() > deadline:
            raise CheckFailed(f"no QMP socket after {timeout:g} s")
        time.sleep(0.1)


def held_nodes(pid: int) -> dict[int, str]:
    """fd number -> target of each /dev node the process holds."""
    held = {}
    for link in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = str(link.readlink())
            if target.startswith("/dev/"):
                held[int(link.name)] = target
    return held


def fdinfo_flags(pid: int, fd: int) -> int:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "flags":
            return int(value.strip(), 8)
    raise CheckFailed(f"/proc/{pid}/fdinfo/{fd} has no flags line")


def same_open_file(pid: int, theirs: int, ours: int) -> bool:
    """Whether QEMU's fd `theirs` is our `ours` (one open file description, not a second open of
    the same node): file status flags belong to the description, so a flip of O_NONBLOCK on ours
    must show in QEMU's fdinfo, both ways. (kcmp(2) is not in the test kernel.)"""
    original = fcntl.fcntl(ours, fcntl.F_GETFL)
    seen = []
    try:
        for flags in (original ^ os.O_NONBLOCK, original):
            fcntl.fcntl(ours, fcntl.F_SETFL, flags)
            theirs_flags = fdinfo_flags(pid, theirs)
            seen.append(theirs_flags & os.O_NONBLOCK == flags & os.O_NONBLOCK)
    finally:
        fcntl.fcntl(ours, fcntl.F_SETFL, original)
    return all(seen)


def receive_launcher_fd(kubelet: KubeletStandIn) -> int:
    """Allocate one iommufd slot as the kubelet does for a launcher pod and take the prepared fd
    from the mounted one-shot socket, as virt-launcher's `ReceiveIOMMUFD` does."""
    response = kubelet.allocate(IOMMUFD_RESOURCE, [LAUNCHER_SLOT])
    (container,) = response.container_responses
    (mount,) = container.mounts
    return receive_fd(mount.host_path)


def qemu_argv(
    monitor: Path, plan: list[tuple[str, bool]], iommufd: int, cdevs: dict[str, int]
) -> list[str]:
    """libvirt's command line for the plan, cut down to what attaching the devices needs:
    iommufd devices get the cdev fd libvirt opened, legacy ones their address."""
    argv = [
        "qemu-system-x86_64",
        "-accel",
        "tcg",
        "-S",
        "-nographic",
        "-nodefaults",
        "-m",
        "128",
        "-qmp",
        f"unix:{monitor},server=on,wait=off",
        "-object",
        f"iommufd,id=iommufd0,fd={iommufd}",
    ]
    for index, (bdf, uses) in enumerate(plan):
        backend = f"iommufd=iommufd0,fd={cdevs[bdf]}" if uses else f"host={bdf}"
        argv += ["-device", f"vfio-pci,id=hostdev{index},{backend}"]
    return argv


def check_launcher_qemu(
    run: Runner,
    edus: list[Edu],
    plan: list[tuple[str, bool]],
    kubelet: KubeletStandIn,
    scratch: Path,
) -> None:
    name = "nested qemu: launcher's iommufd fd, A cdev fd, B host="
    with run.check(name) as check:
        by_bdf = {edu.bdf: edu for edu in edus}
        over_iommufd = [by_bdf[bdf] for bdf, uses in plan if uses]
        legacy = [by_bdf[bdf] for bdf, uses in plan if not uses]
        require(bool(over_iommufd) and bool(legacy), f"not a mixed plan: {plan}")
        opened: list[int] = []
        process: subprocess.Popen[bytes] | None = None
        log_path = scratch / "nested-qemu.log"
        try:
            iommufd = receive_launcher_fd(kubelet)
            opened.append(iommufd)
            cdevs = {}
            for edu in over_iommufd:
                cdevs[edu.bdf] = os.open(edu.cdev_path, os.O_RDWR | os.O_CLOEXEC)
                opened.append(cdevs[edu.bdf])
            monitor = scratch / "qmp.sock"
            argv = qemu_argv(monitor, plan, iommufd, cdevs)
            say("$ " + shlex.join(argv))
            with log_path.open("wb") as log:
                process = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=opened
                )
            wait_path(monitor, process, NESTED_QEMU_TIMEOUT_S)
            qmp = Qmp(monitor)
            try:
                backends = check_devices(qmp, plan)
                nodes = check_held_fds(process.pid, edus, over_iommufd, legacy, iommufd, cdevs)
                time.sleep(2)
                require(process.poll() is None, f"QEMU exited with {process.returncode}")
                qmp.execute("quit")
            finally:
                qmp.close()
            code = process.wait(timeout=30)
            require(code == 0, f"QEMU exited with {code} after quit")
            check.detail = f"{backends}; QEMU holds {nodes}"
        except BaseException:
            with contextlib.suppress(OSError):
                say(log_path.read_text(errors="replace")[-2000:])
            raise
        finally:
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
            for fd in opened:
                os.close(fd)


def check_devices(qmp: Qmp, plan: list[tuple[str, bool]]) -> str:
    """query-pci lists each hostdev as an edu; qom-get says it is realized and on which backend
    (the vfio-pci `iommufd` link: the object's path, or empty on legacy VFIO)."""
    pci = qmp.execute("query-pci")
    seen = {
        d["qdev_id"]: (d["id"]["vendor"], d["id"]["device"])
        for bus in pci
        for d in bus["devices"]
        if d.get("qdev_id")
    }
    parts = []
    for index, (bdf, uses) in enumerate(plan):
        qdev = f"hostdev{index}"
        require(seen.get(qdev) == (0x1234, 0x11E8), f"query-pci: {qdev} is {seen.get(qdev)}")
        path = f"/machine/peripheral/{qdev}"
        realized = qmp.execute("qom-get", path=path, property="realized")
        require(realized is True, f"{qdev} realized={realized}")
        link = qmp.execute("qom-get", path=path, property="iommufd")
        wanted = "/objects/iommufd0" if uses else ""
        require(link == wanted, f"{qdev} ({bdf}) iommufd link {link!r}, wanted {wanted!r}")
        parts.append(f"{qdev} {bdf} realized, {'iommufd ' + link if link else 'legacy VFIO'}")
    return "; ".join(parts)


def check_held_fds(
    pid: int,
    edus: list[Edu],
    over_iommufd: list[Edu],
    legacy: list[Edu],
    iommufd: int,
    cdevs: dict[str, int],
) -> str:
    held = held_nodes(pid)
    iommu = [fd for fd, target in held.items() if target == "/dev/iommu"]
    require(
        iommu == [iommufd], f"QEMU's /dev/iommu fds {iommu}, wanted only the handed-off {iommufd}"
    )
    require(
        Path(f"/proc/{pid}/fd/{iommufd}").stat().st_rdev == os.fstat(iommufd).st_rdev,
        "QEMU's fd is another device than the handed-off one",
    )
    require(
        same_open_file(pid, iommufd, iommufd),
        "QEMU's /dev/iommu is a second open, not the handed-off fd",
    )
    for edu in over_iommufd:
        fd = cdevs[edu.bdf]
        require(
            held.get(fd) == edu.cdev_path, f"QEMU's fd {fd} is {held.get(fd)}, not {edu.cdev_path}"
        )
        require(same_open_file(pid, fd, fd), f"QEMU's {edu.cdev_path} is not the fd libvirt passed")
    vfio = sorted(target for target in held.values() if target.startswith("/dev/vfio/"))
    wanted = sorted(
        [
            *(e.cdev_path for e in over_iommufd),
            *(f"/dev/vfio/{e.group}" for e in legacy),
            "/dev/vfio/vfio",
        ]
    )
    require(vfio == wanted, f"QEMU holds VFIO nodes {vfio}, wanted exactly {wanted}")
    unwanted = [*(e.cdev_path for e in legacy), *(f"/dev/vfio/{e.group}" for e in over_iommufd)]
    require(not set(unwanted) & set(vfio), f"QEMU holds {set(unwanted) & set(vfio)}")
    return (
        f"/dev/iommu once (fd {iommufd}, the handed-off open file),"
        f" {', '.join(vfio)}; not {', '.join(unwanted)}"
    )
