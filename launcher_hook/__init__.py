"""KubeVirt hook sidecar that moves VFIO host devices to iommufd.

Functional core: `parse` (safe XML and VMI JSON at the edge), `decide` (backend per PCI host
device, no XML), `domain` (the lxml rewrite, its record in <metadata>, and its undo), `model`
(values) and `errors`. Imperative shell: `capabilities` (reads the node and asks libvirt),
`handler` (one OnDefineDomain: detect, rewrite, log), `server` (gRPC Info + Callbacks
v1alpha1..3 on a unix socket) and `command` (`kubevirt-iommufd hook`, `onDefineDomain`).
`hooks/` holds the generated gRPC stubs. See docs/launcher-hook.md.
"""
