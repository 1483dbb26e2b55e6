"""A VM started as KubeVirt's virt-launcher starts it, through a real libvirt 12.9 (issue 21).

The launcher's container is the libvirt 12.9 chroot that tests/system/libvirt12.py builds on the
host; run.py hands it to the guest read-only (`vng --rodir`) and names it with
`--libvirt-chroot`. What a container runtime and KubeVirt do to the launcher's container is done
to that chroot, then libvirt starts the VM in it as the launcher runs it:

1. the container's edits are applied: each device node the device plugin's Allocate or the
   claim's CDI spec names is made in a fresh tmpfs `/dev` (the node's own major:minor), each file
   mount is bind-mounted at its container path under a tmpfs `/var/run` (the iommufd socket
   inside KubeVirt's "public" emptyDir `/var/run/kubevirt`, the DRA metadata file under
   `/var/run/kubernetes.io/`), and the environment is taken as given;
2. virt-handler's `prepareVFIO` gives a non-root launcher its VFIO nodes (`/dev/vfio/vfio` mode
   0666, the other nodes to 107:107);
3. the launcher finds the devices of a `deviceName` VMI in `PCI_RESOURCE_<NAME>`, writes the
   domain with `<iommufd enabled='yes' fdgroup='iommu'/>` (the socket exists), and the hook
   rewrites it (`kubevirt-iommufd hook on-define-domain --root` on the container's `/dev`);
4. the launcher, uid 107, takes the iommufd fd from `/var/run/kubevirt/iommufd.sock` (as
   `ReceiveIOMMUFD` does) and associates it with the domain's fd group `iommu`;
5. libvirt 12.9 (`virsh -c qemu:///embed`, no daemon) runs as 107:107 with no capabilities and
   an RLIMIT_MEMLOCK set from outside, as virt-handler sets the launcher's; it defines the
   domain, is given the fd (`dom-fd-associate`) and starts it paused (TCG).

Then QEMU must be 107:107 with no capabilities, hold `/dev/iommu` exactly once — the handed-off
open file — with the device realized on `iommufd0`, and have its guest RAM charged to its own
memlock: `VmLck` = `VmPin` in `/proc/<qemu>/status`, at least the guest's memory. With the
per-user accounting a `/dev/iommu` opened by libvirt gets, `VmLck` stays 0 while `VmPin` grows.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from guestkit import CheckFailed, Edu, receive_fd, require, say
from launcher import domain_xml, run_hook, same_open_file
from libvirt12 import argv_copy
from lxml import etree

from hostdev.iommufd_handoff import CONTAINER_SOCKET_PATH, QEMU_GID, QEMU_UID
from hostdev.iommufd_handoff import LAUNCHER_PUBLIC_DIR as PUBLIC_DIR
from sim.container_runtime import ContainerEdits, Mount, apply_cdi_devices, in_runtime_order

EMBED_ROOT = "/var/lib/kubevirt-iommufd-embed"
QEMU_BINARY = "/usr/bin/qemu-system-x86_64"
FD_GROUP = "iommu"
DOMAIN_NAME = "default_vmi-edu"
# The guest's memory in domain_xml(): at least this much must be pinned, and charged to QEMU.
GUEST_MEMORY_KIB = 128 * 1024
# virsh's first call probes QEMU for its capabilities: 19 s in the guest under TCG.
VIRSH_TIMEOUT_S = 300.0
# Character devices every container gets: name -> (major, minor).
BASE_DEVICES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}


def public_dir() -> Mount:
    """KubeVirt's "public" emptyDir, a pod mount of the compute container (107's)."""
    directory = Path(tempfile.mkdtemp(prefix="kubevirt-public-"))
    os.chown(directory, QEMU_UID, QEMU_GID)
    return Mount(PUBLIC_DIR, str(directory))


def edits_from_allocate(responses: Sequence[object], pod_mounts: Sequence[Mount]) -> ContainerEdits:
    """The kubelet's view of AllocateResponses: device specs, envs and mounts of each one, with
    the pod's mounts, sorted by depth as containerd sorts a container's mounts."""
    nodes: list[str] = []
    env: dict[str, str] = {}
    mounts = list(pod_mounts)
    for response in responses:
        for container in response.container_responses:  # type: ignore[attr-defined]
            for device in container.devices:
                require(
                    device.container_path == device.host_path,
                    f"{device.host_path} is handed out at {device.container_path}",
                )
                nodes.append(device.host_path)
            env.update(container.envs)
            mounts += [Mount(m.container_path, m.host_path) for m in container.mounts]
    return ContainerEdits(env, tuple(dict.fromkeys(nodes)), in_runtime_order(mounts))


def edits_from_cdi(
    cdi_dir: Path, device_ids: Sequence[str], pod_mounts: Sequence[Mount]
) -> ContainerEdits:
    """The CDI devices `vendor/class=name` applied as the runtime applies them, from every spec
    file in the directory."""
    specs = [json.loads(path.read_text()) for path in sorted(cdi_dir.glob("*.json"))]
    return apply_cdi_devices(specs, device_ids, pod_mounts)


def inside(root: Path, container_path: str) -> Path:
    """A container path under the chroot; the chroot's /var/run is its /run (a symlink there)."""
    path = container_path
    if path.startswith("/var/run/"):
        path = path.removeprefix("/var")
    return root / path.lstrip("/")


