"""What the driver knows about each published device's health, as plain values.

One list of these is what the kubelet's health stream carries (KEP-4680) and what the slices'
taints follow (KEP-5055): both read the same judgement, so they never disagree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Health(enum.IntEnum):
    """The kubelet's HealthStatus, with the same numbers as on the wire."""

    UNKNOWN = 0
    HEALTHY = 1
    UNHEALTHY = 2


class TaintEffect(enum.StrEnum):
    """What a device taint does to claims that do not tolerate it (and their pods)."""

    NO_SCHEDULE = "NoSchedule"
    """Not allocated to new claims; claims already allocated keep it."""
    NO_EXECUTE = "NoExecute"
    """Also evicts the pods whose claims use it: their VMs stop (a VirtualMachine's run strategy
    decides whether it starts again elsewhere)."""
    NONE = "None"
    """Only shown: allocation and running pods are left alone."""


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """One device of the driver's pool (named as in the slice) as last checked."""

    device: str
    health: Health
    message: str
    """Why, in words an operator can act on; empty when healthy."""
    checked_at: float
    """Unix time of the check that found this state (the stream's last_updated_time)."""
