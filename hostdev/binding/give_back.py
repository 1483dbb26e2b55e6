"""Putting functions back exactly where a record says they were (their driver and their
`driver_override`, the NVIDIA unbind lock released) from wherever a bind, a give-back or a run
killed in the middle of either left them: DRA's on-demand binding does this when a claim is
released and at start-up.

Each function is read as it is now and only what differs is written (hostdev.binding.plan's
`plan_return`), so a run killed anywhere is finished by the next one. A function that ends on no
driver though it had one is handed to the kernel to probe. What is reported is what was written
and where each function is afterwards, as read back: never what was meant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hostdev.bdf import Bdf
from hostdev.binding.bind import HostAccess
from hostdev.binding.driver_match import same_driver
from hostdev.binding.plan import Write, WriteKind, plan_return
from hostdev.binding.usage import FunctionState, read_function_state, read_usage
from hostdev.errors import HostdevError
from hostdev.model import is_vfio_driver
from hostdev.scan import scan_host


class GiveBackRefused(HostdevError):
    """A function to give back is still open (a VM that outlived its pod): nothing was written."""


@dataclass(frozen=True, slots=True)
class Returned:
    """One function given back: what was written, and where it is now."""

    bdf: Bdf
    wanted: FunctionState
    after: FunctionState | None
    """None: the function is gone from the host."""
    steps: tuple[str, ...]
    """Each write made or failed, in order, in words."""

    @property
    def ok(self) -> bool:
        return self.after is None or is_at(self.after, self.wanted)

    def __str__(self) -> str:
        if self.after is None:
            return f"{self.bdf} is gone from the host"
        steps = ", ".join(self.steps) or "nothing to do"
        line = f"{self.bdf}: {steps}; now on {_where(self.after)}"
        return line if self.ok else f"{line}, not on {_where(self.wanted)}"


def is_at(now: FunctionState, wanted: FunctionState) -> bool:
    return (
        same_driver(now.driver, wanted.driver)
        and now.override == wanted.override
        and not now.unbind_locked
    )


def give_back(access: HostAccess, wanted: Mapping[Bdf, FunctionState]) -> tuple[Returned, ...]:
    """Put each function in `wanted`, in its order, on its recorded driver and override; the
    caller holds the node's binding lock. Raises GiveBackRefused, before any write, when a
    function that has to leave a VFIO driver is held open."""
    check_free(access, wanted)
    return tuple(_give_back_one(access, bdf, state) for bdf, state in wanted.items())


def check_free(access: HostAccess, wanted: Mapping[Bdf, FunctionState]) -> None:
    """Raise GiveBackRefused when a function that has to leave a VFIO driver is held open."""
    inventory = scan_host(access.root)
    leaving = [
        f.bdf
        for bdf, state in wanted.items()
        if (f := inventory.function(bdf)) is not None
        and is_vfio_driver(f.driver)
        and not same_driver(f.driver, state.driver)
    ]
    problems: list[str] = []
    for usage in read_usage(access.root, inventory, leaving).values():
        problems += [f"{usage.bdf}: {holder}" for holder in usage.holders]
        if usage.unreadable_pids:
            problems.append(
                f"{usage.bdf}: cannot tell whether it is open: the open files of"
                f" {len(usage.unreadable_pids)} processes are unreadable (run as root)"
            )
    if problems:
        raise GiveBackRefused(f"still in use, so left on VFIO: {'; '.join(problems)}")


def _give_back_one(access: HostAccess, bdf: Bdf, wanted: FunctionState) -> Returned:
    if not (access.root / "sys/bus/pci/devices" / str(bdf)).exists():
        return Returned(bdf, wanted, None, ())
    now = read_function_state(access.root, bdf)
    steps: list[str] = []
    for write in plan_return(bdf, now, wanted):
        try:
            access.writer.write(access.root / write.path, write.text)
        except OSError as error:
            # The later writes assume this one took.
            steps.append(f"`{write}` failed: {error.strerror or error}")
            break
        steps.append(_said(write, now))
    after = read_function_state(access.root, bdf)
    if after.driver is None and wanted.driver is not None:
        # Its driver would not take it back: any driver is better than none.
        try:
            access.writer.write(access.root / "sys/bus/pci/drivers_probe", str(bdf))
            steps.append("asked the kernel to probe it")
        except OSError as error:
            steps.append(f"asking the kernel to probe it failed: {error.strerror or error}")
        after = read_function_state(access.root, bdf)
    return Returned(bdf, wanted, after, tuple(steps))


def _said(write: Write, before: FunctionState) -> str:
    if write.kind is WriteKind.UNBIND:
        return f"unbound from {before.driver}"
    if write.kind is WriteKind.OVERRIDE:
        value = write.text.strip()
        return f"set driver_override to {value}" if value else "cleared driver_override"
    if write.kind is WriteKind.BIND:
        return f"bound to {write.path.split('/')[-2]}"
    if write.kind is WriteKind.UNLOCK:
        return "released the NVIDIA unbind lock"
    return str(write)


def _where(state: FunctionState) -> str:
    lock = ", NVIDIA unbind lock taken" if state.unbind_locked else ""
    return f"{state.driver or 'no driver'} (driver_override {state.override or '(null)'}{lock})"
