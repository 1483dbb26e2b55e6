"""The generated stubs speak exactly the upstream wire protocol.

The tables below are written out by hand from the upstream .proto files (kubelet device plugin
v1beta1, kubelet pod resources v1, kubelet plugin registration v1, kubelet DRA v1 and v1beta1 as
in kubernetes/kubelet 63b3249724f7, kubelet DRA resource health v1alpha1/v1beta1/v1 as in
kubernetes/kubernetes staging/src/k8s.io/kubelet/pkg/apis/dra-health, KubeVirt hooks
info/v1alpha1/v1alpha2/v1alpha3); the tests compare the generated descriptors against them, so
a renamed, renumbered, retyped, added or dropped field, message or method fails here.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor

from deviceplugin.podresources.v1 import api_pb2 as podresources
from deviceplugin.v1beta1 import api_pb2 as dp
from dra.healthapi.v1 import api_pb2 as health_v1
from dra.healthapi.v1alpha1 import api_pb2 as health_v1alpha1
from dra.healthapi.v1beta1 import api_pb2 as health_v1beta1
from dra.pluginregistration.v1 import api_pb2 as pluginregistration
from dra.v1 import api_pb2 as dra_v1
from dra.v1beta1 import api_pb2 as dra_v1beta1
from launcher_hook.hooks.info import api_pb2 as info
from launcher_hook.hooks.v1alpha2 import api_pb2 as v1alpha2
from launcher_hook.hooks.v1alpha3 import api_pb2 as v1alpha3

REPO = Path(__file__).resolve().parents[1]

# proto file name (relative to proto/) -> Python package holding api_pb2 / api_pb2_grpc
PACKAGES = {
    "deviceplugin/v1beta1/api.proto": "deviceplugin.v1beta1",
    "deviceplugin/podresources/v1/api.proto": "deviceplugin.podresources.v1",
    "dra/pluginregistration/v1/api.proto": "dra.pluginregistration.v1",
    "dra/healthapi/v1alpha1/api.proto": "dra.healthapi.v1alpha1",
    "dra/healthapi/v1beta1/api.proto": "dra.healthapi.v1beta1",
    "dra/healthapi/v1/api.proto": "dra.healthapi.v1",
    "dra/v1/api.proto": "dra.v1",
    "dra/v1beta1/api.proto": "dra.v1beta1",
    "launcher_hook/hooks/info/api.proto": "launcher_hook.hooks.info",
    "launcher_hook/hooks/v1alpha1/api.proto": "launcher_hook.hooks.v1alpha1",
    "launcher_hook/hooks/v1alpha2/api.proto": "launcher_hook.hooks.v1alpha2",
    "launcher_hook/hooks/v1alpha3/api.proto": "launcher_hook.hooks.v1alpha3",
}


class Method(NamedTuple):
    path: str
    request: str
    response: str
    client_streaming: bool = False
    server_streaming: bool = False


DP = "v1beta1"
PR = "v1"
REG = "pluginregistration"
DRA1 = "k8s.io.kubelet.pkg.apis.dra.v1"
DRA1B = "k8s.io.kubelet.pkg.apis.dra.v1beta1"
# The health API's packages are bare versions: v1beta1 shares the device plugin's package and v1
# the pod resources', with no name in common.
HEALTH = ("v1alpha1", "v1beta1", "v1")
INFO = "kubevirt.hooks.info"
A1, A2, A3 = "kubevirt.hooks.v1alpha1", "kubevirt.hooks.v1alpha2", "kubevirt.hooks.v1alpha3"

METHODS = [
    Method(f"/{DP}.Registration/Register", f"{DP}.RegisterRequest", f"{DP}.Empty"),
    Method(
        f"/{DP}.DevicePlugin/GetDevicePluginOptions", f"{DP}.Empty", f"{DP}.DevicePluginOptions"
    ),
    Method(
        f"/{DP}.DevicePlugin/ListAndWatch",
        f"{DP}.Empty",
        f"{DP}.ListAndWatchResponse",
        server_streaming=True,
    ),
    Method(
        f"/{DP}.DevicePlugin/GetPreferredAllocation",
        f"{DP}.PreferredAllocationRequest",
        f"{DP}.PreferredAllocationResponse",
    ),
    Method(f"/{DP}.DevicePlugin/Allocate", f"{DP}.AllocateRequest", f"{DP}.AllocateResponse"),
    Method(
        f"/{DP}.DevicePlugin/PreStartContainer",
        f"{DP}.PreStartContainerRequest",
        f"{DP}.PreStartContainerResponse",
    ),
    Method(
        f"/{PR}.PodResourcesLister/List",
        f"{PR}.ListPodResourcesRequest",
        f"{PR}.ListPodResourcesResponse",
    ),
    Method(
        f"/{PR}.PodResourcesLister/GetAllocatableResources",
        f"{PR}.AllocatableResourcesRequest",
        f"{PR}.AllocatableResourcesResponse",
    ),
    Method(
        f"/{PR}.PodResourcesLister/Get",
        f"{PR}.GetPodResourcesRequest",
        f"{PR}.GetPodResourcesResponse",
    ),
    Method(f"/{REG}.Registration/GetInfo", f"{REG}.InfoRequest", f"{REG}.PluginInfo"),
    Method(
        f"/{REG}.Registration/NotifyRegistrationStatus",
        f"{REG}.RegistrationStatus",
        f"{REG}.RegistrationStatusResponse",
    ),
    *(
        Method(
            f"/{pkg}.DRAPlugin/{verb}Resources",
            f"{pkg}.{verb}ResourcesRequest",
            f"{pkg}.{verb}ResourcesResponse",
        )
        for pkg in (DRA1, DRA1B)
        for verb in ("NodePrepare", "NodeUnprepare")
    ),
    *(
        Method(
            f"/{pkg}.DRAResourceHealth/NodeWatchResources",
            f"{pkg}.NodeWatchResourcesRequest",
            f"{pkg}.NodeWatchResourcesResponse",
            server_streaming=True,
        )
        for pkg in HEALTH
    ),
    Method(f"/{INFO}.Info/Info", f"{INFO}.InfoParams", f"{INFO}.InfoResult"),
    *(
        Method(
            f"/{pkg}.Callbacks/OnDefineDomain",
            f"{pkg}.OnDefineDomainParams",
            f"{pkg}.OnDefineDomainResult",
        )
        for pkg in (A1, A2, A3)
    ),
    *(
        Method(
            f"/{pkg}.Callbacks/PreCloudInitIso",
            f"{pkg}.PreCloudInitIsoParams",
            f"{pkg}.PreCloudInitIsoResult",
        )
        for pkg in (A2, A3)
    ),
    Method(f"/{A3}.Callbacks/Shutdown", f"{A3}.ShutdownParams", f"{A3}.ShutdownResult"),
]


class Field(NamedTuple):
    message: str  # full name of the containing message
    name: str
    number: int
    type: str  # scalar type name, "message", or "map<key,value>"
    repeated: bool = False
    message_type: str | None = None  # full name, for message fields
    optional: bool = False  # proto3 `optional` (explicit presence)


def rep(message: str, name: str, number: int, type_: str) -> Field:
    return Field(message, name, number, type_, repeated=True)


def msg(message: str, name: str, number: int, type_name: str, *, repeated: bool = False) -> Field:
    return Field(message, name, number, "message", repeated, type_name)


def str_map(message: str, name: str, number: int) -> Field:
    return Field(message, name, number, "map<string,string>", repeated=True)


# Messages without fields are listed with no Field rows; they are still checked to exist.
EMPTY_MESSAGES = {
    f"{DP}.Empty",
    f"{DP}.PreStartContainerResponse",
    f"{PR}.AllocatableResourcesRequest",
    f"{PR}.ListPodResourcesRequest",
    f"{REG}.InfoRequest",
    f"{REG}.RegistrationStatusResponse",
    *(f"{pkg}.NodeWatchResourcesRequest" for pkg in HEALTH),
    f"{INFO}.InfoParams",
    f"{A3}.ShutdownParams",
    f"{A3}.ShutdownResult",
}


def _dra_fields(pkg: str, *, share_id: bool) -> list[Field]:
    fields = [
        msg(f"{pkg}.NodePrepareResourcesRequest", "claims", 1, f"{pkg}.Claim", repeated=True),
        Field(
            f"{pkg}.NodePrepareResourcesResponse",
            "claims",
            1,
            f"map<string,{pkg}.NodePrepareResourceResponse>",
            repeated=True,
        ),
        msg(f"{pkg}.NodePrepareResourceResponse", "devices", 1, f"{pkg}.Device", repeated=True),
        Field(f"{pkg}.NodePrepareResourceResponse", "error", 2, "string"),
        rep(f"{pkg}.Device", "request_names", 1, "string"),
        Field(f"{pkg}.Device", "pool_name", 2, "string"),
        Field(f"{pkg}.Device", "device_name", 3, "string"),
        rep(f"{pkg}.Device", "cdi_device_ids", 4, "string"),
        msg(f"{pkg}.NodeUnprepareResourcesRequest", "claims", 1, f"{pkg}.Claim", repeated=True),
        Field(
            f"{pkg}.NodeUnprepareResourcesResponse",
            "claims",
            1,
            f"map<string,{pkg}.NodeUnprepareResourceResponse>",
            repeated=True,
        ),
        Field(f"{pkg}.NodeUnprepareResourceResponse", "error", 1, "string"),
        Field(f"{pkg}.Claim", "namespace", 1, "string"),
        Field(f"{pkg}.Claim", "uid", 2, "string"),
        Field(f"{pkg}.Claim", "name", 3, "string"),
    ]
    if share_id:
        fields.append(Field(f"{pkg}.Device", "share_id", 5, "string", optional=True))
    return fields


def _health_fields(pkg: str) -> list[Field]:
    return [
        Field(f"{pkg}.DeviceIdentifier", "pool_name", 1, "string"),
        Field(f"{pkg}.DeviceIdentifier", "device_name", 2, "string"),
        msg(f"{pkg}.DeviceHealth", "device", 1, f"{pkg}.DeviceIdentifier"),
        Field(f"{pkg}.DeviceHealth", "health", 2, "enum"),
        Field(f"{pkg}.DeviceHealth", "last_updated_time", 3, "int64"),
        Field(f"{pkg}.DeviceHealth", "health_check_timeout_seconds", 4, "int64"),
        Field(f"{pkg}.DeviceHealth", "message", 5, "string"),
        msg(
            f"{pkg}.NodeWatchResourcesResponse", "devices", 1, f"{pkg}.DeviceHealth", repeated=True
        ),
    ]


def _hook_fields(pkg: str, *, cloud_init: bool) -> list[Field]:
    fields = [
        Field(f"{pkg}.OnDefineDomainParams", "domainXML", 1, "bytes"),
        Field(f"{pkg}.OnDefineDomainParams", "vmi", 2, "bytes"),
        Field(f"{pkg}.OnDefineDomainResult", "domainXML", 1, "bytes"),
    ]
    if cloud_init:
        fields += [
            Field(f"{pkg}.PreCloudInitIsoParams", "cloudInitNoCloudSource", 1, "bytes"),
            Field(f"{pkg}.PreCloudInitIsoParams", "vmi", 2, "bytes"),
            Field(f"{pkg}.PreCloudInitIsoParams", "cloudInitData", 3, "bytes"),
            Field(f"{pkg}.PreCloudInitIsoResult", "cloudInitNoCloudSource", 1, "bytes"),
            Field(f"{pkg}.PreCloudInitIsoResult", "cloudInitData", 3, "bytes"),
        ]
    return fields


FIELDS = [
    # --- kubelet device plugin v1beta1 ---
    Field(f"{DP}.DevicePluginOptions", "pre_start_required", 1, "bool"),
    Field(f"{DP}.DevicePluginOptions", "get_preferred_allocation_available", 2, "bool"),
    Field(f"{DP}.RegisterRequest", "version", 1, "string"),
    Field(f"{DP}.RegisterRequest", "endpoint", 2, "string"),
    Field(f"{DP}.RegisterRequest", "resource_name", 3, "string"),
    msg(f"{DP}.RegisterRequest", "options", 4, f"{DP}.DevicePluginOptions"),
    msg(f"{DP}.ListAndWatchResponse", "devices", 1, f"{DP}.Device", repeated=True),
    msg(f"{DP}.TopologyInfo", "nodes", 1, f"{DP}.NUMANode", repeated=True),
    Field(f"{DP}.NUMANode", "ID", 1, "int64"),
    Field(f"{DP}.Device", "ID", 1, "string"),
    Field(f"{DP}.Device", "health", 2, "string"),
    msg(f"{DP}.Device", "topology", 3, f"{DP}.TopologyInfo"),
    rep(f"{DP}.PreStartContainerRequest", "devices_ids", 1, "string"),
    msg(
        f"{DP}.PreferredAllocationRequest",
        "container_requests",
        1,
        f"{DP}.ContainerPreferredAllocationRequest",
        repeated=True,
    ),
    rep(f"{DP}.ContainerPreferredAllocationRequest", "available_deviceIDs", 1, "string"),
    rep(f"{DP}.ContainerPreferredAllocationRequest", "must_include_deviceIDs", 2, "string"),
    Field(f"{DP}.ContainerPreferredAllocationRequest", "allocation_size", 3, "int32"),
    msg(
        f"{DP}.PreferredAllocationResponse",
        "container_responses",
        1,
        f"{DP}.ContainerPreferredAllocationResponse",
        repeated=True,
    ),
    rep(f"{DP}.ContainerPreferredAllocationResponse", "deviceIDs", 1, "string"),
    msg(
        f"{DP}.AllocateRequest",
        "container_requests",
        1,
        f"{DP}.ContainerAllocateRequest",
        repeated=True,
    ),
    rep(f"{DP}.ContainerAllocateRequest", "devices_ids", 1, "string"),
    Field(f"{DP}.CDIDevice", "name", 1, "string"),
    msg(
        f"{DP}.AllocateResponse",
        "container_responses",
        1,
        f"{DP}.ContainerAllocateResponse",
        repeated=True,
    ),
    str_map(f"{DP}.ContainerAllocateResponse", "envs", 1),
    msg(f"{DP}.ContainerAllocateResponse", "mounts", 2, f"{DP}.Mount", repeated=True),
    msg(f"{DP}.ContainerAllocateResponse", "devices", 3, f"{DP}.DeviceSpec", repeated=True),
    str_map(f"{DP}.ContainerAllocateResponse", "annotations", 4),
    msg(f"{DP}.ContainerAllocateResponse", "cdi_devices", 5, f"{DP}.CDIDevice", repeated=True),
    Field(f"{DP}.Mount", "container_path", 1, "string"),
    Field(f"{DP}.Mount", "host_path", 2, "string"),
    Field(f"{DP}.Mount", "read_only", 3, "bool"),
    Field(f"{DP}.DeviceSpec", "container_path", 1, "string"),
    Field(f"{DP}.DeviceSpec", "host_path", 2, "string"),
    Field(f"{DP}.DeviceSpec", "permissions", 3, "string"),
    # --- kubelet pod resources v1 ---
    msg(
        f"{PR}.AllocatableResourcesResponse", "devices", 1, f"{PR}.ContainerDevices", repeated=True
    ),
    rep(f"{PR}.AllocatableResourcesResponse", "cpu_ids", 2, "int64"),
    msg(f"{PR}.AllocatableResourcesResponse", "memory", 3, f"{PR}.ContainerMemory", repeated=True),
    msg(f"{PR}.ListPodResourcesResponse", "pod_resources", 1, f"{PR}.PodResources", repeated=True),
    Field(f"{PR}.PodResources", "name", 1, "string"),
    Field(f"{PR}.PodResources", "namespace", 2, "string"),
    msg(f"{PR}.PodResources", "containers", 3, f"{PR}.ContainerResources", repeated=True),
    rep(f"{PR}.PodResources", "cpu_ids", 4, "int64"),
    msg(f"{PR}.PodResources", "memory", 5, f"{PR}.ContainerMemory", repeated=True),
    Field(f"{PR}.ContainerResources", "name", 1, "string"),
    msg(f"{PR}.ContainerResources", "devices", 2, f"{PR}.ContainerDevices", repeated=True),
    rep(f"{PR}.ContainerResources", "cpu_ids", 3, "int64"),
    msg(f"{PR}.ContainerResources", "memory", 4, f"{PR}.ContainerMemory", repeated=True),
    msg(
        f"{PR}.ContainerResources",
        "dynamic_resources",
        5,
        f"{PR}.DynamicResource",
        repeated=True,
    ),
    Field(f"{PR}.ContainerMemory", "memory_type", 1, "string"),
    Field(f"{PR}.ContainerMemory", "size", 2, "uint64"),
    msg(f"{PR}.ContainerMemory", "topology", 3, f"{PR}.TopologyInfo"),
    Field(f"{PR}.ContainerDevices", "resource_name", 1, "string"),
    rep(f"{PR}.ContainerDevices", "device_ids", 2, "string"),
    msg(f"{PR}.ContainerDevices", "topology", 3, f"{PR}.TopologyInfo"),
    msg(f"{PR}.TopologyInfo", "nodes", 1, f"{PR}.NUMANode", repeated=True),
    Field(f"{PR}.NUMANode", "ID", 1, "int64"),
    Field(f"{PR}.DynamicResource", "claim_name", 2, "string"),
    Field(f"{PR}.DynamicResource", "claim_namespace", 3, "string"),
    msg(f"{PR}.DynamicResource", "claim_resources", 4, f"{PR}.ClaimResource", repeated=True),
    msg(f"{PR}.ClaimResource", "cdi_devices", 1, f"{PR}.CDIDevice", repeated=True),
    Field(f"{PR}.ClaimResource", "driver_name", 2, "string"),
    Field(f"{PR}.ClaimResource", "pool_name", 3, "string"),
    Field(f"{PR}.ClaimResource", "device_name", 4, "string"),
    Field(f"{PR}.ClaimResource", "share_id", 5, "string", optional=True),
    Field(f"{PR}.CDIDevice", "name", 1, "string"),
    Field(f"{PR}.GetPodResourcesRequest", "pod_name", 1, "string"),
    Field(f"{PR}.GetPodResourcesRequest", "pod_namespace", 2, "string"),
    msg(f"{PR}.GetPodResourcesResponse", "pod_resources", 1, f"{PR}.PodResources"),
    # --- kubelet plugin registration v1 ---
    Field(f"{REG}.PluginInfo", "type", 1, "string"),
    Field(f"{REG}.PluginInfo", "name", 2, "string"),
    Field(f"{REG}.PluginInfo", "endpoint", 3, "string"),
    rep(f"{REG}.PluginInfo", "supported_versions", 4, "string"),
    Field(f"{REG}.RegistrationStatus", "plugin_registered", 1, "bool"),
    Field(f"{REG}.RegistrationStatus", "error", 2, "string"),
    # --- kubelet DRA v1 and v1beta1 ---
    *_dra_fields(DRA1, share_id=True),
    *_dra_fields(DRA1B, share_id=False),
    # --- kubelet DRA resource health v1alpha1, v1beta1 and v1 ---
    *(field for pkg in HEALTH for field in _health_fields(pkg)),
    # --- KubeVirt hooks ---
    Field(f"{INFO}.InfoResult", "name", 1, "string"),
    msg(f"{INFO}.InfoResult", "hookPoints", 3, f"{INFO}.HookPoint", repeated=True),
    rep(f"{INFO}.InfoResult", "versions", 4, "string"),
    Field(f"{INFO}.HookPoint", "name", 1, "string"),
    Field(f"{INFO}.HookPoint", "priority", 2, "int32"),
    *_hook_fields(A1, cloud_init=False),
    *_hook_fields(A2, cloud_init=True),
    *_hook_fields(A3, cloud_init=True),
]

SCALAR_NAMES = {
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_ENUM: "enum",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_UINT64: "uint64",
}


def modules(suffix: str) -> list[ModuleType]:
    return [importlib.import_module(f"{pkg}.api_{suffix}") for pkg in PACKAGES.values()]


def file_descriptors() -> list[FileDescriptor]:
    files: list[FileDescriptor] = [m.DESCRIPTOR for m in modules("pb2")]
    return files


def all_messages() -> dict[str, Descriptor]:
    """Every message in the generated files, map entry types left out."""
    found: dict[str, Descriptor] = {}

    def walk(desc: Descriptor) -> None:
        if desc.GetOptions().map_entry:
            return
        found[desc.full_name] = desc
        for nested in desc.nested_types:
            walk(nested)

    for fd in file_descriptors():
        for desc in fd.message_types_by_name.values():
            walk(desc)
    return found


def type_of(field: FieldDescriptor) -> str:
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        key, value = (entry.fields_by_name[n] for n in ("key", "value"))
        # A message-valued map names its value type, so a retyped value fails too.
        value_name = value.message_type.full_name if value.message_type else type_of(value)
        return f"map<{type_of(key)},{value_name}>"
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return "message"
    return SCALAR_NAMES.get(field.type, f"type#{field.type}")


def actual(field: FieldDescriptor) -> Field:
    assert field.containing_type is not None
    is_map = type_of(field).startswith("map<")
    message_type = field.message_type
    return Field(
        message=field.containing_type.full_name,
        name=field.name,
        number=field.number,
        type=type_of(field),
        repeated=field.is_repeated,
        message_type=None if message_type is None or is_map else message_type.full_name,
        optional=field.containing_oneof is not None and field.has_presence,
    )


# --- file and package layout -------------------------------------------------------------


def test_file_names_and_packages() -> None:
    got = {fd.name: fd.package for fd in file_descriptors()}
    assert got == {
        "deviceplugin/v1beta1/api.proto": DP,
        "deviceplugin/podresources/v1/api.proto": PR,
        "dra/pluginregistration/v1/api.proto": REG,
        "dra/v1/api.proto": DRA1,
        "dra/v1beta1/api.proto": DRA1B,
        "dra/healthapi/v1alpha1/api.proto": "v1alpha1",
        "dra/healthapi/v1beta1/api.proto": "v1beta1",
        "dra/healthapi/v1/api.proto": "v1",
        "launcher_hook/hooks/info/api.proto": INFO,
        "launcher_hook/hooks/v1alpha1/api.proto": A1,
        "launcher_hook/hooks/v1alpha2/api.proto": A2,
        "launcher_hook/hooks/v1alpha3/api.proto": A3,
    }


def test_all_modules_load_in_one_fresh_interpreter() -> None:
    """Both api.proto files (and the hooks) share one descriptor pool without a clash."""
    names = [f"{pkg}.{mod}" for pkg in PACKAGES.values() for mod in ("api_pb2", "api_pb2_grpc")]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "from google.protobuf import descriptor_pool\n"
        f"for f in {sorted(PACKAGES)!r}:\n"
        "    print(descriptor_pool.Default().FindFileByName(f).name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == sorted(PACKAGES)


def test_same_short_names_are_distinct_messages() -> None:
    pool = descriptor_pool.Default()
    modules("pb2")
    dp_topology = pool.FindMessageTypeByName(f"{DP}.TopologyInfo")
    pr_topology = pool.FindMessageTypeByName(f"{PR}.TopologyInfo")
    assert dp_topology.file.name == "deviceplugin/v1beta1/api.proto"
    assert pr_topology.file.name == "deviceplugin/podresources/v1/api.proto"
    v1_claim = pool.FindMessageTypeByName(f"{DRA1}.Claim")
    v1beta1_claim = pool.FindMessageTypeByName(f"{DRA1B}.Claim")
    assert v1_claim.file.name == "dra/v1/api.proto"
    assert v1beta1_claim.file.name == "dra/v1beta1/api.proto"


# --- services ----------------------------------------------------------------------------


def service_methods() -> dict[str, Method]:
    found: dict[str, Method] = {}
    for fd in file_descriptors():
        for service in fd.services_by_name.values():
            for m in service.methods:
                path = f"/{service.full_name}/{m.name}"
                found[path] = Method(
                    path,
                    m.input_type.full_name,
                    m.output_type.full_name,
                    m.client_streaming,
                    m.server_streaming,
                )
    return found


@pytest.mark.parametrize("method", METHODS, ids=[m.path for m in METHODS])
def test_method(method: Method) -> None:
    assert service_methods().get(method.path) == method


def test_no_unexpected_methods() -> None:
    assert sorted(service_methods()) == sorted(m.path for m in METHODS)


class RecordingChannel:
    """Stands in for grpc.Channel and records the paths a generated Stub registers."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def _record(self, kind: str) -> Any:
        def register(path: str, *args: object, **kwargs: object) -> object:
            self.calls.append((kind, path))
            return object()

        return register

    def __getattr__(self, kind: str) -> Any:
        if kind in {"unary_unary", "unary_stream", "stream_unary", "stream_stream"}:
            return self._record(kind)
        raise AttributeError(kind)


