"""What a device taint does: an option of the `dra` command, so kept apart from dra.slices, whose
imports the command does not need before it serves the kubelet."""

from __future__ import annotations

import enum


class TaintEffect(enum.StrEnum):
    """What a device taint does to claims that do not tolerate it (and their pods)."""

    NO_SCHEDULE = "NoSchedule"
    """Not allocated to new claims; claims already allocated keep it."""
    NO_EXECUTE = "NoExecute"
    """Also evicts the pods whose claims use it: their VMs stop (a VirtualMachine's run strategy
    decides whether it starts again elsewhere)."""
    NONE = "None"
    """Only shown: allocation and running pods are left alone."""
