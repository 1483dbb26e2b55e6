"""A null device plugin in Python: the least a kubelet device plugin does, for `bench.lean` to
compare ours with.

grpcio and the v1beta1 device plugin API: read which PCI functions are on vfio-pci (their vendor,
device and IOMMU group from sysfs), serve one resource per vendor:device and the iommufd resource
on unix sockets in the kubelet's directory, Register each with the kubelet, send the devices on
ListAndWatch, answer Allocate with the group nodes. No health, no config, no labels, no metrics.

Run: `python -m bench.floor.plugin --root DIR --kubelet-dir DIR`; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from bench.floor import serve_until_terminated
from deviceplugin.v1beta1 import api_pb2 as pb2
from deviceplugin.v1beta1 import api_pb2_grpc as pb2_grpc

VENDORS = {"0x10de": "nvidia.com"}
IOMMUFD = "devices.kubevirt.io/iommufd"
IOMMUFD_SLOTS = 110


class Resource(pb2_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(self, groups: dict[str, str], stopping: threading.Event) -> None:
        self._groups = groups
        """Device ID -> the IOMMU group's number (empty for the iommufd resource)."""
        self._stopping = stopping

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb2.DevicePluginOptions()

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        yield pb2.ListAndWatchResponse(
            devices=[pb2.Device(ID=d, health="Healthy") for d in self._groups]
        )
        self._stopping.wait()

    def Allocate(self, request: Any, context: Any) -> Any:
        answers = []
        for container in request.container_requests:
            nodes = ["/dev/vfio/vfio"] + [
                f"/dev/vfio/{self._groups[d]}" for d in container.devices_ids if self._groups[d]
            ]
            answers.append(
                pb2.ContainerAllocateResponse(
                    envs={"PCI_RESOURCE": ",".join(container.devices_ids)},
                    devices=[
                        pb2.DeviceSpec(container_path=n, host_path=n, permissions="rw")
                        for n in nodes
                    ],
                )
            )
        return pb2.AllocateResponse(container_responses=answers)


def read_resources(root: Path) -> dict[str, dict[str, str]]:
    resources: dict[str, dict[str, str]] = {}
    for function in sorted((root / "sys/bus/pci/devices").iterdir()):
        driver = function / "driver"
        if not driver.is_symlink() or driver.readlink().name != "vfio-pci":
            continue
        vendor = (function / "vendor").read_text().strip()
        device = (function / "device").read_text().strip()[2:]
        name = f"{VENDORS.get(vendor, vendor)}/{device}"
        group = (function / "iommu_group").readlink().name
        resources.setdefault(name, {})[function.name] = group
    resources[IOMMUFD] = {f"iommufd{i}": "" for i in range(IOMMUFD_SLOTS)}
    return resources


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.floor.plugin")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--kubelet-dir", type=Path, required=True)
    args = parser.parse_args()
    stopping = threading.Event()
    servers = []
    for name, groups in read_resources(args.root).items():
        endpoint = f"floor-{name.replace('/', '_')}.sock"
        path = args.kubelet_dir / endpoint
        path.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb2_grpc.add_DevicePluginServicer_to_server(Resource(groups, stopping), server)
        server.add_insecure_port(f"unix:{path}")
        server.start()
        servers.append(server)
        with grpc.insecure_channel(f"unix:{args.kubelet_dir / 'kubelet.sock'}") as channel:
            pb2_grpc.RegistrationStub(channel).Register(
                pb2.RegisterRequest(version="v1beta1", endpoint=endpoint, resource_name=name),
                timeout=10,
            )
    serve_until_terminated(servers, stopping)


if __name__ == "__main__":
    main()
