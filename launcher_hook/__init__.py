"""KubeVirt hook sidecar that moves VFIO host devices to iommufd."""
