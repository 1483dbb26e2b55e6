"""Mutating admission webhook: adds the iommufd resource to virt-launcher pods."""
