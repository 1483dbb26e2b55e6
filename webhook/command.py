"""`kubevirt-iommufd webhook`: serve the mutating admission webhook until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from webhook.config import Config, ConfigError, read_config
from webhook.connections import IDLE_TIMEOUT, MAX_CONNECTIONS, REQUEST_TIMEOUT, Limits

PROG = "kubevirt-iommufd webhook"


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    webhook = commands.add_parser(
        "webhook",
        help="serve the mutating admission webhook that adds the iommufd resource to VM pods",
        description=(
            "Serve AdmissionReview v1 over HTTPS: /mutate-pod gives the compute container of"
            " a virt-launcher pod that requests a managed VFIO resource the"
            " devices.kubevirt.io/iommufd resource; /mutate-vmi (off unless the config enables"
            " hookSidecar) adds the hook sidecar to VMIs that request managed devices."
            " Certificate and key are reloaded when their files change. /healthz, /readyz and"
            " /metrics are served over plain HTTP on the health port. See docs/webhook.md."
        ),
    )
    webhook.add_argument("--cert", required=True, metavar="FILE", help="PEM certificate chain")
    webhook.add_argument("--key", required=True, metavar="FILE", help="PEM private key")
    webhook.add_argument(
        "--port", type=int, default=8443, help="HTTPS port for admissions (default: 8443)"
    )
    webhook.add_argument(
        "--health-port",
        type=int,
        default=8080,
        help="plain HTTP port for /healthz, /readyz and /metrics (default: 8080)",
    )
    webhook.add_argument(
        "--config",
        metavar="FILE",
        help="YAML or JSON configuration (default: manage nvidia.com/ resources, no sidecar)",
    )
    webhook.add_argument(
        "--max-connections",
        type=_count,
        default=MAX_CONNECTIONS,
        metavar="N",
        help=(
            "open admission connections kept at most; a new one past this evicts the one idle"
            f" longest (default: {MAX_CONNECTIONS}, about 10 MiB of TLS state)"
        ),
    )
    webhook.add_argument(
        "--request-timeout",
        type=_seconds,
        default=REQUEST_TIMEOUT,
        metavar="SECONDS",
        help=(
            "time a connection gets for its TLS handshake and a whole request, and an idle one"
            f" for a request it has begun (default: {REQUEST_TIMEOUT:g})"
        ),
    )
    webhook.add_argument(
        "--idle-timeout",
        type=_seconds,
        default=IDLE_TIMEOUT,
        metavar="SECONDS",
        help=(
            "time an answered keep-alive connection may wait for its next request; keep it above"
            f" the API server's 90 s (default: {IDLE_TIMEOUT:g})"
        ),
    )
    webhook.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="debug also logs pods left unchanged (default: info)",
    )
    webhook.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so that the command's other subcommands start without the server's stack.
    import asyncio

    from webhook.server import ListenError, WebhookServer, serve_until_signalled
    from webhook.tls import TlsError

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = read_config(Path(args.config)) if args.config else Config()
        server = WebhookServer(
            config,
            Path(args.cert),
            Path(args.key),
            port=args.port,
            health_port=args.health_port,
            limits=Limits(args.max_connections, args.request_timeout, args.idle_timeout),
        )
        asyncio.run(serve_until_signalled(server))
    except (ConfigError, TlsError, ListenError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    return 0


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to 100000, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 86_400:
        raise argparse.ArgumentTypeError(
            f"expected seconds above 0 and at most 86400 (e.g. 10 or 0.5), got {text!r}"
        )
    return value
