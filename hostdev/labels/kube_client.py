"""The official `kubernetes` client, configured from a kubeconfig when one is given, else from the
pod's service account: for the Node labels (`node_patch`), and for the DRA driver's calls only
where a configuration needs it (`kube_connection`: exec plugins, auth-providers, proxies)."""

from __future__ import annotations

from pathlib import Path

from kubernetes import client, config


def load_api_client(kubeconfig: Path | None) -> client.ApiClient:
    """A client from `kubeconfig`, or the pod's service account when there is none."""
    if kubeconfig is not None:
        loaded: client.ApiClient = config.new_client_from_config(config_file=str(kubeconfig))
        return loaded
    config.load_incluster_config()
    return client.ApiClient()
