"""The whole driver on a simulated node: the real `kubernetes` client against the API server
stand-in (every object schema-checked), the kubelet stand-in over real gRPC."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import kubernetes.client
import pytest

from dra.api import ResourceApi
from dra.claims import ClaimRef
from dra.driver import DraDriver, DriverSettings
from dra.iommufd_slots import slot_index
from dra_cdi_schema_kit import validate_cdi_spec
from dra_kit import DRIVER, NODE, driver_settings, short_directory
from hostdev.config import default_config
from hostdev.directories import UnsafeDirectory
from hostdev.pciids import PciIds
from sim.apiserver import (
    AllocatedDevice,
    ApiServerStandIn,
    build_resource_claim,
)
from sim.dra_kubelet import Claim, DRAKubeletStandIn
from sim.host import HostSpec, hgx_h100, scale, unbind_driver

ScenarioRoot = Callable[[str], Path]


@dataclass
class Running:
    driver: DraDriver
    apiserver: ApiServerStandIn
    kubelet: DRAKubeletStandIn
    root: Path
    settings: DriverSettings


SLOTS = 2
"""iommufd slots published after the functions: few, so that the pool's slices are the
functions' (a tainted slice holds 64 entries)."""


def start_driver(root: Path, base: Path, api_client: kubernetes.client.ApiClient) -> DraDriver:
    config = default_config()
    config = replace(config, iommufd=replace(config.iommufd, slots=SLOTS))
    driver = DraDriver(
        driver_settings(root, base, 0.2), config, PciIds(None), ResourceApi(api_client)
    )
    driver.start()
    return driver


@pytest.fixture
def running(
    scenario_root: ScenarioRoot,
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
) -> Iterator[Running]:
    apiserver.put_node(NODE)
    root = scenario_root("hgx-h100")
    with short_directory() as base:
        driver = start_driver(root, base, api_client)
        with DRAKubeletStandIn(base / "kubelet", info_poll_interval=None) as kubelet:
            kubelet.wait_registered(DRIVER)
            try:
                yield Running(driver, apiserver, kubelet, root, driver.settings)
            finally:
                driver.stop()


def published(apiserver: ApiServerStandIn) -> dict[str, dict[str, object]]:
    """PCI devices of the newest complete pool generation, by name (the iommufd slots after
    them are left out: tests/dra/test_dra_iommufd.py looks at those)."""
    slices = apiserver.slices(NODE, DRIVER)
    if not slices:
        return {}
    generation = max(s["spec"]["pool"]["generation"] for s in slices)
    newest = [s for s in slices if s["spec"]["pool"]["generation"] == generation]
    if len(newest) != newest[0]["spec"]["pool"]["resourceSliceCount"]:
        return {}
    return {
        d["name"]: d for s in newest for d in s["spec"]["devices"] if slot_index(d["name"]) is None
    }


def current_driver(apiserver: ApiServerStandIn, device: str) -> object:
    """The device's currentDriver attribute as published; None when it is not published."""
    attributes = published(apiserver).get(device, {}).get("attributes", {})
    assert isinstance(attributes, dict)
    return attributes.get("currentDriver", {}).get("string")


