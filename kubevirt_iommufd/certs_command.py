"""`kubevirt-iommufd certs`: keep the webhook's serving certificate in a Secret and its CA in the
MutatingWebhookConfiguration - the manifests' self-signed alternative to cert-manager.

Run as a Job (and a CronJob for renewal): the Secret is left alone while its certificate is
valid for the service's names and for more than `--renew-days`; otherwise a new CA and
certificate replace it. The CA bundle is patched into every webhook of the configuration.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import logging
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kubevirt_iommufd.certs")


@dataclass(frozen=True, slots=True)
class CertsTarget:
    namespace: str
    service: str
    secret: str
    webhook_configuration: str
    days: int
    renew_days: int

    @property
    def names(self) -> list[str]:
        return [
            f"{self.service}.{self.namespace}.svc",
            f"{self.service}.{self.namespace}.svc.cluster.local",
            f"{self.service}.{self.namespace}",
            self.service,
        ]


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    certs = commands.add_parser(
        "certs",
        help="create or renew the webhook's self-signed certificate in the cluster",
        description=(
            "Keep a kubernetes.io/tls Secret holding a serving certificate for the webhook's"
            " Service, signed by a CA of its own, and put that CA into the"
            " MutatingWebhookConfiguration. Runs in-cluster (or with --kubeconfig)."
        ),
    )
    certs.add_argument("--namespace", required=True)
    certs.add_argument("--service", required=True, help="the webhook's Service name")
    certs.add_argument("--secret", required=True, help="the TLS Secret to keep")
    certs.add_argument(
        "--webhook-configuration", required=True, help="MutatingWebhookConfiguration name"
    )
    certs.add_argument("--days", type=int, default=365, help="validity (default: 365)")
    certs.add_argument(
        "--renew-days", type=int, default=30, help="renew this close to expiry (default: 30)"
    )
    certs.add_argument("--kubeconfig", help="use this kubeconfig instead of in-cluster config")
    certs.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    if args.days <= args.renew_days:
        print(
            f"kubevirt-iommufd certs: --days {args.days} must exceed --renew-days"
            f" {args.renew_days}, or every run would issue a new certificate",
            file=sys.stderr,
        )
        return 2
    target = CertsTarget(
        args.namespace,
        args.service,
        args.secret,
        args.webhook_configuration,
        args.days,
        args.renew_days,
    )
    try:
        if args.kubeconfig:
            config.load_kube_config(args.kubeconfig)
        else:
            config.load_incluster_config()
        api = client.ApiClient()
        ensure_certificate(client.CoreV1Api(api), client.AdmissionregistrationV1Api(api), target)
    except (ApiException, ConfigException) as error:
        reason = getattr(error, "reason", None) or str(error)
        print(f"kubevirt-iommufd certs: {reason}", file=sys.stderr)
        return 1
    return 0


def ensure_certificate(core: Any, admission: Any, target: CertsTarget) -> None:
    """Make the Secret hold a valid certificate for the Service, and the webhooks trust its CA.

    `core` and `admission` are the kubernetes client's CoreV1Api and AdmissionregistrationV1Api
    (untyped upstream)."""
    from kubernetes.client import V1ObjectMeta, V1Secret
    from kubernetes.client.exceptions import ApiException

    from webhook.certs import build_serving_certificate

    secret = None
    try:
        secret = core.read_namespaced_secret(target.secret, target.namespace)
    except ApiException as error:
        if error.status != 404:
            raise
    data = dict(secret.data or {}) if secret is not None else {}
    reason = renewal_reason(data, target, datetime.datetime.now(datetime.UTC))
    if reason is None:
        log.info("certificate in secret=%s/%s is current", target.namespace, target.secret)
        ca = base64.b64decode(data["ca.crt"])
    else:
        issued = build_serving_certificate(target.names, days=target.days)
        # The webhook pods see the new Secret only when the kubelet syncs it (a minute or two):
        # until then they serve the old certificate, so the bundle trusts both CAs. The next
        # run, finding the certificate current, trusts the new CA alone.
        ca = issued.ca_pem + _previous_ca(data)
        body = V1Secret(
            metadata=V1ObjectMeta(
                name=target.secret,
                namespace=target.namespace,
                labels={"app.kubernetes.io/part-of": "kubevirt-iommufd"},
            ),
            type="kubernetes.io/tls",
            data={
                "tls.crt": _b64(issued.cert_pem),
                "tls.key": _b64(issued.key_pem),
                "ca.crt": _b64(issued.ca_pem),
            },
        )
        if secret is None:
            core.create_namespaced_secret(target.namespace, body)
        else:
            core.replace_namespaced_secret(target.secret, target.namespace, body)
        log.info(
            "issued certificate secret=%s/%s reason=%r", target.namespace, target.secret, reason
        )
    configuration = admission.read_mutating_webhook_configuration(target.webhook_configuration)
    bundle = _b64(ca)
    patch = [
        {
            "op": "replace" if hook.client_config.ca_bundle else "add",
            "path": f"/webhooks/{index}/clientConfig/caBundle",
            "value": bundle,
        }
        for index, hook in enumerate(configuration.webhooks or [])
        if hook.client_config.ca_bundle != bundle
    ]
    if patch:
        admission.patch_mutating_webhook_configuration(target.webhook_configuration, patch)
        log.info(
            "CA bundle set webhooks=%d configuration=%s", len(patch), target.webhook_configuration
        )


def renewal_reason(data: dict[str, str], target: CertsTarget, now: datetime.datetime) -> str | None:
    """Why the Secret's certificate must be replaced, or None while it is good."""
    # Here rather than at the top: the command's other subcommands need no X.509.
    from cryptography import x509

    if not {"tls.crt", "tls.key", "ca.crt"} <= data.keys():
        return "no certificate yet"
    try:
        cert = x509.load_pem_x509_certificate(base64.b64decode(data["tls.crt"]))
    except ValueError:
        return "the certificate does not parse"
    if cert.not_valid_after_utc - now < datetime.timedelta(days=target.renew_days):
        return f"it expires {cert.not_valid_after_utc:%Y-%m-%d}"
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return "it names no host"
    missing = set(target.names) - set(names.value.get_values_for_type(x509.DNSName))
    if missing:
        return f"it does not name {', '.join(sorted(missing))}"
    return None


def _previous_ca(data: dict[str, str]) -> bytes:
    from cryptography import x509

    try:
        pem = base64.b64decode(data["ca.crt"])
        x509.load_pem_x509_certificate(pem)
    except (KeyError, ValueError):
        return b""
    return pem


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
