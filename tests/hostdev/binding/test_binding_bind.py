"""Binding and unbinding against fixture trees that react like the kernel (sim.kernel):
the writes made, every refusal, waiting, and the rollback when a step fails."""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from hostdev.assess import Backend, assess_function
from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess, Outcome, Status, bind_devices, unbind_devices
from hostdev.binding.plan import BindRequest
from hostdev.scan import scan_host
from sim.host import (
    CLASS_AUDIO,
    CLASS_ETHERNET,
    CLASS_NVME,
    CLASS_PCI_BRIDGE,
    CLASS_VGA,
    NVIDIA,
    BuildHost,
    FunctionSpec,
    HostSpec,
    hgx_h100,
    no_iommu,
    sriov_nic,
)
from sim.kernel import KernelSimulator, hold, release

B = Bdf.parse
GPU = "0000:3b:00.0"
AUDIO = "0000:3b:00.1"
BRIDGE = "0000:3a:00.0"
RELEASE = "6.12.0-kubevirt-iommufd"


def desktop_gpu(*extra: FunctionSpec, bridge_driver: str = "pcieport") -> HostSpec:
    """A VGA GPU on nvidia with its HD-audio function on snd_hda_intel, both in group 14 with
    the root port above them."""
    return HostSpec(
        (
            FunctionSpec(BRIDGE, 0x8086, 0x352A, CLASS_PCI_BRIDGE, driver=bridge_driver, group=14),
            FunctionSpec(
                GPU,
                NVIDIA,
                0x2204,
                CLASS_VGA,
                driver="nvidia",
                group=14,
                parent=BRIDGE,
                consumers=(AUDIO,),
            ),
            FunctionSpec(
                AUDIO, NVIDIA, 0x1AEF, CLASS_AUDIO, driver="snd_hda_intel", group=14, parent=BRIDGE
            ),
            *extra,
        )
    )


@dataclass
class Host:
    root: Path
    kernel: KernelSimulator
    host_root: Path
    now: float = 0.0
    on_sleep: Callable[[], None] | None = None

    def access(self) -> HostAccess:
        return HostAccess(
            root=self.root,
            host_root=self.host_root,
            writer=self.kernel,
            runner=self.kernel.run,
            sleep=self._sleep,
            clock=lambda: self.now,
        )

    def _sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep()

    def bind(self, *bdfs: str, driver: str = "auto", **options: float | bool) -> Outcome:
        requests = [BindRequest(B(b), driver) for b in bdfs]
        return bind_devices(self.access(), requests, **options)  # type: ignore[arg-type]

    def unbind(self, *bdfs: str, **options: str | bool | float | None) -> Outcome:
        return unbind_devices(self.access(), [B(b) for b in bdfs], **options)  # type: ignore[arg-type]

    def state(self) -> dict[str, tuple[str | None, str | None]]:
        """(driver, override) of every function."""
        devices = self.root / "sys/bus/pci/devices"
        return {
            p.name: (self.kernel.driver(p.name), self.kernel.override(p.name))
            for p in devices.iterdir()
        }


@pytest.fixture
def make_host(build_host: BuildHost, tmp_path: Path) -> Callable[..., Host]:
    def make(spec: HostSpec, aliases: str | None = None) -> Host:
        """With `aliases`, the host's / (modules.alias, modprobe) is a directory of its own, as
        in a container; without, it is / (where this kernel's modules.alias is not read, as
        its release differs from the simulated one)."""
        root = build_host(spec)
        host_root = Path("/")
        if aliases is not None:
            host_root = tmp_path / "host"
            modules = host_root / "lib/modules" / RELEASE
            modules.mkdir(parents=True, exist_ok=True)
            (modules / "modules.alias").write_text(aliases)
        native = {f.bdf: f.driver for f in spec.functions if f.driver is not None}
        return Host(root, KernelSimulator(root, native), host_root)

    return make


