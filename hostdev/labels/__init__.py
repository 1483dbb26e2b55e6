"""What a node tells the scheduler about itself: `kubevirt-iommufd.io/` labels.

`node_labels` computes them (pure); `feature_file` writes them for NFD, `node_patch` patches the
Node through the API (`kube_client` configures the client), and `publisher` keeps either up to
date from a background thread.
"""
