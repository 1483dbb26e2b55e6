"""What a node tells the scheduler about itself: `kubevirt-iommufd.io/` labels.

`node_labels` computes them (pure); `feature_file` writes them for NFD, `node_patch` patches the
Node through the API (`kube_client` configures the official client), and `publisher` keeps either
up to date from a background thread. `kubeconfig` and `kube_connection` are the lighter
connection the DRA driver's calls use: a kubeconfig or the service account read as client-go
does, with the official client loaded only for what only it handles.
"""
