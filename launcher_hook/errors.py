"""Errors of the launcher hook, split by who has to act: the caller sent something we refuse, or
the VMI asked for iommufd and the node cannot give it."""

from __future__ import annotations


class HookError(Exception):
    """Base of every error the hook reports to virt-launcher or on the command line."""


class InvalidInput(HookError, ValueError):
    """The domain XML or the VMI JSON is malformed, unsafe or too large (gRPC INVALID_ARGUMENT)."""


class IommufdRequired(HookError):
    """Policy `require`, and at least one PCI host device cannot use iommufd
    (gRPC FAILED_PRECONDITION): the VM must not start silently on legacy VFIO."""

    def __init__(self, vmi: str, policy_source: str, problems: tuple[str, ...]) -> None:
        # The VMI's key and device aliases arrive already quoted (hostdev.untrusted).
        self.vmi = vmi
        self.problems = problems
        super().__init__(
            f"vmi {vmi}: iommufd is required (policy require, from {policy_source}) but "
            + "; ".join(problems)
            + "; fix the node, or set annotation iommufd.kubevirt.io/mode=auto to allow legacy"
            " VFIO"
        )