def test_generated_stubs_use_the_table_paths() -> None:
    channel = RecordingChannel()
    for grpc_module in modules("pb2_grpc"):
        for attr in dir(grpc_module):
            if attr.endswith("Stub"):
                getattr(grpc_module, attr)(channel)
    expected = [
        (
            ("stream" if m.client_streaming else "unary")
            + "_"
            + ("stream" if m.server_streaming else "unary"),
            m.path,
        )
        for m in METHODS
    ]
    assert sorted(channel.calls) == sorted(expected)


# --- messages and fields -----------------------------------------------------------------


@pytest.mark.parametrize("field", FIELDS, ids=[f"{f.message}.{f.name}" for f in FIELDS])
def test_field(field: Field) -> None:
    messages = all_messages()
    assert field.message in messages, f"message {field.message} is missing"
    desc = messages[field.message].fields_by_name.get(field.name)
    assert desc is not None, f"field {field.name} is missing"
    assert actual(desc) == field


def test_no_unexpected_messages() -> None:
    expected = {f.message for f in FIELDS} | EMPTY_MESSAGES
    assert sorted(all_messages()) == sorted(expected)


def test_no_unexpected_fields() -> None:
    got = sorted(actual(f) for m in all_messages().values() for f in m.fields)
    assert got == sorted(FIELDS)


