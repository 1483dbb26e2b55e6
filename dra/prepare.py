"""NodePrepareResources and NodeUnprepareResources, as the kubelet asks them: per claim, read
the allocation from the API server and the devices from the host, let the plan
(dra.prepare_plan) decide, bind what it says, write the CDI spec and metadata, remember the
claim; later, take all of it back. Either call may come again at any time (kubelet retries,
restarts of either side) and must give the same answer without doing the work twice.

Every failure is the claim's own answer (an error string naming the claim, the device and the
fix); one bad claim never fails the others of the same call.

What survives a power loss: the claim's record, written durably (dra.state) after its files and
before the kubelet hears the claim is prepared. The CDI spec (on /var/run/cdi) and the metadata
file (in the run directory, `--run-dir`), both on a tmpfs and so gone after any reboot, are only
written whole, without a sync: what a retried NodePrepare finds missing or not whole it writes
again from the claim, so a record never answers for files that are not there.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dra.api import ApiError
from dra.binding import BindingError, OnDemandBinder
from dra.claims import ClaimAllocation, ClaimError, ClaimRef, parse_allocation
from dra.devices import DraDevice
from dra.host_cache import HostCache
from dra.prepare_plan import (
    BindFirst,
    Paths,
    Refusal,
    WritePlan,
    bdfs_named,
    is_still_on_vfio,
    plan_prepare,
    same_allocation,
)
from dra.serialize_lock import SerializeLock
from dra.state import ClaimStore, PreparedClaim, StateError
from hostdev.atomic_file import write_file_whole
from hostdev.bdf import Bdf
from hostdev.errors import HostdevError
from hostdev.iommufd_handoff import HandoffConfig, HandoffError, IommufdHandoff, read_waiting_ids
from hostdev.untrusted import quote_untrusted

log = logging.getLogger(__name__)
# Object names and UIDs as the API server allows them; anything else never reaches a path.
_UID = re.compile(r"[a-z0-9]([-a-z0-9]{0,62})")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class ClaimReader(Protocol):
    def read_claim(self, namespace: str, name: str) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ClaimsChanged:
    """Posted after a claim was prepared or forgotten: which group companions may be published
    changed (the store says which groups are held now)."""

    uid: str


class ChangeSink(Protocol):
    def put(self, item: ClaimsChanged, /) -> None: ...


class ClaimPreparer:
    def __init__(
        self,
        driver: str,
        pool: str,
        claims: ClaimReader,
        host: HostCache,
        store: ClaimStore,
        paths: Paths,
        *,
        changes: ChangeSink | None = None,
        binder: OnDemandBinder | None = None,
        serialize: SerializeLock | None = None,
        handoff: HandoffConfig | None = None,
    ) -> None:
        self._driver = driver
        self._pool = pool
        self._claims = claims
        self._host = host
        self._store = store
        self._paths = paths
        self._changes = changes
        """Told of each claim prepared or forgotten (a queue the driver's event thread reads):
        the kubelet's call never waits for the slices to be published."""
        self._binder = binder
        """Binds on-demand devices; without one only devices already on VFIO are prepared."""
        # One claim at a time: two claims racing for one device must not both see it free. It
        # is never held over a call to the API server, so NodeUnprepare never waits on one.
        self._lock = threading.Lock()
        self._serialize = serialize
        """The same across every instance of the driver on the node (a rolling update runs two):
        held, with the records read again, wherever `_lock` is held for the claims' state."""
        self._handoff_config = handoff
        """Where and for whom claims on iommufd slots get their sockets (`paths.handoff_dir`);
        the hand-off itself starts with `recover`."""
        self._handoff: IommufdHandoff | None = None

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim | str]:
        answers: dict[str, PreparedClaim | str] = {}
        for ref in refs:
            try:
                answers[ref.uid] = self._prepare_one(ref)
            except (ClaimError, ApiError, StateError, BindingError, HostdevError, OSError) as error:
                # Every failure is this claim's answer; the others of the call go on.
                message = str(error) if isinstance(error, ClaimError) else f"{ref}: {error}"
                if isinstance(error, ApiError):
                    message += "; the kubelet retries"
                log.warning("prepare failed: %s", quote_untrusted(message, 500))
                answers[ref.uid] = message
        return answers

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str | None]:
        answers: dict[str, str | None] = {}
        for ref in refs:
            try:
                self._unprepare_one(ref)
                answers[ref.uid] = None
            except (ClaimError, OSError, StateError, BindingError, HostdevError) as error:
                message = f"{ref}: cannot clean up: {error}"
                log.warning("unprepare failed: %s", quote_untrusted(message, 500))
                answers[ref.uid] = message
        return answers

    def recover(self) -> list[str]:
        """Start-up recovery (OnDemandBinder.recover) over the prepared claims on disk, under the
        serialize lock: a living instance binds and gives back only while holding it, so an
        entry found half-done here is a dead run's, never a bind the other instance is doing.
        That covers what another instance left (the pass `_serialized` makes for a prepare):
        all of it is reported here, as the start-up recovery."""
        with self._serialized(others=False):
            lines = [] if self._binder is None else self._binder.recover(c.uid for c in self._store)
            if self._handoff_config is not None and self._handoff is None:
                lines += self._serve_handoffs(self._handoff_config)
            return lines

    def close(self) -> None:
        """Stop the iommufd hand-off: every fd still waiting is closed, its socket removed."""
        if self._handoff is not None:
            self._handoff.close()

    def _serve_handoffs(self, config: HandoffConfig) -> list[str]:
        """Start the hand-off and serve again, each with a new fd, the sockets of prepared
        claims a previous run left waiting (their pods may not have started yet; a served or
        expired socket leaves no file). Sockets of claims never recorded (a run killed between
        binding a socket and recording its claim) are removed by the hand-off's start."""
        waiting = read_waiting_ids(config.socket_dir)
        self._handoff = IommufdHandoff(config)
        lines: list[str] = []
        for claim in self._store:
            if not claim.handoff or claim.uid not in waiting:
                continue
            ref = ClaimRef(claim.namespace, claim.name, claim.uid)
            try:
                self._handoff.prepare(claim.uid)
            except (HandoffError, OSError) as error:
                lines.append(
                    f"{ref}: its iommufd hand-off was still waiting and cannot be served again:"
                    f" {error}; its VM gets no prepared fd: recreate the pod once that is fixed"
                )
                continue
            lines.append(f"{ref}: its iommufd hand-off was still waiting: served again")
        return lines

    @contextmanager
    def _serialized(self, *, others: bool = True) -> Iterator[None]:
        """The in-process lock, then the node's serialize lock, then the records as they are on
        disk now (another instance may have prepared or unprepared since), and (`others`)
        whatever another instance killed in a bind or a give-back left half-done put back (a
        rolling update's old pod, killed: the new one must not wait for its own restart to
        free those devices)."""
        with self._lock, self._serialize.hold() if self._serialize else nullcontext():
            self._store.refresh()
            if others and self._serialize is not None and self._binder is not None:
                prepared = [c.uid for c in self._store]
                for line in self._binder.recover(prepared, others_only=True):
                    log.warning("recovery after another instance of the driver: %s", line)
            yield

    def _prepare_one(self, ref: ClaimRef) -> PreparedClaim:
        _check_ref(ref)
        # A first look without the locks: a claim prepared already (a kubelet retry) is answered
        # from the records as they are on disk. An unprepare under way changes the claim's
        # mark either after this look, which stops this prepare below, or before it, as if this
        # call had come after that one, which is what waiting for the locks here would give.
        self._store.refresh()
        known = self._store.get(ref.uid)
        if known is not None and self._still_prepared(known):
            return known
        unprepared = self._store.unprepared_mark(ref.uid)
        # The API server is asked without the lock: a slow answer holds up this claim only.
        claim = self._claims.read_claim(ref.namespace, ref.name)
        allocation = parse_allocation(claim, ref, self._driver, self._pool)
        with self._serialized():
            if self._store.unprepared_mark(ref.uid) != unprepared:
                # Unprepared meanwhile, by this instance or the other: going on would bind and
                # record a claim the kubelet has let go of, which nothing would ever unprepare.
                raise ClaimError(
                    f"{ref}: unprepared while its claim was being read from the API server, so"
                    " it is not prepared; the kubelet asks again if a pod still needs it"
                )
            # Looked at again: while the answer came, another call may have prepared this claim
            # (a kubelet retry) or taken its devices for another.
            known = self._store.get(ref.uid)
            if (
                known is not None
                and same_allocation(known, allocation)
                and self._still_prepared(known)
            ):
                return known
            prepared = self._prepare_locked(allocation, known)
        self._announce(ref.uid)
        # Quoting the claim's names costs more than the rest of the line: only when it is shown.
        if log.isEnabledFor(logging.INFO):
            log.info(
                "prepared %s: %s",
                quote_untrusted(str(ref)),
                ", ".join(
                    [
                        *(
                            f"{d.device} ({d.bdf}) for request {quote_untrusted(d.request)}"
                            for d in prepared.devices
                        ),
                        *(
                            f"{s.device} (iommufd hand-off {prepared.handoff}) for request"
                            f" {quote_untrusted(s.request)}"
                            for s in prepared.slots
                        ),
                    ]
                ),
            )
        return prepared

    def _prepare_locked(
        self, allocation: ClaimAllocation, known: PreparedClaim | None
    ) -> PreparedClaim:
        """Plan the claim, bind what the plan says, write its files and record it."""
        judged = dict(self._host.judge_now(bdfs_named(allocation)))
        plan = self._plan(allocation, known, judged)
        bound = started = False
        try:
            if isinstance(plan, BindFirst) and self._binder is not None:
                judged |= self._bind(self._binder, allocation.ref, plan)
                bound = True
                plan = self._plan(allocation, known, judged)
            if isinstance(plan, BindFirst):
                raise ClaimError(
                    f"{allocation.ref}: {', '.join(map(str, plan.bdfs))} still on their host"
                    " drivers after binding them to VFIO; the kubelet retries"
                )
            # Before the CDI spec that mounts the socket is written: once the spec is there, the
            # socket is too.
            started = self._start_handoff(allocation.ref, plan.claim)
            for file in plan.files:
                write_file_whole(file.path, file.content, 0o644)
            self._store.save(plan.claim)
        except BaseException:
            # Whatever went wrong, devices bound for a claim that is not recorded must not stay
            # on VFIO: they would be published as free and taken from under the next claim.
            if bound and known is None:
                self._give_back(allocation.ref)
            if started and self._handoff is not None:
                self._handoff.cancel(allocation.ref.uid)
            raise
        return plan.claim

    def _start_handoff(self, ref: ClaimRef, claim: PreparedClaim) -> bool:
        """Serve the claim's iommufd fd on its socket, unless it needs none or is served
        already (a claim prepared again for a lost file); whether it was started here."""
        if not claim.handoff:
            return False
        if self._handoff is None:
            raise ClaimError(
                f"{ref}: the iommufd hand-off is not running (the driver is starting or"
                " stopping); the kubelet retries"
            )
        if self._handoff.holds(ref.uid):
            return False
        try:
            self._handoff.prepare(ref.uid)
        except HandoffError as error:
            raise ClaimError(f"{ref}: cannot prepare its iommufd fd: {error}") from error
        return True

    def _plan(
        self,
        allocation: ClaimAllocation,
        known: PreparedClaim | None,
        judged: Mapping[Bdf, DraDevice | str],
    ) -> BindFirst | WritePlan:
        plan = plan_prepare(
            allocation,
            known,
            judged,
            (c for c in self._store if c.uid != allocation.ref.uid),
            driver=self._driver,
            paths=self._paths,
            can_bind=self._binder is not None,
            journaled=self._binder.journaled() if self._binder is not None else None,
        )
        if isinstance(plan, Refusal):
            raise ClaimError(plan.message)
        return plan

    def _bind(
        self, binder: OnDemandBinder, ref: ClaimRef, plan: BindFirst
    ) -> dict[Bdf, DraDevice | str]:
        """Bind on-demand devices to VFIO for the claim; their devices as they are then."""
        latest: dict[Bdf, DraDevice | str] = {}

        def ready() -> bool:
            latest.update(self._host.judge_now(plan.bdfs))
            return all(
                isinstance(d, DraDevice) and not d.bind_on_demand and not d.nodes_pending
                for d in latest.values()
            )

        try:
            binder.bind(ref.uid, plan.bdfs, plan.reset_after_use, ready)
        except (BindingError, HostdevError, OSError) as error:
            raise ClaimError(f"{ref}: {error}") from error
        return latest

    def _give_back(self, ref: ClaimRef) -> None:
        if self._binder is None:
            return
        try:
            self._binder.release(ref.uid)
        except (BindingError, HostdevError, OSError) as error:
            log.error(
                "%s: giving back the devices bound for it failed: %s; the driver gives them"
                " back at its next start",
                quote_untrusted(str(ref)),
                error,
            )

    def _still_prepared(self, claim: PreparedClaim) -> bool:
        """Whether a prepared claim's files are all there and whole and its on-demand devices
        still on VFIO: if not, it is prepared again."""
        if not all(_is_whole_json(Path(f)) for f in claim.files):
            return False
        if self._binder is None or not self._binder.holds(claim.uid):
            return True
        return is_still_on_vfio(self._host.judge_now(d.bdf for d in claim.devices))

    def _announce(self, uid: str) -> None:
        if self._changes is not None:
            self._changes.put(ClaimsChanged(uid))

    def _unprepare_one(self, ref: ClaimRef) -> None:
        _check_ref(ref)
        with self._serialized():
            self._store.mark_unprepared(ref.uid)
            known = self._store.get(ref.uid)
            # The files are named after the claim, so one whose record was never written (a
            # crash between writing and recording) is still cleaned up.
            files = (
                self._paths.with_earlier_places(known.files)
                if known
                else self._paths.files_of(self._driver, ref.uid)
            )
            for name in files:
                Path(name).unlink(missing_ok=True)
            # One lstat when there is none (every claim prepared since the files lay flat).
            shutil.rmtree(self._paths.legacy_metadata_root(ref.uid), ignore_errors=True)
            if known is None or known.handoff:
                self._withdraw_handoff(ref.uid)
            # The record goes last: while the devices are not back, their group stays held.
            if self._binder is not None:
                self._binder.release(ref.uid)
            self._store.forget(ref.uid)
        if known is not None:
            if log.isEnabledFor(logging.INFO):
                log.info("unprepared %s", quote_untrusted(str(ref)))
            self._announce(ref.uid)

    def _withdraw_handoff(self, uid: str) -> None:
        """Close the claim's iommufd fd if nobody took it, and remove its socket now (the
        serving thread would only at its next turn)."""
        socket = self._paths.handoff(uid)
        if socket is None:
            return
        if self._handoff is not None:
            self._handoff.cancel(uid)
        socket.unlink(missing_ok=True)


def _is_whole_json(path: Path) -> bool:
    """Whether `path` holds one whole JSON document, as every file of a claim does when written:
    after a power loss one may be missing, empty or cut short (it is written without a sync)."""
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return True


def _check_ref(ref: ClaimRef) -> None:
    if not _UID.fullmatch(ref.uid):
        raise ClaimError(f"claim uid {quote_untrusted(ref.uid)} is not a Kubernetes UID")
    if not _NAME.fullmatch(ref.namespace) or not _NAME.fullmatch(ref.name):
        raise ClaimError(
            f"claim {quote_untrusted(ref.namespace)}/{quote_untrusted(ref.name)}: not a valid"
            " namespace and object name"
        )