@contextlib.contextmanager
def launcher_container(chroot: Path, edits: ContainerEdits) -> Iterator[Path]:
    """The chroot made the launcher's container; every mount undone after."""
    mounted: list[Path] = []

    def mount(*argv: str) -> None:
        subprocess.run(["mount", *argv], check=True)
        mounted.append(Path(argv[-1]))

    try:
        mount("-t", "proc", "-o", "nosuid,nodev,noexec", "proc", str(chroot / "proc"))
        dev = chroot / "dev"
        mount("-t", "tmpfs", "-o", "nosuid,mode=0755,size=1m", "launcher-dev", str(dev))
        for name, (major, minor) in BASE_DEVICES.items():
            _make_node(dev / name, os.makedev(major, minor), 0o666)
        (dev / "fd").symlink_to("/proc/self/fd")
        for node in edits.device_nodes:
            require(node.startswith("/dev/"), f"device node {node} is not under /dev")
            _make_node(chroot / node.lstrip("/"), Path(node).stat().st_rdev, 0o600)
        _prepare_vfio(dev / "vfio")
        mount("--rbind", "/sys", str(chroot / "sys"))
        for writable in ("run", "tmp", "var/tmp", EMBED_ROOT.lstrip("/")):
            mount("-t", "tmpfs", "-o", "nosuid,nodev,mode=1777", "launcher", str(chroot / writable))
        os.chown(chroot / EMBED_ROOT.lstrip("/"), QEMU_UID, QEMU_GID)
        # The launcher image has the qemu user; Debian's chroot has not.
        for name, line in (
            ("passwd", f"qemu:x:{QEMU_UID}:{QEMU_GID}:qemu user:/tmp:/usr/sbin/nologin\n"),
            ("group", f"qemu:x:{QEMU_GID}:\n"),
        ):
            copy = chroot / "run" / f"launcher-{name}"
            copy.write_text((chroot / "etc" / name).read_text() + line)
            mount("--bind", str(copy), str(chroot / "etc" / name))
        # In the runtime's order: a file mount inside the emptyDir made before the emptyDir's
        # own mount would be hidden by it, and the launcher would find no socket.
        for each in edits.mounts:
            target = inside(chroot, each.container_path)
            # Only /run is writable in the read-only chroot; KubeVirt's emptyDir and the DRA
            # metadata directory (/var/run/kubernetes.io/…) are both under it.
            require(
                chroot / "run" in target.parents,
                f"mount {each.container_path} is outside /var/run",
            )
            if Path(each.host_path).is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()
            mount("--bind", each.host_path, str(target))
        yield chroot
    finally:
        for point in reversed(mounted):
            subprocess.run(["umount", "--lazy", str(point)], check=False)


