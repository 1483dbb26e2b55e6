"""A claim's re-read (`HostCache.judge_now`) reads only its functions and their groups, and
judges each as a whole fresh scan of the host would, on every simulated host, through a seeded
walk of binds, unbinds and vanishing device nodes."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from dra.devices import judge_function
from dra.host_cache import HostCache
from dra.prepare_plan import GONE
from hostdev.bdf import Bdf
from hostdev.config import default_config
from hostdev.model import PciFunction, is_vfio_driver
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from sim.host import (
    CLASS_ETHERNET,
    SCENARIOS,
    BuildHost,
    FunctionSpec,
    bind_driver,
    hgx_h100,
    scale,
    unbind_driver,
)

STEPS = 12


def change(root: Path, function: PciFunction, pick: random.Random) -> None:
    """One change a node sees: a driver unbound or bound, device nodes gone, or none."""
    bdf, group = str(function.bdf), function.iommu_group
    kind = pick.choice(["unbind", "vfio", "host-driver", "cdev-node", "group-node", "none"])
    # The simulated unbind wants a VFIO function's vfio-dev entry, which kernels before 6.1 do
    # not make: such a function stays where it is.
    entry = function.vfio_cdev is not None or function.vfio_sysfs_without_cdev
    if is_vfio_driver(function.driver) and not entry:
        return
    if kind in ("unbind", "vfio", "host-driver") and function.driver is not None:
        unbind_driver(root, bdf)
    if kind in ("vfio", "host-driver"):
        bind_driver(root, bdf, "vfio-pci" if kind == "vfio" else "nvidia")
    elif kind == "cdev-node":
        for node in (root / "dev/vfio/devices").glob("vfio*"):
            node.unlink()
    elif kind == "group-node" and group is not None:
        (root / "dev/vfio" / str(group)).unlink(missing_ok=True)


@pytest.mark.parametrize("scenario", [n for n in SCENARIOS if n != "scale"])
def test_a_claims_reread_judges_as_a_whole_scan(build_host: BuildHost, scenario: str) -> None:
    root = build_host(SCENARIOS[scenario]())
    config, names = default_config(), PciIds(None)
    cache = HostCache(root, config, names)
    cache.scan()
    pick = random.Random(scenario)  # noqa: S311 - a repeatable walk
    for _ in range(STEPS):
        whole = scan_host(root)
        if not whole.functions:
            break
        changed = pick.choice(whole.functions)
        change(root, changed, pick)
        claimed = {changed.bdf, pick.choice(whole.functions).bdf}
        judged = cache.judge_now(claimed)
        whole = scan_host(root)
        assert judged == {
            bdf: GONE
            if (f := whole.function(bdf)) is None
            else judge_function(f, whole, config, names)
            for bdf in claimed
        }


def test_a_function_in_no_group_is_judged_beside_the_hosts_groups(build_host: BuildHost) -> None:
    """Read alone, the function shows no group, as a host without an IOMMU would: the host's
    other groups still say the IOMMU is on."""
    spec = hgx_h100()
    alone = FunctionSpec("0000:c0:00.0", 0x8086, 0x10FB, CLASS_ETHERNET, driver="ixgbe")
    root = build_host(replace(spec, functions=(*spec.functions, alone)))
    config, names = default_config(), PciIds(None)
    cache = HostCache(root, config, names)
    cache.scan()
    bdf = Bdf.parse(alone.bdf)
    whole = scan_host(root)
    function = whole.function(bdf)
    assert function is not None and function.iommu_group is None
    assert cache.judge_now([bdf]) == {bdf: judge_function(function, whole, config, names)}
    assert "enable VT-d" not in str(cache.judge_now([bdf])[bdf])


def test_a_claims_reread_on_4096_functions_reads_only_its_group(
    build_host: BuildHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = build_host(scale(4096))
    cache = HostCache(root, default_config(), PciIds(None))
    cache.scan()
    device = cache.devices[len(cache.devices) // 2]
    group = scan_host(root).group(device.group)
    assert group is not None
    read: list[str] = []
    import hostdev.scan

    real = hostdev.scan._read_function

    def counted(link: str, name: str, *args: object, **kwargs: object) -> object:
        read.append(name)
        return real(link, name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hostdev.scan, "_read_function", counted)
    assert not isinstance(cache.judge_now([device.bdf])[device.bdf], str)
    assert sorted(read) == sorted(m.name for m in group.members)
