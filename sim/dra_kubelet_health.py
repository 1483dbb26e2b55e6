"""The DRA kubelet stand-in's health stream for one registration (`sim.dra_kubelet` runs one per
registration that lists a health service), as pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go
runs it: NodeWatchResources in the chosen version for as long as the registration lives; when
the stream ends or cannot be opened, again after `retry` seconds (the kubelet's
wait.UntilWithContext period, 5 s); an UNIMPLEMENTED answer ends it for good; deregistration
cancels it. Each response goes to `receive`, the stand-in's health cache."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import grpc


class HealthStream:
    """One registration's NodeWatchResources, opened again and again until `stop`."""

    def __init__(
        self,
        channel: grpc.Channel,
        messages: ModuleType,
        stubs: ModuleType,
        *,
        receive: Callable[[Any], None],
        note: Callable[[str], None],
        retry: float,
    ) -> None:
        self._stub = stubs.DRAResourceHealthStub(channel)
        self._request = messages.NodeWatchResourcesRequest()
        self._receive = receive
        self._note = note
        self._retry = retry
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="dra-kubelet-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel the stream (the plugin sees its client go) and wait for the thread."""
        self._stopped.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self._watch_once():
                return
            self._stopped.wait(self._retry)

    def _watch_once(self) -> bool:
        """Read one stream to its end; False when the kubelet would not try again."""
        call = self._stub.NodeWatchResources(self._request)
        with self._lock:
            self._call = call
        if self._stopped.is_set():
            call.cancel()
        try:
            self._note("opened")
            for response in call:
                self._receive(response)
            self._note("ended")
        except grpc.RpcError as error:
            code = error.code()
            if code == grpc.StatusCode.CANCELLED and self._stopped.is_set():
                return False
            self._note(f"failed: {code.name}")
            return code != grpc.StatusCode.UNIMPLEMENTED
        finally:
            with self._lock:
                self._call = None
        return True