# --- encoding ----------------------------------------------------------------------------


def test_container_allocate_response_round_trip() -> None:
    response = dp.ContainerAllocateResponse(
        envs={"IOMMUFD": "/dev/iommu", "VFIO_DEVICES": "0000:03:00.0"},
        mounts=[dp.Mount(container_path="/sys/x", host_path="/sys/y", read_only=True)],
        devices=[
            dp.DeviceSpec(container_path="/dev/iommu", host_path="/dev/iommu", permissions="rw"),
            dp.DeviceSpec(
                container_path="/dev/vfio/devices/vfio0",
                host_path="/dev/vfio/devices/vfio0",
                permissions="rw",
            ),
        ],
        annotations={"example.io/a": "b"},
        cdi_devices=[dp.CDIDevice(name="vendor.example/class=dev0")],
    )
    wrapped = dp.AllocateResponse(container_responses=[response])
    parsed = dp.AllocateResponse.FromString(wrapped.SerializeToString())
    assert parsed == wrapped
    got = parsed.container_responses[0]
    assert dict(got.envs) == {"IOMMUFD": "/dev/iommu", "VFIO_DEVICES": "0000:03:00.0"}
    assert [d.host_path for d in got.devices] == ["/dev/iommu", "/dev/vfio/devices/vfio0"]
    assert got.mounts[0].read_only
    assert dict(got.annotations) == {"example.io/a": "b"}
    assert got.cdi_devices[0].name == "vendor.example/class=dev0"