def test_gpu_moves_with_its_audio_function_in_the_kernels_order(
    make_host: Callable[..., Host],
) -> None:
    host = make_host(desktop_gpu())
    outcome = host.bind(GPU)
    assert outcome.status is Status.DONE
    assert host.kernel.commands == [["modprobe", "vfio_pci"]]
    assert host.kernel.writes == [
        (f"proc/driver/nvidia/gpus/{GPU}/unbindLock", "1"),
        (f"sys/bus/pci/devices/{GPU}/driver_override", "vfio-pci"),
        (f"sys/bus/pci/devices/{GPU}/driver/unbind", GPU),
        ("sys/bus/pci/drivers/vfio-pci/bind", GPU),
        (f"sys/bus/pci/devices/{AUDIO}/driver_override", "vfio-pci"),
        (f"sys/bus/pci/devices/{AUDIO}/driver/unbind", AUDIO),
        ("sys/bus/pci/drivers/vfio-pci/bind", AUDIO),
    ]
    assert host.state() == {
        BRIDGE: ("pcieport", None),
        GPU: ("vfio-pci", "vfio-pci"),
        AUDIO: ("vfio-pci", "vfio-pci"),
    }
    assert [(u.bdf, u.note) for u in outcome.plan.unchanged] == [
        (B(BRIDGE), "bridge, stays on pcieport")
    ]
    assert {m.bdf: m.why for m in outcome.plan.moves} == {
        B(GPU): "requested",
        B(AUDIO): f"consumer of {GPU} (device link)",
    }
    inventory = scan_host(host.root)
    gpu = inventory.function(B(GPU))
    assert gpu is not None
    assert assess_function(gpu, inventory).backend is Backend.IOMMUFD


def test_already_on_vfio_is_nothing_to_do(make_host: Callable[..., Host]) -> None:
    host = make_host(hgx_h100())
    outcome = host.bind("0000:18:00.0")
    assert outcome.status is Status.NOTHING_TO_DO
    assert host.kernel.writes == []
    assert host.kernel.commands == []


ALIASES = """\
alias pci:v000010DEd*sv*sd*bc03sc*i* nvidia
alias vfio_pci:v000010DEd*sv*sd*bc03sc*i* generic_gpu_vfio_pci
alias vfio_pci:v000010DEd00002204sv*sd*bc03sc*i* nvgrace_gpu_vfio_pci
alias vfio_pci:v000015B3d0000101Esv*sd*bc*sc*i* mlx5_vfio_pci
"""


def test_auto_loads_the_most_specific_variant_driver_chrooted(
    make_host: Callable[..., Host], tmp_path: Path
) -> None:
    host = make_host(desktop_gpu(), ALIASES)
    outcome = host.bind(GPU)
    assert outcome.status is Status.DONE
    assert sorted(host.kernel.commands) == [
        ["chroot", str(tmp_path / "host"), "modprobe", "nvgrace_gpu_vfio_pci"],
        ["chroot", str(tmp_path / "host"), "modprobe", "vfio_pci"],
    ]
    # The variant takes the GPU; the audio function is no GPU and gets vfio-pci.
    assert host.state()[GPU] == ("nvgrace_gpu_vfio_pci", "nvgrace_gpu_vfio_pci")
    assert host.state()[AUDIO] == ("vfio-pci", "vfio-pci")


def test_explicit_driver_is_spelled_as_registered(make_host: Callable[..., Host]) -> None:
    host = make_host(desktop_gpu())
    (host.root / "sys/bus/pci/drivers/vfio-pci").mkdir()
    outcome = host.bind(GPU, driver="vfio_pci")
    assert outcome.status is Status.DONE
    assert host.kernel.commands == []
    assert host.state()[GPU] == ("vfio-pci", "vfio-pci")


def test_modprobe_failure_changes_nothing(make_host: Callable[..., Host]) -> None:
    host = make_host(desktop_gpu(), ALIASES)
    host.kernel.missing_modules.add("nvgrace_gpu_vfio_pci")
    before = host.state()
    outcome = host.bind(GPU)
    assert outcome.status is Status.REFUSED
    (refusal,) = outcome.plan.refusals
    assert "modprobe nvgrace_gpu_vfio_pci` failed with exit status 1" in refusal.reason
    assert "not found" in refusal.reason
    assert "pass --driver vfio-pci" in refusal.fix
    assert host.state() == before
    assert host.kernel.writes == []


