"""The DRA driver's node labels: the NFD feature file and `--label-node`, kept current by its
re-scans, on a simulated node against the API server stand-in."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import kubernetes.client

from dra.api import ResourceApi
from dra.driver import DraDriver
from dra_kit import NODE, driver_settings, short_directory
from hostdev.config import Binding, default_config
from hostdev.labels.feature_file import FeatureFile
from hostdev.labels.node_patch import NodeLabeler
from hostdev.labels.publisher import LabelPublisher
from hostdev.pciids import PciIds
from sim.apiserver import ApiServerStandIn
from sim.host import unbind_driver

ScenarioRoot = Callable[[str], Path]
GPUS = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"]
GPUS += ["0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]
COUNT = "kubevirt-iommufd.io/iommufd-devices.nvidia.com_2330"


def test_the_driver_publishes_labels_and_takes_them_back_on_stop(
    scenario_root: ScenarioRoot,
    apiserver: ApiServerStandIn,
    api_client: kubernetes.client.ApiClient,
    tmp_path: Path,
) -> None:
    theirs = {"kubernetes.io/hostname": NODE, "kubevirt-iommufd.io/passthrough": "true"}
    apiserver.put_node(NODE, theirs)
    root = scenario_root("hgx-h100")
    path = tmp_path / "features.d" / "kubevirt-iommufd-dra"
    labeler = NodeLabeler(api_client, NODE, retry_first=0.05)
    labeler.start()
    with short_directory() as base:
        settings = driver_settings(root, base, 0.1)
        labels = LabelPublisher(FeatureFile(path, "dra"), labeler)
        driver = DraDriver(
            settings, default_config(), PciIds(None), ResourceApi(api_client), labels=labels
        )
        driver.start()
        try:
            assert path.read_text() == (
                "# kubevirt-iommufd dra: written on every change, removed when it stops\n"
                "kubevirt-iommufd.io/iommufd=true\n"
                "kubevirt-iommufd.io/vfio-cdev=true\n"
                "kubevirt-iommufd.io/kernel=6.12\n"
                f"{COUNT}=8\n"
            )

            def on_node() -> dict[str, str]:
                node = apiserver.read("Node", NODE)
                assert node is not None
                found: dict[str, str] = node["metadata"]["labels"]
                return found

            assert apiserver.wait_until(lambda: on_node().get(COUNT) == "8")
            unbind_driver(root, GPUS[0])
            deadline = time.monotonic() + 5
            while f"{COUNT}=7\n" not in path.read_text():
                assert time.monotonic() < deadline, path.read_text()
                time.sleep(0.02)
            for gpu in GPUS[1:]:
                unbind_driver(root, gpu)
            # Unusable devices leave the DRA driver's slices, and so its count label.
            deadline = time.monotonic() + 5
            while "kubevirt-iommufd.io/iommufd=false\n" not in path.read_text():
                assert time.monotonic() < deadline, path.read_text()
                time.sleep(0.02)
            assert COUNT not in path.read_text()
            assert apiserver.wait_until(lambda: COUNT not in on_node())
            assert on_node()["kubevirt-iommufd.io/iommufd"] == "false"
        finally:
            driver.stop()
    assert not path.exists()
    assert on_node() == theirs


def test_an_on_demand_node_says_iommufd_for_devices_on_their_host_driver(
    scenario_root: ScenarioRoot, api_client: kubernetes.client.ApiClient, tmp_path: Path
) -> None:
    """Slices publish `iommufd: true` for a device a claim will bind; the node label must say
    the same, or `require` VMIs are kept off the very nodes that would serve them."""
    root = scenario_root("nvidia-driver")
    config = default_config()
    config = replace(
        config,
        resources=tuple(
            replace(r, binding=Binding.ON_DEMAND, selectors=replace(r.selectors, drivers=()))
            for r in config.resources
        ),
    )
    path = tmp_path / "features.d" / "kubevirt-iommufd-dra"
    with short_directory() as base:
        driver = DraDriver(
            driver_settings(root, base, 0.1),
            config,
            PciIds(None),
            ResourceApi(api_client),
            labels=LabelPublisher(FeatureFile(path, "dra")),
        )
        driver.start()
        try:
            (device,) = driver.devices
            assert device.bind_on_demand and device.attributes["iommufd"] is True
            lines = path.read_text().splitlines()
            assert "kubevirt-iommufd.io/iommufd=true" in lines
            assert "kubevirt-iommufd.io/iommufd-devices.nvidia.com_20b5=1" in lines
        finally:
            driver.stop()