def test_device_wire_bytes() -> None:
    # 0x0a = field 1 LEN (ID), 0x12 = field 2 LEN (health), 0x1a = field 3 LEN (topology);
    # inside: TopologyInfo.nodes 0x0a LEN, NUMANode.ID 0x08 varint.
    raw = b"\x0a\x04dev0\x12\x07Healthy\x1a\x04\x0a\x02\x08\x01"
    device = dp.Device.FromString(raw)
    assert device.ID == "dev0"
    assert device.health == "Healthy"
    assert [n.ID for n in device.topology.nodes] == [1]
    assert device.SerializeToString() == raw


def test_register_request_wire_bytes() -> None:
    raw = b"\x0a\x07v1beta1\x12\x02ep\x1a\x03r/x\x22\x04\x08\x01\x10\x01"
    request = dp.RegisterRequest.FromString(raw)
    assert (request.version, request.endpoint, request.resource_name) == ("v1beta1", "ep", "r/x")
    assert request.options.pre_start_required
    assert request.options.get_preferred_allocation_available
    assert request.SerializeToString() == raw


def test_container_allocate_response_env_wire_bytes() -> None:
    # envs is field 1 of map entries {key = 1, value = 2}; cdi_devices is field 5 (0x2a).
    raw = b"\x0a\x06\x0a\x01K\x12\x01V\x2a\x03\x0a\x01c"
    response = dp.ContainerAllocateResponse.FromString(raw)
    assert dict(response.envs) == {"K": "V"}
    assert [c.name for c in response.cdi_devices] == ["c"]
    assert response.SerializeToString() == raw