def test_a_failure_mid_way_puts_every_function_back(make_host: Callable[..., Host]) -> None:
    host = make_host(desktop_gpu())
    before = host.state()
    host.kernel.fail(lambda path, text: path.endswith("vfio-pci/bind") and text == AUDIO)
    outcome = host.bind(GPU)
    assert outcome.status is Status.FAILED_RESTORED
    assert outcome.error == (
        f"{AUDIO}: `echo {AUDIO} > /sys/bus/pci/drivers/vfio-pci/bind` failed: Input/output error"
    )
    assert host.state() == before
    assert [(str(r.bdf), r.driver, r.override, r.ok) for r in outcome.restored] == [
        (GPU, "nvidia", None, True),
        (AUDIO, "snd_hda_intel", None, True),
    ]
    # Undo runs in reverse: the audio function first, then the GPU back onto nvidia.
    assert host.kernel.writes[-5:] == [
        (f"sys/bus/pci/devices/{AUDIO}/driver_override", "\n"),
        ("sys/bus/pci/drivers/snd_hda_intel/bind", AUDIO),
        (f"sys/bus/pci/devices/{GPU}/driver/unbind", GPU),
        (f"sys/bus/pci/devices/{GPU}/driver_override", "\n"),
        ("sys/bus/pci/drivers/nvidia/bind", GPU),
    ]


def test_an_override_already_set_is_restored(make_host: Callable[..., Host]) -> None:
    host = make_host(desktop_gpu())
    (host.root / f"sys/bus/pci/devices/{AUDIO}/driver_override").write_text("snd_hda_intel\n")
    host.kernel.fail(lambda path, text: path.endswith("vfio-pci/bind") and text == AUDIO)
    outcome = host.bind(GPU)
    assert outcome.status is Status.FAILED_RESTORED
    assert host.state()[AUDIO] == ("snd_hda_intel", "snd_hda_intel")


def test_a_failed_restore_is_reported_as_such(make_host: Callable[..., Host]) -> None:
    host = make_host(desktop_gpu())
    host.kernel.fail(lambda path, text: path.endswith("vfio-pci/bind") and text == AUDIO)
    host.kernel.fail(lambda path, text: path.endswith("snd_hda_intel/bind"), errno.EBUSY)
    outcome = host.bind(GPU)
    assert outcome.status is Status.FAILED_NOT_RESTORED
    restored = {str(r.bdf): r for r in outcome.restored}
    assert restored[GPU].ok
    assert not restored[AUDIO].ok
    assert restored[AUDIO].problems == (
        f"{AUDIO}: `echo {AUDIO} > /sys/bus/pci/drivers/snd_hda_intel/bind` failed:"
        " Device or resource busy: another driver holds it",
    )


def test_a_driver_that_will_not_take_the_device_is_rolled_back(
    make_host: Callable[..., Host],
) -> None:
    host = make_host(desktop_gpu())
    host.kernel.rejects["vfio-pci"] = {GPU}
    before = host.state()
    outcome = host.bind(GPU)
    assert outcome.status is Status.FAILED_RESTORED
    assert outcome.error is not None and "the driver does not take this device" in outcome.error
    assert host.state() == before


def test_dry_run_lists_the_writes_and_changes_nothing(make_host: Callable[..., Host]) -> None:
    host = make_host(desktop_gpu(), ALIASES)
    before = host.state()
    outcome = host.bind(GPU, dry_run=True)
    assert outcome.status is Status.DRY_RUN
    assert outcome.modules == ("nvgrace_gpu_vfio_pci", "vfio_pci")
    assert [str(w) for w in outcome.writes][:4] == [
        f"echo 1 > /proc/driver/nvidia/gpus/{GPU}/unbindLock",
        f"echo nvgrace_gpu_vfio_pci > /sys/bus/pci/devices/{GPU}/driver_override",
        f"echo {GPU} > /sys/bus/pci/devices/{GPU}/driver/unbind",
        f"echo {GPU} > /sys/bus/pci/drivers/nvgrace_gpu_vfio_pci/bind",
    ]
    assert host.state() == before
    assert host.kernel.writes == [] and host.kernel.commands == []


