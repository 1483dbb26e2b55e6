"""Kubernetes DRA (Dynamic Resource Allocation) kubelet plugin for VFIO PCI devices.

`kubevirt-iommufd dra` publishes the node's devices as ResourceSlices and prepares allocated
ResourceClaims as CDI devices. `v1/`, `v1beta1/` (the DRAPlugin service),
`healthapi/{v1,v1beta1,v1alpha1}/` (DRAResourceHealth) and `pluginregistration/v1/` (the
kubelet's plugin registration) hold the generated gRPC stubs.
"""
