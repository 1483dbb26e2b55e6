"""The `kubevirt-iommufd` command: one entry point for every component and ops tool."""