# Refusals ------------------------------------------------------------------------------------


def _nvme_in_group(mounted: bool) -> Callable[[Host], None]:
    def setup(host: Host) -> None:
        device = (host.root / "sys/bus/pci/devices/0000:3b:00.2").resolve()
        disk = device / "nvme/nvme0/nvme0n1"
        disk.mkdir(parents=True)
        (disk / "dev").write_text("259:0\n")
        block = host.root / "sys/class/block"
        block.mkdir(parents=True)
        (block / "nvme0n1").symlink_to(disk)
        mountinfo = "22 1 259:0 / / rw,relatime - ext4 /dev/nvme0n1 rw\n" if mounted else ""
        (host.root / "proc/1").mkdir(parents=True)
        (host.root / "proc/1/mountinfo").write_text(mountinfo)

    return setup


def _nic_up(host: Host) -> None:
    net = (host.root / "sys/bus/pci/devices/0000:3b:00.2").resolve() / "net/eth0"
    net.mkdir(parents=True)
    (net / "operstate").write_text("up\n")


def _platform_device_on_a_driver(host: Host) -> None:
    device = host.root / "sys/devices/platform/dma0"
    driver = host.root / "sys/bus/platform/drivers/dw_dmac"
    driver.mkdir(parents=True)
    (device / "driver").symlink_to(driver)


NVME = FunctionSpec("0000:3b:00.2", 0x144D, 0xA80A, CLASS_NVME, driver="nvme", group=14)
NIC = FunctionSpec("0000:3b:00.2", 0x8086, 0x1572, CLASS_ETHERNET, driver="i40e", group=14)

REFUSALS = [
    pytest.param(
        desktop_gpu(),
        GPU,
        lambda host: hold(host.root, 4242, "nvidia-persiste", "/dev/nvidia0"),
        f"{GPU}: in use: pid 4242 (nvidia-persiste) holds /dev/nvidia0; stop those processes"
        " (or the VM), or pass --wait SECONDS",
        True,
        id="process-holds-nvidia-node",
    ),
    pytest.param(
        hgx_h100(),
        "0000:18:00.0",
        lambda host: hold(host.root, 7, "qemu-kvm", "/dev/vfio/devices/vfio0"),
        None,
        None,
        id="already-bound-needs-no-check",
    ),
    pytest.param(
        desktop_gpu(),
        GPU,
        lambda host: host.kernel.busy_locks.add(GPU),
        f"{GPU}: the NVIDIA driver refused the unbind lock: the GPU is in use; stop what uses it"
        " (nvidia-smi shows the processes), or pass --wait SECONDS",
        True,
        id="nvidia-unbind-lock-busy",
    ),
    pytest.param(
        sriov_nic(),
        "0000:5e:00.0",
        None,
        "0000:5e:00.0: has 4 SR-IOV virtual functions enabled; disable them first:"
        " echo 0 > /sys/bus/pci/devices/0000:5e:00.0/sriov_numvfs",
        True,
        id="sriov-vfs-enabled",
    ),
    pytest.param(
        desktop_gpu(NVME),
        GPU,
        _nvme_in_group(mounted=True),
        "0000:3b:00.2: a storage controller the host uses through nvme: nvme0n1 is mounted on /;"
        " stop using it on the host before moving it to vfio-pci",
        True,
        id="storage-in-group-mounted",
    ),
    pytest.param(
        desktop_gpu(NIC),
        GPU,
        _nic_up,
        "0000:3b:00.2: a network controller the host uses through i40e: network interface eth0"
        " is up; stop using it on the host before moving it to vfio-pci",
        True,
        id="nic-in-group-up",
    ),
    pytest.param(
        hgx_h100(),
        "0000:15:01.0",
        None,
        "0000:15:01.0: a bridge (class 0604): bridges cannot be given to a VM; bind the devices"
        " behind it instead",
        False,
        id="bridge-requested",
    ),
    pytest.param(
        desktop_gpu(bridge_driver="shpchp"),
        GPU,
        None,
        f"{BRIDGE}: a bridge (class 0604) in IOMMU group 14 with {GPU} is on shpchp, and bridges"
        " must not move; this group cannot be given to a VM on this host (an ACS-capable slot"
        " may split it)",
        False,
        id="bridge-on-another-driver-in-group",
    ),
    pytest.param(
        replace(desktop_gpu(), extra_groups={14: ("dma0",)}),
        GPU,
        _platform_device_on_a_driver,
        "IOMMU group 14 also holds dma0 on dw_dmac, which is not a PCI function and cannot"
        " move; this group cannot be given to a VM on this host",
        False,
        id="non-pci-member-on-a-driver",
    ),
    pytest.param(
        desktop_gpu(),
        "0000:99:00.0",
        None,
        "0000:99:00.0: no such PCI function on this host; check the address with"
        " `kubevirt-iommufd inspect`",
        False,
        id="unknown-address",
    ),
    pytest.param(
        no_iommu(),
        "0000:17:00.0",
        None,
        "0000:17:00.0: in no IOMMU group, so VFIO cannot take it; enable the IOMMU (VT-d/AMD-Vi"
        " in the firmware, intel_iommu=on or amd_iommu=on on the kernel command line)",
        False,
        id="no-iommu-group",
    ),
]


