"""The pure parts of binding: variant driver choice, selectors, refusals in the plan."""

from __future__ import annotations

import pytest

from hostdev.bdf import Bdf
from hostdev.binding.driver_match import (
    VfioAlias,
    choose_vfio_driver,
    driver_names,
    parse_modules_alias,
    same_driver,
)
from hostdev.binding.plan import BindRequest, plan_bind
from hostdev.binding.usage import FunctionUsage
from hostdev.scan import scan_host
from hostdev.selector import DeviceSelector, InvalidSelector
from sim.host import BuildHost, hgx_h100, nvidia_driver

B = Bdf.parse
GRACE_GPU = "pci:v000010DEd00002342sv000010DEsd000016EBbc03sc02i00"
MODULES_ALIAS = """\
# Aliases extracted from modules themselves.
alias pci:v000010DEd*sv*sd*bc03sc02i00* nvidia
alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci
alias vfio_pci:v000010DEd*sv*sd*bc*sc*i* any_nvidia_vfio_pci
alias vfio_pci:v000015B3d0000101Esv*sd*bc*sc*i* mlx5_vfio_pci
alias vfio_pci:v00008086d00001572sv*sd*bc*sc*i* b_vfio_pci
alias vfio_pci:v00008086d00001572sv*sd*bc*sc*i* a_vfio_pci
"""


@pytest.mark.parametrize(
    ("modalias", "expected"),
    [
        pytest.param(GRACE_GPU, "nvgrace_gpu_vfio_pci", id="fewest-wildcards-wins"),
        pytest.param(
            "pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00",
            "any_nvidia_vfio_pci",
            id="only-the-broad-alias-matches",
        ),
        pytest.param(
            "pci:v00008086d00001572sv00008086sd00000000bc02sc00i00",
            "a_vfio_pci",
            id="tie-goes-to-the-first-name",
        ),
        pytest.param(
            "pci:v00001AF4d00001041sv00001AF4sd00001100bc02sc00i00", "vfio-pci", id="no-variant"
        ),
        pytest.param(None, "vfio-pci", id="no-modalias"),
        pytest.param("usb:v1D6Bp0002", "vfio-pci", id="not-a-pci-modalias"),
    ],
)
def test_variant_driver_choice(modalias: str | None, expected: str) -> None:
    assert choose_vfio_driver(modalias, parse_modules_alias(MODULES_ALIAS)) == expected


def test_only_vfio_pci_aliases_are_read() -> None:
    aliases = parse_modules_alias(MODULES_ALIAS + "alias\nbroken line here too many fields\n")
    assert aliases[0] == VfioAlias("v000010DEd00002342sv*sd*bc*sc*i*", "nvgrace_gpu_vfio_pci")
    assert len(aliases) == 5


def test_driver_name_spellings() -> None:
    assert driver_names("vfio_pci") == ("vfio_pci", "vfio-pci")
    assert driver_names("vfio-pci") == ("vfio-pci", "vfio_pci")
    assert driver_names("nvidia") == ("nvidia",)
    assert same_driver("vfio-pci", "vfio_pci")
    assert not same_driver("vfio-pci", None)
    assert same_driver(None, None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10de:2330", DeviceSelector(0x10DE, 0x2330, text="10de:2330")),
        ("10DE:*", DeviceSelector(0x10DE, None, text="10DE:*")),
        (
            "vendor=10de, class=0x0302,driver=nvidia",
            DeviceSelector(
                0x10DE, None, "0302", "nvidia", "vendor=10de, class=0x0302,driver=nvidia"
            ),
        ),
    ],
)
def test_selectors_parse(text: str, expected: DeviceSelector) -> None:
    assert DeviceSelector.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("nvidia", "'nvidia' is not one of vendor, device, class, driver=VALUE"),
        ("vendor=10de,vendor=10de", "vendor is given twice"),
        ("vendor=nvidia", "vendor must be 4 hex digits such as 10de"),
        ("class=3", "class must be 2, 4 or 6 hex digits such as 0302"),
        ("driver=a/b", "driver must be a driver name such as nvidia"),
        ("", "'' is not one of"),
    ],
)
def test_bad_selectors_say_how_to_write_one(text: str, problem: str) -> None:
    with pytest.raises(InvalidSelector) as caught:
        DeviceSelector.parse(text)
    assert problem in str(caught.value)
    assert "write VVVV:DDDD (e.g. 10de:2330)" in str(caught.value)


def test_selector_matches_ids_class_and_driver_but_never_bridges(build_host: BuildHost) -> None:
    inventory = scan_host(build_host(hgx_h100()))
    matched = [
        f for f in inventory.functions if DeviceSelector.parse("vendor=10de,class=03").matches(f)
    ]
    assert len(matched) == 8
    bridges = DeviceSelector.parse("1000:c030")
    assert not any(bridges.matches(f) for f in inventory.functions)


def test_unreadable_processes_refuse_rather_than_guess(build_host: BuildHost) -> None:
    inventory = scan_host(build_host(nvidia_driver()))
    gpu = B("0000:17:00.0")
    usage = {gpu: FunctionUsage(gpu, None, unreadable_pids=(1, 2))}
    plan = plan_bind(inventory, [BindRequest(gpu)], (), usage, ["vfio-pci"])
    (refusal,) = plan.refusals
    assert not refusal.busy
    assert str(refusal) == (
        "0000:17:00.0: cannot tell whether it is in use: the open files of 2 processes are"
        " unreadable; run as root (in a container: privileged, with the host's PID namespace)"
    )