def _make_node(path: Path, rdev: int, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | mode, rdev)
    path.chmod(mode)  # mknod honours the umask


def _prepare_vfio(vfio: Path) -> None:
    if not vfio.is_dir():
        return
    for node in vfio.rglob("*"):
        if node.name == "vfio" and node.parent == vfio:
            node.chmod(0o666)
        elif node.is_char_device():
            os.chown(node, QEMU_UID, QEMU_GID)


def device_bdfs(edits: ContainerEdits, variable: str) -> list[str]:
    """The BDFs the launcher reads for a `deviceName` VMI's resource."""
    value = edits.env.get(variable)
    require(bool(value), f"no {variable} in the container's environment: {sorted(edits.env)}")
    assert value is not None
    return value.split(",")


def launcher_domain(edus: list[Edu]) -> str:
    """virt-launcher's domain with the iommufd fd group it writes when the socket exists."""
    document = etree.fromstring(domain_xml(edus).encode())
    devices = document.find("devices")
    assert devices is not None
    devices.addprevious(etree.Element("iommufd", enabled="yes", fdgroup=FD_GROUP))
    return etree.tostring(document).decode()


def startable_copy(rewritten: etree._Element) -> str:
    """The chroot's QEMU and machine type (libvirt12.argv_copy) and TCG: no KVM in the guest."""
    copy, changes = argv_copy(rewritten)
    copy.set("type", "qemu")
    say(f"launcher domain: {'; '.join(changes)}; type kvm -> qemu (TCG)")
    return etree.tostring(copy).decode()


@contextlib.contextmanager
def as_launcher_user() -> Iterator[None]:
    """This process's effective ids made the launcher's for a connect(2): the hand-off sees 107."""
    os.setegid(QEMU_GID)
    os.seteuid(QEMU_UID)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def receive_as_launcher(root: Path) -> int:
    with as_launcher_user():
        return receive_fd(str(inside(root, CONTAINER_SOCKET_PATH)))


class Virsh:
    """`virsh -c qemu:///embed` in the container as 107:107 with no capabilities, one session:
    the fd association lives as long as the connection."""

    def __init__(self, chroot: Path, pass_fds: Sequence[int]) -> None:
        argv = [
            "chroot",
            str(chroot),
            "prlimit",
            # virt-handler raises the launcher's limit from outside; libvirt, unprivileged, may
            # then only lower it, to the guest's memory + 1 GiB for VFIO: a hard limit below
            # that fails the start ("cannot limit locked memory … Operation not permitted").
            "--memlock=unlimited:unlimited",
            "setpriv",
            f"--reuid={QEMU_UID}",
            f"--regid={QEMU_GID}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "env",
            "-i",
            "HOME=/tmp",
            "PATH=/usr/bin:/bin",
            "LC_ALL=C.UTF-8",
            "virsh",
            "-c",
            f"qemu:///embed?root={EMBED_ROOT}",
        ]
        say("$ " + " ".join(argv))
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=pass_fds,
        )
        self._marks = 0
        self._partial = b""

    def run(self, command: str, *, timeout: float = VIRSH_TIMEOUT_S) -> str:
        """One command's output; an `error:` line in it fails the check."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self._marks += 1
        mark = f"kubevirt-iommufd-mark-{self._marks}"
        self.process.stdin.write(f"{command}\necho {mark}\n".encode())
        self.process.stdin.flush()
        # Raw reads: a buffered readline() would keep lines select() can no longer see.
        stdout = self.process.stdout.fileno()
        lines: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            *complete, self._partial = self._partial.split(b"\n")
            decoded = [line.decode(errors="replace") for line in complete]
            if mark in (line.strip() for line in decoded):
                lines += decoded[: [line.strip() for line in decoded].index(mark)]
                break
            lines += decoded
            ready, _, _ = select.select([stdout], [], [], 1.0)
            if not ready:
                if time.monotonic() > deadline:
                    raise CheckFailed(f"virsh {command!r}: no answer in {timeout:g} s: {lines}")
                continue
            chunk = os.read(stdout, 65536)
            if not chunk:
                raise CheckFailed(f"virsh exited during {command!r}: {' '.join(lines)[-800:]}")
            self._partial += chunk
        output = "\n".join(lines)
        say(f"virsh> {command}\n{output.rstrip()}")
        errors = [line for line in lines if line.startswith("error:")]
        require(not errors, f"virsh {command!r}: {' '.join(errors)}")
        return output

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            with contextlib.suppress(OSError):
                self.process.stdin.write(b"quit\n")
                self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def qemu_pid(name: str) -> int:
    """The QEMU libvirt started for the domain (`-name guest=<name>,…`)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if argv[0].decode().endswith("qemu-system-x86_64") and any(
                arg.startswith(f"guest={name},".encode()) for arg in argv
            ):
                return int(proc.name)
    raise CheckFailed(f"no QEMU process for domain {name}")