@pytest.mark.parametrize(("spec", "bdf", "setup", "message", "busy"), REFUSALS)
def test_refusals_name_the_device_and_the_fix(
    make_host: Callable[..., Host],
    spec: HostSpec,
    bdf: str,
    setup: Callable[[Host], None] | None,
    message: str | None,
    busy: bool | None,
) -> None:
    host = make_host(spec)
    if setup is not None:
        setup(host)
    before = host.state()
    outcome = host.bind(bdf)
    if message is None:
        assert outcome.status is Status.NOTHING_TO_DO
        return
    assert outcome.status is Status.REFUSED
    assert [str(r) for r in outcome.plan.refusals] == [message]
    assert [r.busy for r in outcome.plan.refusals] == [busy]
    assert host.state() == before
    # Only the unbind lock is ever written before a refusal, and it is given back.
    assert all("unbindLock" in path for path, _ in host.kernel.writes)


def test_an_unused_storage_controller_in_the_group_moves_too(
    make_host: Callable[..., Host],
) -> None:
    host = make_host(desktop_gpu(NVME))
    _nvme_in_group(mounted=False)(host)
    assert host.bind(GPU).status is Status.DONE
    assert host.state()["0000:3b:00.2"] == ("vfio-pci", "vfio-pci")


def test_holders_are_named_with_pid_and_command(make_host: Callable[..., Host]) -> None:
    host = make_host(hgx_h100())
    hold(host.root, 31, "qemu-kvm", "/dev/vfio/13", "/dev/vfio/devices/vfio0")
    outcome = host.unbind("0000:18:00.0")
    (refusal,) = outcome.plan.refusals
    assert [(h.pid, h.command, h.path) for h in refusal.holders] == [
        (31, "qemu-kvm", "/dev/vfio/13"),
        (31, "qemu-kvm", "/dev/vfio/devices/vfio0"),
    ]


def test_a_userspace_driver_holding_uio_is_named(make_host: Callable[..., Host]) -> None:
    nic = "0000:5e:00.0"
    host = make_host(
        HostSpec(
            (FunctionSpec(nic, 0x8086, 0x1572, CLASS_ETHERNET, driver="uio_pci_generic", group=7),)
        )
    )
    (host.root / "sys/bus/pci/devices" / nic / "uio/uio0").mkdir(parents=True)
    hold(host.root, 77, "dpdk-testpmd", "/dev/uio0")
    outcome = host.bind(nic)
    assert outcome.status is Status.REFUSED
    (refusal,) = outcome.plan.refusals
    assert [(h.pid, h.command, h.path) for h in refusal.holders] == [
        (77, "dpdk-testpmd", "/dev/uio0")
    ]
    assert host.state()[nic] == ("uio_pci_generic", None)


# Waiting -------------------------------------------------------------------------------------


