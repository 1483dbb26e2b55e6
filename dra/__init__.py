"""Kubernetes DRA (Dynamic Resource Allocation) kubelet plugin for VFIO PCI devices.

`kubevirt-iommufd dra` publishes the node's devices as ResourceSlices and prepares allocated
ResourceClaims as CDI devices. `v1/`, `v1beta1/` (the DRAPlugin service) and
`pluginregistration/v1/` (the kubelet's plugin registration) hold the generated gRPC stubs.
"""
