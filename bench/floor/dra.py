"""A null DRA kubelet plugin in Python: the least any driver does, for `bench.lean` to compare ours
with.

grpcio, plugin registration and DRAPlugin v1 on unix sockets in the kubelet's directories. Per
claim prepared: one GET of the claim over the HTTPS client stack our driver uses (its connection,
`hostdev.labels.kube_connection`, read through `dra.api`), then its CDI
spec and a state record, each written, fsynced and renamed with the directory fsynced
(`hostdev.atomic_file`, the driver's own primitive). Unprepare removes both and fsyncs the state
directory. The connection is made at the first prepare, as late as a plugin can: the kubelet gets
its answer to GetInfo from grpcio alone. No host scan, no slices, no checks.

Run: `python -m bench.floor.dra --driver NAME --kubelet-dir DIR --cdi-dir DIR --state-dir DIR
--kubeconfig FILE`; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import threading
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from bench.floor import serve_until_terminated
from dra.pluginregistration.v1 import api_pb2 as reg_pb2
from dra.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from dra.v1 import api_pb2 as pb2
from dra.v1 import api_pb2_grpc as pb2_grpc
from hostdev.atomic_file import sync_directory, write_file_atomically

if TYPE_CHECKING:
    from dra.api import ResourceApi


class Registration:
    def __init__(self, driver: str, endpoint: str) -> None:
        self._info = reg_pb2.PluginInfo(
            type="DRAPlugin", name=driver, endpoint=endpoint, supported_versions=["v1.DRAPlugin"]
        )

    def GetInfo(self, request: Any, context: Any) -> Any:
        return self._info

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        return reg_pb2.RegistrationStatusResponse()


class Plugin:
    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._api: ResourceApi | None = None
        self._lock = threading.Lock()

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        response = pb2.NodePrepareResourcesResponse()
        for claim in request.claims:
            entry = response.claims[claim.uid]
            try:
                entry.devices.extend(self._prepare(claim))
            except Exception as error:  # the claim's answer, as any driver's
                entry.error = str(error)
        return response

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        response = pb2.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            self._spec(claim.uid).unlink(missing_ok=True)
            self._record(claim.uid).unlink(missing_ok=True)
            sync_directory(self._args.state_dir)
            response.claims[claim.uid].error = ""
        return response

    def _prepare(self, claim: Any) -> list[Any]:
        got = self._client().read_claim(claim.namespace, claim.name)
        results = got["status"]["allocation"]["devices"]["results"]
        mine = [r for r in results if r["driver"] == self._args.driver]
        kind = f"k8s.{self._args.driver}/claim"
        spec = {
            "cdiVersion": "0.6.0",
            "kind": kind,
            "devices": [
                {
                    "name": f"{claim.uid}-{r['device']}",
                    "containerEdits": {"deviceNodes": [{"path": "/dev/vfio/vfio"}]},
                }
                for r in mine
            ],
        }
        write_file_atomically(self._spec(claim.uid), json.dumps(spec).encode())
        record = {"uid": claim.uid, "namespace": claim.namespace, "name": claim.name}
        record["devices"] = [r["device"] for r in mine]
        write_file_atomically(self._record(claim.uid), json.dumps(record).encode(), 0o600)
        return [
            pb2.Device(
                request_names=[r["request"]],
                pool_name=r["pool"],
                device_name=r["device"],
                cdi_device_ids=[f"{kind}={claim.uid}-{r['device']}"],
            )
            for r in mine
        ]

    def _client(self) -> ResourceApi:
        with self._lock:
            if self._api is None:
                from dra.api import ResourceApi
                from hostdev.labels.kube_connection import load_kube_connection

                self._api = ResourceApi(load_kube_connection(self._args.kubeconfig))
            return self._api

    def _spec(self, uid: str) -> Path:
        return Path(self._args.cdi_dir) / f"{self._args.driver}-{uid}.json"

    def _record(self, uid: str) -> Path:
        return Path(self._args.state_dir) / f"{uid}.json"


def serve(path: Path, add: Any, servicer: object) -> grpc.Server:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add(servicer, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.floor.dra")
    parser.add_argument("--driver", required=True)
    for name in ("--kubelet-dir", "--cdi-dir", "--state-dir", "--kubeconfig"):
        parser.add_argument(name, type=Path, required=True)
    args = parser.parse_args()
    for directory in (args.cdi_dir, args.state_dir):
        directory.mkdir(parents=True, exist_ok=True)
    endpoint = args.kubelet_dir / "plugins" / args.driver / "dra.sock"
    servers = [
        serve(endpoint, pb2_grpc.add_DRAPluginServicer_to_server, Plugin(args)),
        serve(
            args.kubelet_dir / "plugins_registry" / f"{args.driver}-reg.sock",
            reg_grpc.add_RegistrationServicer_to_server,
            Registration(args.driver, str(endpoint)),
        ),
    ]
    serve_until_terminated(servers)


if __name__ == "__main__":
    main()