def test_wait_polls_until_the_holder_exits(make_host: Callable[..., Host]) -> None:
    host = make_host(desktop_gpu())
    hold(host.root, 4242, "nvidia-smi", "/dev/nvidia0")
    sleeps: list[float] = []

    def exit_after_two_polls() -> None:
        sleeps.append(host.now)
        if len(sleeps) == 2:
            release(host.root, 4242)

    host.on_sleep = exit_after_two_polls
    outcome = host.bind(GPU, wait_seconds=10.0)
    assert outcome.status is Status.DONE
    assert sleeps == [1.0, 2.0]
    assert outcome.waited_seconds == 2.0


def test_wait_gives_up_after_the_deadline(make_host: Callable[..., Host]) -> None:
    host = make_host(desktop_gpu())
    host.kernel.busy_locks.add(GPU)
    outcome = host.bind(GPU, wait_seconds=2.5)
    assert outcome.status is Status.REFUSED
    assert host.now == 2.5
    assert host.state()[GPU] == ("nvidia", None)


def test_wait_does_not_wait_for_what_cannot_clear(make_host: Callable[..., Host]) -> None:
    host = make_host(hgx_h100())
    outcome = host.bind("0000:15:01.0", wait_seconds=30.0)
    assert outcome.status is Status.REFUSED
    assert host.now == 0.0


# Unbind --------------------------------------------------------------------------------------


def bound_desktop_gpu(make_host: Callable[..., Host]) -> Host:
    host = make_host(desktop_gpu())
    assert host.bind(GPU).status is Status.DONE
    host.kernel.writes.clear()
    return host


def test_unbind_leaves_no_driver_and_clears_the_override(make_host: Callable[..., Host]) -> None:
    host = bound_desktop_gpu(make_host)
    outcome = host.unbind(GPU)
    assert outcome.status is Status.DONE
    assert host.state()[GPU] == (None, None)
    assert host.state()[AUDIO] == (None, None)
    assert host.kernel.writes[:2] == [
        (f"sys/bus/pci/devices/{GPU}/driver_override", "\n"),
        (f"sys/bus/pci/devices/{GPU}/driver/unbind", GPU),
    ]


def test_unbind_reprobe_returns_to_the_native_drivers(make_host: Callable[..., Host]) -> None:
    host = bound_desktop_gpu(make_host)
    assert host.unbind(GPU, reprobe=True).status is Status.DONE
    assert host.state()[GPU] == ("nvidia", None)
    assert host.state()[AUDIO] == ("snd_hda_intel", None)


def test_unbind_to_a_driver_takes_companions_back_to_theirs(
    make_host: Callable[..., Host],
) -> None:
    host = bound_desktop_gpu(make_host)
    assert host.unbind(GPU, to_driver="nvidia").status is Status.DONE
    assert host.state()[GPU] == ("nvidia", "nvidia")
    assert host.state()[AUDIO] == ("snd_hda_intel", None)


def test_unbind_refused_while_a_vm_holds_the_device(make_host: Callable[..., Host]) -> None:
    host = make_host(hgx_h100())
    hold(host.root, 31, "qemu-kvm", "/dev/vfio/devices/vfio0")
    outcome = host.unbind("0000:18:00.0")
    assert outcome.status is Status.REFUSED
    assert host.state()["0000:18:00.0"] == ("vfio-pci", None)


def test_unbind_of_a_device_not_on_vfio_is_nothing_to_do(make_host: Callable[..., Host]) -> None:
    host = make_host(desktop_gpu())
    outcome = host.unbind(GPU)
    assert outcome.status is Status.NOTHING_TO_DO
    assert outcome.plan.unchanged[0].note == "not on a VFIO driver (on nvidia)"


def test_unbind_failure_rebinds_to_vfio(make_host: Callable[..., Host]) -> None:
    host = bound_desktop_gpu(make_host)
    host.kernel.fail(lambda path, text: path.endswith(f"{AUDIO}/driver/unbind"))
    outcome = host.unbind(GPU, reprobe=True)
    assert outcome.status is Status.FAILED_RESTORED
    assert host.state()[GPU] == ("vfio-pci", "vfio-pci")
    assert host.state()[AUDIO] == ("vfio-pci", "vfio-pci")
