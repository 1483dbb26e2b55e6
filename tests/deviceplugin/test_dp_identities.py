"""The first look at a host (`read_identities`) and the resources it makes (`plan_resources`):
on every scenario they agree with the full scan and the device tree built from it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from deviceplugin.identities import read_identities
from deviceplugin.inventory import build_device_tree, plan_resources
from hostdev.config import PluginConfig, ResourceConfig, Selectors, default_config
from hostdev.model import PciFunction
from hostdev.pciids import PciIds
from hostdev.scan import scan_host
from sim.host import SCENARIOS, unbind_driver

ScenarioRoot = Callable[[str], Path]
# "scale" is one of the others' functions 4,096 times over, and its tree takes seconds to build.
KINDS = sorted(set(SCENARIOS) - {"scale"})
RESET_AUDIO = PluginConfig(
    resources=(
        ResourceConfig(Selectors(classes=("0403",)), "example.com/audio", reset_after_use=True),
        *default_config().resources,
    )
)


def identity(function: PciFunction) -> tuple[object, ...]:
    return (function.bdf, function.vendor_id, function.device_id, function.class_code)


@pytest.mark.parametrize("scenario", KINDS)
def test_first_look_reads_what_the_scan_reads(scenario_root: ScenarioRoot, scenario: str) -> None:
    root = scenario_root(scenario)
    scanned = scan_host(root).functions
    looked = read_identities(root)
    assert [(*identity(f), f.driver) for f in looked] == [(*identity(f), f.driver) for f in scanned]


@pytest.mark.parametrize("scenario", KINDS)
@pytest.mark.parametrize("config", [default_config(), RESET_AUDIO], ids=["default", "reset"])
def test_first_look_plans_the_resources_of_the_tree(
    scenario_root: ScenarioRoot, scenario: str, config: PluginConfig
) -> None:
    root = scenario_root(scenario)
    names = PciIds(None)
    tree = build_device_tree(scan_host(root), config, names)
    planned = plan_resources(read_identities(root), config, names)
    assert planned == {name: r.reset_after_use for name, r in tree.resources.items()}
    assert list(planned) == sorted(planned)


def test_unreadable_or_garbled_ids_leave_the_function_out(scenario_root: ScenarioRoot) -> None:
    root = scenario_root("hgx-h100")
    devices = root / "sys/bus/pci/devices"
    everything = [f.bdf for f in read_identities(root)]
    (devices / "0000:18:00.0" / "modalias").unlink()
    (devices / "0000:2a:00.0" / "modalias").write_text("pci:v10ded2330\n")
    unbind_driver(root, "0000:3a:00.0")
    looked = {str(f.bdf): f for f in read_identities(root)}
    assert [f.bdf for f in looked.values()] == [
        b for b in everything if str(b) not in {"0000:18:00.0", "0000:2a:00.0"}
    ]
    assert looked["0000:3a:00.0"].driver is None
    assert looked["0000:5d:00.0"].driver == "vfio-pci"


def test_a_root_without_pci_devices_has_none(tmp_path: Path) -> None:
    assert read_identities(tmp_path) == ()