def test_slices_are_published_owned_by_the_node(running: Running) -> None:
    assert running.apiserver.wait_until(lambda: len(published(running.apiserver)) == 8)
    (item,) = running.apiserver.slices(NODE, DRIVER)
    node = running.apiserver.read("Node", NODE)
    assert node is not None
    assert item["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]
    assert item["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert item["spec"]["nodeName"] == NODE and item["spec"]["driver"] == DRIVER


def test_an_unbound_device_stays_in_the_slice_and_the_generation_moves(running: Running) -> None:
    """Once published, a device stays while it is on the bus: its health (and its taint) say
    that it cannot be used, instead of it vanishing under a running VM."""
    assert running.apiserver.wait_until(lambda: len(published(running.apiserver)) == 8)
    unbind_driver(running.root, "0000:2a:00.0")
    assert running.apiserver.wait_until(
        lambda: current_driver(running.apiserver, "pci-0000-2a-00-0") == "", timeout=5
    )
    assert len(published(running.apiserver)) == 8
    (item,) = running.apiserver.slices(NODE, DRIVER)
    assert item["spec"]["pool"]["generation"] == 2


def test_slices_deleted_by_the_kubelet_come_back_within_seconds(running: Running) -> None:
    assert running.apiserver.wait_until(lambda: len(published(running.apiserver)) == 8)
    assert running.apiserver.delete_slices(NODE) == 1
    start = time.monotonic()
    assert running.apiserver.wait_until(lambda: len(published(running.apiserver)) == 8, timeout=5)
    assert time.monotonic() - start < 3


def test_an_unreachable_api_server_is_retried_while_grpc_keeps_serving(running: Running) -> None:
    assert running.apiserver.wait_until(lambda: len(published(running.apiserver)) == 8)
    running.apiserver.stop()
    unbind_driver(running.root, "0000:2a:00.0")
    claim = Claim("vms", "c0ffee00-0000-4000-8000-000000000001", "gpu")
    answer = running.kubelet.node_prepare_resources([claim])[claim.uid]
    assert "unreachable" in answer.error and "vms/gpu" in answer.error
    time.sleep(1.0)
    running.apiserver.restart()
    assert running.apiserver.wait_until(
        lambda: current_driver(running.apiserver, "pci-0000-2a-00-0") == "", timeout=10
    )


def test_a_claim_is_prepared_through_the_kubelet_and_api(running: Running) -> None:
    api = running.apiserver
    api.put_claim(build_resource_claim("vms", "vm-gpu", ["gpu"], DRIVER))
    stored = api.set_allocation(
        "vms", "vm-gpu", [AllocatedDevice("gpu", DRIVER, NODE, "pci-0000-18-00-0")], NODE
    )
    claim = Claim("vms", stored["metadata"]["uid"], "vm-gpu")
    answer = running.kubelet.node_prepare_resources([claim])[claim.uid]
    assert answer.error == ""
    assert [d.device_name for d in answer.devices] == ["pci-0000-18-00-0"]
    spec_path = running.settings.cdi_dir / f"{DRIVER}-claim_{claim.uid}.json"
    spec = json.loads(spec_path.read_text())
    validate_cdi_spec(spec)
    assert {d["name"] for d in spec["devices"]} == {
        f"{claim.uid}-pci-0000-18-00-0",
        f"{claim.uid}-metadata-gpu",
    }
    # The same device for a second claim is refused, naming the first.
    api.put_claim(build_resource_claim("vms", "other", ["gpu"], DRIVER))
    other = api.set_allocation(
        "vms", "other", [AllocatedDevice("gpu", DRIVER, NODE, "pci-0000-18-00-0")], NODE
    )
    refused = running.kubelet.node_prepare_resources(
        [Claim("vms", other["metadata"]["uid"], "other")]
    )
    assert "already prepared for claim vms/vm-gpu" in refused[other["metadata"]["uid"]].error
    assert running.kubelet.node_unprepare_resources([claim]) == {claim.uid: ""}
    assert not spec_path.exists()


def test_a_node_of_300_functions_is_split_into_full_slices(
    build_host: Callable[[HostSpec], Path],
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
) -> None:
    apiserver.put_node(NODE)
    # Publication of 4,096 functions is measured in bench/dra.py; 300 splits into 3 slices.
    root = build_host(scale(300))
    with short_directory() as base:
        driver = start_driver(root, base, api_client)
        try:
            count = len(driver.devices)
            assert count > 128
            assert apiserver.wait_until(lambda: len(published(apiserver)) == count, timeout=30)
            slices = apiserver.slices(NODE, DRIVER)
            # The node's iommufd slots come after the functions.
            assert len(slices) == -(-(count + SLOTS) // 128) == 3
            assert all(len(s["spec"]["devices"]) <= 128 for s in slices)
        finally:
            driver.stop()


def test_an_update_that_meets_a_conflict_is_planned_again(running: Running) -> None:
    assert running.apiserver.wait_until(lambda: len(published(running.apiserver)) == 8)
    running.apiserver.conflict_next_update(2)
    unbind_driver(running.root, "0000:2a:00.0")
    assert running.apiserver.wait_until(
        lambda: current_driver(running.apiserver, "pci-0000-2a-00-0") == "", timeout=5
    )
    # The request log is written after the answer is sent: wait for it too.
    assert running.apiserver.wait_until(
        lambda: (
            [(r.method, r.status) for r in running.apiserver.requests if r.method == "PUT"]
            == [("PUT", 409), ("PUT", 409), ("PUT", 200)]
        )
    )


def test_group_companions_of_a_prepared_device_leave_the_slice(
    build_host: Callable[[HostSpec], Path],
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
) -> None:
    spec = hgx_h100()
    shared = tuple(
        replace(f, group=99) if f.bdf in ("0000:18:00.0", "0000:2a:00.0") else f
        for f in spec.functions
    )
    apiserver.put_node(NODE)
    root = build_host(replace(spec, functions=shared))
    apiserver.put_claim(build_resource_claim("vms", "vm-gpu", ["gpu"], DRIVER))
    stored = apiserver.set_allocation(
        "vms", "vm-gpu", [AllocatedDevice("gpu", DRIVER, NODE, "pci-0000-18-00-0")], NODE
    )
    with short_directory() as base:
        driver = start_driver(root, base, api_client)
        try:
            assert apiserver.wait_until(lambda: len(published(apiserver)) == 8)
            ref = ClaimRef("vms", "vm-gpu", stored["metadata"]["uid"])
            assert not isinstance(driver.preparer.prepare([ref])[ref.uid], str)
            assert apiserver.wait_until(
                lambda: "pci-0000-2a-00-0" not in published(apiserver), timeout=5
            )
            assert "pci-0000-18-00-0" in published(apiserver)
            assert driver.preparer.unprepare([ref]) == {ref.uid: None}
            assert apiserver.wait_until(lambda: len(published(apiserver)) == 8, timeout=5)
        finally:
            driver.stop()


def test_building_the_driver_touches_nothing_until_it_starts(
    scenario_root: ScenarioRoot,
    api_client: kubernetes.client.ApiClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with short_directory() as base:
        settings = driver_settings(scenario_root("hgx-h100"), base, 0.2)
        journal = settings.state_dir / "bindings" / "a1b2c3d4.json"
        journal.parent.mkdir(parents=True)
        journal.write_text("{not json")
        driver = DraDriver(settings, default_config(), PciIds(None), ResourceApi(api_client))
        assert driver.devices == ()
        assert sorted(p.name for p in settings.state_dir.iterdir()) == ["bindings"]
        # Served before recovery, and no longer: the kubelet forgets a driver whose socket goes.
        assert not driver.sockets.serving
        assert list(settings.kubelet_dir.rglob("*.sock")) == []
        assert "start-up recovery" not in caplog.text
        driver.start()
        try:
            assert f"start-up recovery: unreadable binding journal {journal}" in caplog.text
            assert len(driver.devices) == 8
            assert (settings.state_dir / "claims").is_dir()
            assert settings.kubelet_dir.is_dir()
        finally:
            driver.stop()


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.usefixtures("open_umask")
def test_every_directory_and_file_the_driver_makes_has_its_mode_under_umask_000(
    scenario_root: ScenarioRoot,
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
) -> None:
    apiserver.put_node(NODE)
    with short_directory() as base:
        driver = start_driver(scenario_root("hgx-h100"), base, api_client)
        try:
            with DRAKubeletStandIn(base / "kubelet", info_poll_interval=None) as kubelet:
                kubelet.wait_registered(DRIVER)
                apiserver.put_claim(build_resource_claim("vms", "vm-gpu", ["gpu"], DRIVER))
                stored = apiserver.set_allocation(
                    "vms", "vm-gpu", [AllocatedDevice("gpu", DRIVER, NODE, "pci-0000-18-00-0")],
                    NODE,
                )  # fmt: skip
                claim = Claim("vms", stored["metadata"]["uid"], "vm-gpu")
                assert kubelet.node_prepare_resources([claim])[claim.uid].error == ""
        finally:
            driver.stop()
        state, run = base / "state", base / "run"
        # Only root writes anywhere. The runtime (root) reads the CDI specs and mounts the
        # metadata files, which KubeVirt reads in the launcher pod as uid 107: readable by all;
        # the claim records and binding journals are root's alone.
        assert {
            str(path.relative_to(base)): oct(mode_of(path))
            for path in (
                base / "kubelet",
                base / "kubelet" / "plugins",
                base / "kubelet" / "plugins" / DRIVER,
                base / "cdi",
                base / "cdi" / f"{DRIVER}-claim_{claim.uid}.json",
                state,
                state / "claims",
                state / "claims" / f"{claim.uid}.json",
                state / "bindings",
                run,
                run / "unprepared",
                run / "metadata",
                *(run / "metadata").iterdir(),
            )
        } == {
            "kubelet": "0o750",
            "kubelet/plugins": "0o750",
            f"kubelet/plugins/{DRIVER}": "0o750",
            "cdi": "0o755",
            f"cdi/{DRIVER}-claim_{claim.uid}.json": "0o644",
            "state": "0o755",
            "state/claims": "0o700",
            f"state/claims/{claim.uid}.json": "0o600",
            "state/bindings": "0o700",
            "run": "0o755",
            "run/unprepared": "0o700",
            "run/metadata": "0o755",
            f"run/metadata/{claim.uid}_gpu_{DRIVER}-metadata.json": "0o644",
        }


@pytest.mark.parametrize(
    ("directory", "what", "mode"),
    [
        ("state/claims", "claim records directory", 0o700),
        ("state/bindings", "binding journal directory", 0o700),
        ("run", "run directory", 0o755),
        ("run/metadata", "metadata directory", 0o755),
        ("run/unprepared", "unprepared marks directory", 0o700),
    ],
    ids=["claims", "bindings", "run", "metadata", "marks"],
)
@pytest.mark.parametrize("spoil", ["mode-0777", "symlink"])
def test_a_directory_another_user_could_write_is_refused_at_start(
    scenario_root: ScenarioRoot,
    api_client: kubernetes.client.ApiClient,
    directory: str,
    what: str,
    mode: int,
    spoil: str,
) -> None:
    with short_directory() as base:
        settings = driver_settings(scenario_root("hgx-h100"), base, 0.2)
        path = base / directory
        if spoil == "symlink":
            (base / "elsewhere").mkdir(mode=0o700)
            path.parent.mkdir(exist_ok=True)
            path.symlink_to(base / "elsewhere")
            problem = "is a symbolic link"
        else:
            path.mkdir(parents=True)
            path.chmod(0o777)
            problem = "is writable by other users (mode 0777)"
        driver = DraDriver(settings, default_config(), PciIds(None), ResourceApi(api_client))
        with pytest.raises(UnsafeDirectory) as caught:
            driver.start()
        assert str(caught.value) == (
            f"{what} {path} {problem}; make it a real directory owned by root with mode {mode:04o}"
        )
        # Served before recovery, and no longer: the kubelet forgets a driver whose socket goes.
        assert not driver.sockets.serving
        assert list(settings.kubelet_dir.rglob("*.sock")) == []