def test_preferred_allocation_wire_bytes() -> None:
    raw = b"\x0a\x01a\x0a\x01b\x12\x01a\x18\x02"
    request = dp.ContainerPreferredAllocationRequest.FromString(raw)
    assert list(request.available_deviceIDs) == ["a", "b"]
    assert list(request.must_include_deviceIDs) == ["a"]
    assert request.allocation_size == 2


def test_pod_resources_wire_bytes() -> None:
    # PodResources.cpu_ids = 4, packed int64 (0x22); ClaimResource.share_id = 5 (0x2a).
    pod = podresources.PodResources.FromString(b"\x0a\x01p\x12\x02ns\x22\x02\x03\x05")
    assert (pod.name, pod.namespace, list(pod.cpu_ids)) == ("p", "ns", [3, 5])
    claim = podresources.ClaimResource.FromString(b"\x2a\x00")
    assert claim.HasField("share_id")
    assert claim.share_id == ""
    assert not podresources.ClaimResource().HasField("share_id")


def test_hook_wire_bytes() -> None:
    # InfoResult: name = 1, hookPoints = 3 (0x1a), versions = 4 (0x22); HookPoint.priority = 2.
    raw = b"\x0a\x01h\x1a\x12\x0a\x0eOnDefineDomain\x10\x05\x22\x08v1alpha3"
    result = info.InfoResult.FromString(raw)
    assert result.name == "h"
    assert [(p.name, p.priority) for p in result.hookPoints] == [("OnDefineDomain", 5)]
    assert list(result.versions) == ["v1alpha3"]
    assert result.SerializeToString() == raw

    iso = v1alpha2.PreCloudInitIsoResult.FromString(b"\x0a\x01n\x1a\x01d")
    assert (iso.cloudInitNoCloudSource, iso.cloudInitData) == (b"n", b"d")
    params = v1alpha3.OnDefineDomainParams(domainXML=b"<domain/>", vmi=b"{}")
    assert params.SerializeToString() == b"\x0a\x09<domain/>\x12\x02{}"


