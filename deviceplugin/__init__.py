"""Kubelet device plugin: VFIO PCI resources and the prepared iommufd resource."""
