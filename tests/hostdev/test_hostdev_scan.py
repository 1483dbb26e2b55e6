"""Discovery against kernel-shaped trees: one test per scenario, then each sysfs quirk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from hostdev.bdf import Bdf
from hostdev.errors import HostReadError, RootNotFound
from hostdev.model import GroupMember
from hostdev.scan import read_function, refresh_host, scan_host
from sim.host import (
    CLASS_3D,
    NVIDIA,
    BuildHost,
    FunctionSpec,
    HostSpec,
    bind_driver,
    hgx_h100,
    scale,
    unbind_driver,
    vga_with_audio,
)

ScenarioRoot = Callable[[str], Path]
B = Bdf.parse


def device_dir(root: Path, bdf: str) -> Path:
    return (root / "sys/bus/pci/devices" / bdf).resolve()


def test_hgx_h100_has_eight_gpus_with_cdevs_on_two_numa_nodes(scenario_root: ScenarioRoot) -> None:
    inventory = scan_host(scenario_root("hgx-h100"))
    gpus = [f for f in inventory.functions if f.vendor_id == NVIDIA]
    assert [str(g.bdf) for g in gpus] == [
        "0000:18:00.0",
        "0000:2a:00.0",
        "0000:3a:00.0",
        "0000:5d:00.0",
        "0000:9a:00.0",
        "0000:ab:00.0",
        "0000:ba:00.0",
        "0000:db:00.0",
    ]
    first = gpus[0]
    assert (first.device_id, first.subsystem_vendor_id, first.subsystem_device_id) == (
        0x2330,
        0x10DE,
        0x16C1,
    )
    assert (first.class_code, first.revision, first.driver) == (0x030200, 0xA1, "vfio-pci")
    assert first.modalias == "pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00"
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.vfio_cdev for g in gpus] == [f"vfio{i}" for i in range(8)]
    assert all(g.vfio_cdev_present for g in gpus)
    assert first.cdev_path == "/dev/vfio/devices/vfio0"
    # Two GPUs per PCIe switch: the first two share their upstream switch port.
    assert [str(b) for b in gpus[0].upstream] == ["0000:15:01.0", "0000:16:00.0", "0000:17:00.0"]
    assert gpus[0].upstream[:2] == gpus[1].upstream[:2]
    assert gpus[1].upstream[:2] != gpus[2].upstream[:2]
    group = inventory.group_of(first)
    assert group is not None
    assert group.members == (GroupMember("0000:18:00.0", first.bdf, "vfio-pci"),)
    assert group.viable and group.legacy_node_present
    caps = inventory.capabilities
    assert caps.iommu and caps.iommufd and caps.iommufd_node_present
    assert caps.iommufd_devnum == "10:257"
    assert caps.vfio_cdev is True and caps.legacy_vfio_node_present
    assert caps.kernel_release == "6.12.0-kubevirt-iommufd"


def test_vga_gpu_shares_a_group_with_its_audio_function(scenario_root: ScenarioRoot) -> None:
    inventory = scan_host(scenario_root("vga-audio"))
    gpu = inventory.function(B("0000:3b:00.0"))
    assert gpu is not None
    assert gpu.consumers == (B("0000:3b:00.1"),)
    group = inventory.group(14)
    assert group is not None
    assert [m.name for m in group.members] == ["0000:3b:00.0", "0000:3b:00.1"]
    assert not group.viable
    assert group.blockers == (GroupMember("0000:3b:00.1", B("0000:3b:00.1"), "snd_hda_intel"),)


def test_gpu_on_the_nvidia_driver_has_no_vfio_state(scenario_root: ScenarioRoot) -> None:
    inventory = scan_host(scenario_root("nvidia-driver"))
    (gpu,) = inventory.functions
    assert gpu.driver == "nvidia"
    assert gpu.vfio_cdev is None and not gpu.vfio_sysfs_without_cdev
    assert inventory.capabilities.vfio_cdev is None  # nothing on VFIO to tell either way
    assert not inventory.capabilities.legacy_vfio_node_present


def test_legacy_only_host_shows_vfio_entries_without_cdevs(scenario_root: ScenarioRoot) -> None:
    inventory = scan_host(scenario_root("legacy-only"))
    gpu = inventory.function(B("0000:18:00.0"))
    assert gpu is not None
    assert gpu.vfio_cdev is None and gpu.vfio_sysfs_without_cdev
    caps = inventory.capabilities
    assert (caps.iommu, caps.iommufd, caps.iommufd_node_present, caps.vfio_cdev) == (
        True,
        False,
        False,
        False,
    )
    assert caps.iommufd_devnum is None and caps.legacy_vfio_node_present
    assert caps.kernel_release == "6.1.0-18-amd64"


def test_host_without_iommu_has_functions_but_no_groups(scenario_root: ScenarioRoot) -> None:
    inventory = scan_host(scenario_root("no-iommu"))
    assert [str(f.bdf) for f in inventory.functions] == ["0000:17:00.0"]
    assert inventory.functions[0].iommu_group is None
    assert inventory.groups == ()
    assert not inventory.capabilities.iommu


def test_sriov_pf_and_its_vfs(scenario_root: ScenarioRoot) -> None:
    inventory = scan_host(scenario_root("sriov"))
    pf = inventory.function(B("0000:5e:00.0"))
    assert pf is not None and pf.sriov is not None
    assert (pf.sriov.total_vfs, pf.sriov.num_vfs, pf.physfn) == (8, 4, None)
    vfs = [f for f in inventory.functions if f.physfn == pf.bdf]
    assert [str(v.bdf) for v in vfs] == [f"0000:5e:00.{i}" for i in range(2, 6)]
    assert all(v.sriov is None and v.is_virtual_function and v.vfio_cdev for v in vfs)


def test_scale_host_is_complete(build_host: BuildHost) -> None:
    inventory = scan_host(build_host(scale(4096)))
    assert len(inventory.functions) == 4096
    assert len(inventory.groups) == 512
    assert all(len(g.members) == 8 and g.viable for g in inventory.groups)
    assert len({f.vfio_cdev for f in inventory.functions}) == 4096


def test_empty_root_is_an_empty_host(tmp_path: Path) -> None:
    inventory = scan_host(tmp_path)
    assert inventory.functions == () and inventory.groups == ()
    caps = inventory.capabilities
    assert not caps.iommu and not caps.iommufd and caps.kernel_release is None


def test_missing_root_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RootNotFound, match="is not a directory; pass --root"):
        scan_host(tmp_path / "nope")


def test_ids_come_from_the_attribute_files_when_modalias_is_missing(
    build_host: BuildHost,
) -> None:
    root = build_host(vga_with_audio())
    (device_dir(root, "0000:3b:00.1") / "modalias").unlink()
    audio = scan_host(root).function(B("0000:3b:00.1"))
    assert audio is not None
    assert (audio.vendor_id, audio.device_id, audio.class_code) == (NVIDIA, 0x1AEF, 0x040300)
    assert (audio.subsystem_vendor_id, audio.subsystem_device_id) == (0x1458, 0x403B)
    assert audio.modalias is None


def test_unknown_numa_node_reads_as_none(build_host: BuildHost) -> None:
    spec = HostSpec((FunctionSpec("0000:01:00.0", NVIDIA, 0x2330, CLASS_3D, group=1),))
    (function,) = scan_host(build_host(spec)).functions
    assert function.numa_node is None  # the kernel writes -1


def test_cdev_entry_without_its_dev_node(build_host: BuildHost) -> None:
    root = build_host(hgx_h100())
    (root / "dev/vfio/devices/vfio1").unlink()
    inventory = scan_host(root)
    gpu = inventory.function(B("0000:2a:00.0"))
    assert gpu is not None
    assert (gpu.vfio_cdev, gpu.vfio_cdev_present) == ("vfio1", False)
    assert inventory.capabilities.vfio_cdev is True


def test_missing_group_node_and_container(build_host: BuildHost) -> None:
    root = build_host(hgx_h100())
    (root / "dev/vfio/13").unlink()
    (root / "dev/vfio/vfio").unlink()
    inventory = scan_host(root)
    group = inventory.group(13)
    assert group is not None and not group.legacy_node_present
    assert not inventory.capabilities.legacy_vfio_node_present


def test_group_member_that_is_not_a_pci_function(build_host: BuildHost) -> None:
    spec = replace(vga_with_audio(), extra_groups={14: ("INT3450:00",)})
    group = scan_host(build_host(spec)).group(14)
    assert group is not None
    assert GroupMember("INT3450:00", None, None) in group.members


def test_iommufd_known_from_sysfs_alone(build_host: BuildHost) -> None:
    root = build_host(hgx_h100())
    (root / "dev/iommu").unlink()
    caps = scan_host(root).capabilities
    assert caps.iommufd and not caps.iommufd_node_present


def test_device_removed_during_the_scan_is_skipped(build_host: BuildHost) -> None:
    root = build_host(vga_with_audio())
    target = device_dir(root, "0000:3b:00.1")
    for entry in target.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            continue
        entry.unlink()
    target.rmdir()
    assert [str(f.bdf) for f in scan_host(root).functions] == ["0000:3b:00.0"]


@pytest.mark.parametrize(
    ("attribute", "content", "message"),
    [
        ("revision", "zz\n", "expected a hex number like 0x10de, found b'zz\\n'"),
        ("numa_node", "one\n", "expected a decimal number"),
        ("sriov_totalvfs", "lots\n", "expected a decimal number"),
    ],
    ids=["revision", "numa-node", "sriov"],
)
def test_malformed_attribute_names_the_file(
    build_host: BuildHost, attribute: str, content: str, message: str
) -> None:
    root = build_host(vga_with_audio())
    (device_dir(root, "0000:3b:00.0") / attribute).write_text(content)
    with pytest.raises(HostReadError) as caught:
        scan_host(root)
    assert caught.value.path.endswith(f"0000:3b:00.0/{attribute}")
    assert message in str(caught.value)
    assert "run as root" in str(caught.value)


def test_unreadable_attribute_names_the_file(build_host: BuildHost) -> None:
    root = build_host(vga_with_audio())
    # Root reads through file modes, so make the entry unreadable as a file by any user.
    revision = device_dir(root, "0000:3b:00.0") / "revision"
    revision.unlink()
    revision.mkdir()
    with pytest.raises(HostReadError, match=r"0000:3b:00.0/revision: Is a directory"):
        scan_host(root)


def test_required_attribute_missing_without_modalias(build_host: BuildHost) -> None:
    root = build_host(vga_with_audio())
    directory = device_dir(root, "0000:3b:00.0")
    (directory / "modalias").unlink()
    (directory / "vendor").unlink()
    with pytest.raises(HostReadError, match=r"0000:3b:00.0/vendor: missing"):
        scan_host(root)


@pytest.mark.parametrize(
    "name", ["..0000:3b:00.0", "0000:3B:00.0", "not-a-device"], ids=["dots", "upper", "word"]
)
def test_entry_that_is_not_a_pci_address_is_refused(build_host: BuildHost, name: str) -> None:
    root = build_host(vga_with_audio())
    (root / "sys/bus/pci/devices" / name).symlink_to("../../../devices/pci0000:00/0000:3b:00.0")
    with pytest.raises(HostReadError, match="not a PCI address"):
        scan_host(root)


def test_group_directory_that_is_not_a_number_is_refused(build_host: BuildHost) -> None:
    root = build_host(vga_with_audio())
    (root / "sys/kernel/iommu_groups/..x").mkdir()
    with pytest.raises(HostReadError, match="not an IOMMU group number"):
        scan_host(root)


def test_unbind_and_bind_move_the_kernel_state(build_host: BuildHost) -> None:
    root = build_host(hgx_h100())
    unbind_driver(root, "0000:2a:00.0")
    gpu = scan_host(root).function(B("0000:2a:00.0"))
    assert gpu is not None
    assert (gpu.driver, gpu.vfio_cdev, gpu.vfio_cdev_present) == (None, None, False)
    assert not (root / "dev/vfio/15").exists()
    assert not (root / "dev/vfio/devices/vfio1").exists()
    bind_driver(root, "0000:2a:00.0", "vfio-pci")
    gpu = scan_host(root).function(B("0000:2a:00.0"))
    assert gpu is not None
    assert (gpu.driver, gpu.vfio_cdev, gpu.vfio_cdev_present) == ("vfio-pci", "vfio1", True)
    assert (root / "dev/vfio/15").exists()


def test_group_node_stays_while_a_member_is_on_vfio(build_host: BuildHost) -> None:
    spec = replace(
        vga_with_audio(),
        functions=(
            vga_with_audio().functions[0],
            replace(vga_with_audio().functions[1], driver="vfio-pci"),
        ),
    )
    root = build_host(spec)
    unbind_driver(root, "0000:3b:00.1")
    assert (root / "dev/vfio/14").exists()
    unbind_driver(root, "0000:3b:00.0")
    assert not (root / "dev/vfio/14").exists()


@pytest.mark.parametrize(
    "change",
    ["unbind", "bind-nvidia", "remove-cdev-node", "remove-group-node", "remove-iommu", "rebind"],
)
def test_refresh_of_changed_functions_equals_a_full_scan(
    build_host: BuildHost, change: str
) -> None:
    root = build_host(hgx_h100())
    before = scan_host(root)
    target = "0000:9a:00.0"
    if change == "unbind":
        unbind_driver(root, target)
    elif change == "bind-nvidia":
        unbind_driver(root, target)
        bind_driver(root, target, "nvidia")
    elif change == "remove-cdev-node":
        (root / "dev/vfio/devices/vfio4").unlink()
    elif change == "remove-group-node":
        (root / "dev/vfio/25").unlink()
    elif change == "remove-iommu":
        (root / "dev/iommu").unlink()
    else:
        unbind_driver(root, target)
        bind_driver(root, target, "vfio-pci")
    refreshed = refresh_host(root, before, [B(target)])
    assert refreshed == scan_host(root)
    if change in ("remove-cdev-node", "remove-group-node", "remove-iommu"):
        # Node presence is re-checked for every function, so no function needs naming.
        assert refresh_host(root, before, []) == scan_host(root)


def test_refresh_drops_a_removed_function(build_host: BuildHost) -> None:
    root = build_host(vga_with_audio())
    before = scan_host(root)
    (root / "sys/bus/pci/devices/0000:3b:00.1").unlink()
    (root / "sys/kernel/iommu_groups/14/devices/0000:3b:00.1").unlink()
    refreshed = refresh_host(root, before, [B("0000:3b:00.1")])
    assert [str(f.bdf) for f in refreshed.functions] == ["0000:3b:00.0"]
    group = refreshed.group(14)
    assert group is not None and group.viable


def test_read_function_reads_one_as_the_scan_does(scenario_root: ScenarioRoot) -> None:
    root = scenario_root("vga-audio")
    inventory = scan_host(root)
    for function in inventory.functions:
        assert read_function(root, function.bdf) == function
    assert read_function(root, B("0000:99:00.0")) is None


def test_a_function_answering_enodev_is_being_removed_and_skipped(
    build_host: BuildHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    root = build_host(vga_with_audio())
    real_open = os.open
    audio = device_dir(root, "0000:3b:00.1")

    def open_(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if (
            path == "revision"
            and dir_fd is not None
            and Path(f"/proc/self/fd/{dir_fd}").readlink() == audio
        ):
            raise OSError(errno.ENODEV, "No such device")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_)
    assert [str(f.bdf) for f in scan_host(root).functions] == ["0000:3b:00.0"]


def test_refresh_keeps_untouched_functions_on_a_kernel_without_vfio_entries(
    build_host: BuildHost,
) -> None:
    """Before Linux 6.1 no VFIO device has a vfio-dev entry; that is not a bind half done."""
    root = build_host(replace(hgx_h100(), vfio_sysfs=False, vfio_cdev=False, iommufd=False))
    before = scan_host(root)
    after = refresh_host(root, before, [])
    assert all(a is b for a, b in zip(after.functions, before.functions, strict=True))
    assert after == scan_host(root)


def test_capability_texts_are_read_whole_stripped_and_blank_reads_as_none(
    scenario_root: ScenarioRoot,
) -> None:
    """The capability files are read with `os` calls (hostdev.scan._read_optional_text): the
    text is whole past one 4,096-byte read, stripped, undecodable bytes replaced, and a blank or
    missing file reads as None, as a text read gave."""
    root = scenario_root("hgx-h100")
    release = "6.12.0-" + "x" * 5000
    (root / "proc/sys/kernel/osrelease").write_bytes(f"  {release}\xff\n".encode("latin-1"))
    (root / "sys/class/misc/iommu/dev").write_bytes(b" \n")
    caps = scan_host(root).capabilities
    assert caps.kernel_release == release + "\ufffd"
    assert caps.iommufd_devnum is None
    (root / "proc/sys/kernel/osrelease").unlink()
    part = refresh_host(root, scan_host(root), [B("0000:18:00.0")]).capabilities
    assert part.kernel_release is None