def status_fields(pid: int) -> dict[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def kib(value: str) -> int:
    number, unit = value.split()
    require(unit == "kB", f"unexpected unit in {value!r}")
    return int(number)


def held_iommu(pid: int) -> list[int]:
    """QEMU's fds on /dev/iommu."""
    iommu = []
    for link in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if link.readlink() == Path("/dev/iommu"):
                iommu.append(int(link.name))
    return iommu


def memlock(pid: int) -> tuple[int, int]:
    """(VmLck, VmPin) in kB: what is charged to the process's memlock, and what it has pinned."""
    status = status_fields(pid)
    return kib(status["VmLck"]), kib(status["VmPin"])


def check_qemu(pid: int, iommufd: int, monitor: Virsh) -> str:
    """QEMU as the launcher's: its ids, capabilities, the handed-off fd and its memlock."""
    status = status_fields(pid)
    require(status["Uid"].split() == [str(QEMU_UID)] * 4, f"QEMU's uids {status['Uid']}, not 107")
    require(status["CapEff"] == "0" * 16, f"QEMU has capabilities {status['CapEff']}")
    iommu = held_iommu(pid)
    require(len(iommu) == 1, f"QEMU holds /dev/iommu {len(iommu)} times (fds {iommu})")
    require(
        same_open_file(pid, iommu[0], iommufd),
        "QEMU's /dev/iommu is another open, not the handed-off fd",
    )
    cmdline = (Path(f"/proc/{pid}/cmdline").read_bytes()).split(b"\0")
    objects = [
        json.loads(value)
        for option, value in itertools.pairwise(cmdline)
        if option == b"-object" and value.startswith(b"{")
    ]
    wanted = {"qom-type": "iommufd", "id": "iommufd0", "fd": str(iommu[0])}
    require(wanted in objects, f"no -object {wanted} in QEMU's command line: {objects}")
    answer = monitor.run(
        f"qemu-monitor-command {DOMAIN_NAME} '"
        '{"execute":"qom-get","arguments":{"path":"/machine/peripheral/'
        'ua-hostdevice-edu0","property":"iommufd"}}'
        "'"
    )
    # libvirt's own log lines (a "tainted: custom-monitor" warning) share the stream.
    replies = [json.loads(line) for line in answer.splitlines() if line.startswith("{")]
    require(len(replies) == 1, f"QMP qom-get answered {answer!r}")
    link = replies[0].get("return")
    require(link == "/objects/iommufd0", f"the device's iommufd link is {link!r}")
    locked, pinned = memlock(pid)
    require(
        pinned >= GUEST_MEMORY_KIB,
        f"VmPin {pinned} kB: the guest's {GUEST_MEMORY_KIB} kB are not pinned",
    )
    require(
        locked == pinned,
        f"VmLck {locked} kB != VmPin {pinned} kB: the pinned RAM is not charged to QEMU's own"
        " memlock (per-user accounting: RLIMIT_MODE was not per-process on the fd)",
    )
    return (
        f"QEMU pid {pid} uid 107 CapEff 0; /dev/iommu once (fd {iommu[0]}, the handed-off open"
        f" file) as iommufd0, the device linked to it; VmLck {locked} kB = VmPin {pinned} kB"
    )


def start_as_launcher(
    chroot: Path,
    vmi: Mapping[str, object],
    resource_env: str,
    edits: ContainerEdits,
    edus: list[Edu],
    *,
    control: bool = False,
) -> str:
    """Steps 1-5 of the module's docstring and the checks on QEMU; the VM destroyed after.
    `control`: then started again on a `/dev/iommu` opened as libvirt opens it (its accounting
    left per-user), whose pinned RAM must NOT show in QEMU's own `VmLck`: the figure the main
    check compares is the accounting mode's doing."""
    by_bdf = {edu.bdf: edu for edu in edus}
    with launcher_container(chroot, edits) as root:
        bdfs = device_bdfs(edits, resource_env)
        unknown = [bdf for bdf in bdfs if bdf not in by_bdf]
        require(not unknown, f"{resource_env} names {unknown}, not an edu device")
        rewritten = etree.fromstring(
            run_hook(vmi, launcher_domain([by_bdf[b] for b in bdfs]), root)
        )
        backends = [
            record.get("backend")
            for record in rewritten.iter("{https://kubevirt-iommufd.io/xmlns/decision/v1}hostdev")
        ]
        require(backends == ["iommufd"] * len(bdfs), f"the hook decided {backends}")
        (root / "tmp" / "domain.xml").write_text(startable_copy(rewritten))
        opened = [receive_as_launcher(root)]
        virsh: Virsh | None = None
        try:
            if control:
                opened.append(os.open("/dev/iommu", os.O_RDWR | os.O_CLOEXEC))
            virsh = Virsh(root, opened)
            started = time.monotonic()
            virsh.run("define /tmp/domain.xml")
            virsh.run(f"dom-fd-associate {DOMAIN_NAME} --name {FD_GROUP} --pass-fds {opened[0]}")
            virsh.run(f"start --paused {DOMAIN_NAME}")
            took = time.monotonic() - started
            detail = check_qemu(qemu_pid(DOMAIN_NAME), opened[0], virsh)
            virsh.run(f"destroy {DOMAIN_NAME}")
            if control:
                virsh.run(
                    f"dom-fd-associate {DOMAIN_NAME} --name {FD_GROUP} --pass-fds {opened[1]}"
                )
                virsh.run(f"start --paused {DOMAIN_NAME}")
                detail += "; " + check_per_user_control(qemu_pid(DOMAIN_NAME), opened[1])
                virsh.run(f"destroy {DOMAIN_NAME}")
            return f"{resource_env}={','.join(bdfs)}; libvirt define+start {took:.1f} s; {detail}"
        finally:
            if virsh is not None:
                virsh.close()
            for fd in opened:
                os.close(fd)


def check_per_user_control(pid: int, iommufd: int) -> str:
    """QEMU on a per-user `/dev/iommu`: its RAM pinned all the same, charged elsewhere."""
    iommu = held_iommu(pid)
    require(
        len(iommu) == 1 and same_open_file(pid, iommu[0], iommufd),
        f"control: QEMU's /dev/iommu fds {iommu} are not the per-user fd",
    )
    locked, pinned = memlock(pid)
    require(pinned >= GUEST_MEMORY_KIB, f"control: VmPin {pinned} kB, the RAM is not pinned")
    require(
        locked == 0,
        f"control: VmLck {locked} kB on a per-user fd (VmPin {pinned} kB): the comparison"
        " does not tell the accounting modes apart",
    )
    return (
        f"control, an fd left per-user as libvirt opens it: VmLck {locked} kB, VmPin {pinned} kB"
        " (charged to uid 107's shared counter)"
    )