def test_plugin_info_wire_bytes() -> None:
    # PluginInfo: type = 1, name = 2 (0x12), endpoint = 3 (0x1a), supported_versions = 4 (0x22).
    raw = b"\x0a\x09DRAPlugin\x12\x01d\x1a\x06/p/dra\x22\x0cv1.DRAPlugin\x22\x11v1beta1.DRAPlugin"
    info_ = pluginregistration.PluginInfo.FromString(raw)
    assert (info_.type, info_.name, info_.endpoint) == ("DRAPlugin", "d", "/p/dra")
    assert list(info_.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert info_.SerializeToString() == raw
    status = pluginregistration.RegistrationStatus(plugin_registered=True, error="e")
    assert status.SerializeToString() == b"\x08\x01\x12\x01e"


def test_dra_claim_wire_bytes() -> None:
    raw = b"\x0a\x02ns\x12\x01u\x1a\x01c"
    for module in (dra_v1, dra_v1beta1):
        claim = module.Claim.FromString(raw)
        assert (claim.namespace, claim.uid, claim.name) == ("ns", "u", "c")
        request = module.NodePrepareResourcesRequest(claims=[claim])
        assert request.SerializeToString() == b"\x0a\x0a" + raw


def test_dra_prepare_response_wire_bytes() -> None:
    # Map entry {key = 1: claim UID, value = 2: NodePrepareResourceResponse{devices = 1,
    # error = 2}}; Device: request_names = 1, pool_name = 2, device_name = 3, cdi_device_ids = 4,
    # share_id = 5 (v1 only).
    device = b"\x0a\x01r\x12\x01p\x1a\x01d\x22\x03x=y"
    raw = b"\x0a\x15\x0a\x01u\x12\x10\x0a\x0e" + device
    for module in (dra_v1, dra_v1beta1):
        response = module.NodePrepareResourcesResponse.FromString(raw)
        got = response.claims["u"].devices[0]
        assert (list(got.request_names), got.pool_name, got.device_name) == (["r"], "p", "d")
        assert list(got.cdi_device_ids) == ["x=y"]
        assert response.SerializeToString() == raw
    failed = dra_v1.NodePrepareResourcesResponse.FromString(b"\x0a\x08\x0a\x01u\x12\x03\x12\x01e")
    assert failed.claims["u"].error == "e"
    assert not failed.claims["u"].devices


def test_dra_share_id_presence_and_v1beta1_compatibility() -> None:
    shared = dra_v1.Device(device_name="d", share_id="").SerializeToString()
    assert shared == b"\x1a\x01d\x2a\x00"
    assert dra_v1.Device.FromString(shared).HasField("share_id")
    assert not dra_v1.Device(device_name="d").HasField("share_id")
    # A v1beta1 peer reads a v1 device with share_id; the extra field is skipped, not an error.
    old = dra_v1beta1.Device.FromString(shared)
    assert old.device_name == "d"
    assert "share_id" not in old.DESCRIPTOR.fields_by_name


def test_dra_unprepare_response_wire_bytes() -> None:
    # Map entry {key = 1: claim UID, value = 2: NodeUnprepareResourceResponse{error = 1}}; an
    # empty value still carries its key, which tells the kubelet the claim was handled.
    raw = b"\x0a\x05\x0a\x01u\x12\x00\x0a\x08\x0a\x01v\x12\x03\x0a\x01e"
    for module in (dra_v1, dra_v1beta1):
        response = module.NodeUnprepareResourcesResponse.FromString(raw)
        assert {uid: r.error for uid, r in response.claims.items()} == {"u": "", "v": "e"}


# --- DRA resource health -----------------------------------------------------------------

HEALTH_MODULES = (health_v1alpha1, health_v1beta1, health_v1)


@pytest.mark.parametrize("module", HEALTH_MODULES, ids=HEALTH)
def test_health_status_enum(module: ModuleType) -> None:
    enum = module.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert enum.full_name == f"{module.DESCRIPTOR.package}.HealthStatus"
    assert {v.name: v.number for v in enum.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
    health = module.DeviceHealth.DESCRIPTOR.fields_by_name["health"]
    assert health.enum_type.full_name == enum.full_name


def test_health_types_do_not_clash_with_the_device_plugin_packages() -> None:
    pool = descriptor_pool.Default()
    modules("pb2")
    device_plugin = pool.FindMessageTypeByName(f"{DP}.Device")
    health = pool.FindMessageTypeByName("v1beta1.DeviceHealth")
    assert device_plugin.file.name == "deviceplugin/v1beta1/api.proto"
    assert health.file.name == "dra/healthapi/v1beta1/api.proto"
    assert pool.FindMessageTypeByName("v1.DeviceHealth").file.name == "dra/healthapi/v1/api.proto"


def test_health_response_wire_bytes() -> None:
    # DeviceHealth: device = 1 (0x0a) {pool_name = 1, device_name = 2 (0x12)}, health = 2
    # (0x10, varint), last_updated_time = 3 (0x18), health_check_timeout_seconds = 4 (0x20),
    # message = 5 (0x2a); the response's devices = 1 (0x0a).
    device = b"\x0a\x06\x0a\x01n\x12\x01d\x10\x02\x18\x0a\x20\x1e\x2a\x02no"
    raw = b"\x0a" + bytes([len(device)]) + device
    for module in HEALTH_MODULES:
        response = module.NodeWatchResourcesResponse.FromString(raw)
        got = response.devices[0]
        assert (got.device.pool_name, got.device.device_name) == ("n", "d")
        assert got.health == module.UNHEALTHY
        assert (got.last_updated_time, got.health_check_timeout_seconds) == (10, 30)
        assert got.message == "no"
        assert response.SerializeToString() == raw
