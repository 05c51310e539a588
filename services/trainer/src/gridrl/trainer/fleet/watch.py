"""Follow the master's ``WatchNodes`` stream of rollout nodes, reconnecting when it breaks.

    watch = MasterWatch("master:50050", on_event=handle, on_connect=reset)
    watch.start()      # returns at once; a thread follows the stream
    ...
    watch.stop()       # cancels the stream and joins the thread

Every (re)connection starts a fresh stream: ``on_connect()`` is called, then the master sends a
SNAPSHOT of the rollout nodes, SNAPSHOT_END, then JOINED / CHANGED / REMOVED as they happen;
each message goes to ``on_event``. When the master restarts or is unreachable the thread retries
on a fresh channel (so gRPC's reconnect backoff never delays it) every ``retry_s`` seconds at
most, logging once per outage. The nodes already known keep serving meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from gridrl.common.rpc.channel import Keepalive, dial
from gridrl.common.security.policy import Security
from gridrl.trainer.fleet.backoff import Backoff
from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)


class MasterWatch:
    """A background thread following ``RegistryService.WatchNodes(role=ROLLOUT)``.

    Args:
        address: host:port of the master.
        on_event: called with each ``WatchNodesResponse``, in stream order, from the thread.
        on_connect: called before the first message of every new stream.
        security: TLS files and token for the master (:class:`gridrl.common.security.policy.Security`),
            if any.
        retry_s: most seconds between reconnection attempts (backoff starts at a tenth).
        keepalive: the stream's keepalive (a master whose link vanished is noticed after
            about ``time_s + timeout_s``); None: the default.
    """

    def __init__(self, address: str, on_event: Callable[[registry_pb2.WatchNodesResponse], None],
                 on_connect: Callable[[], None], security: Security | None = None,
                 retry_s: float = 2.0, keepalive: Keepalive | None = None) -> None:
        self.address = address
        self._keepalive = keepalive
        self._on_event = on_event
        self._on_connect = on_connect
        self._security = security
        self.retry_s = retry_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, name="master-watch", daemon=True)
        self.connected = False
        self.ever_connected = False  # a stream ever answered (else an outage lost nothing)
        self.last_error = ""

    def start(self) -> None:
        """Start following the stream; returns at once."""
        self._thread.start()

    def stop(self) -> None:
        """Cancel the stream and join the thread. Idempotent."""
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        backoff = Backoff(self.retry_s / 10, self.retry_s)
        failures = 0  # attempts since the last stream that answered
        outage_since: float | None = None
        while not self._stop.is_set():
            channel = dial(self.address, self._security, keepalive=self._keepalive)
            try:
                call = registry_pb2_grpc.RegistryServiceStub(channel).WatchNodes(
                    registry_pb2.WatchNodesRequest(role=common_pb2.NODE_ROLE_ROLLOUT))
                with self._lock:
                    self._call = call
                if self._stop.is_set():
                    call.cancel()
                first = True
                for response in call:
                    if first:
                        first = False
                        self.connected = self.ever_connected = True
                        failures = 0
                        if outage_since is not None:
                            log.info("master %s: watching nodes after %.1fs",
                                     self.address, time.monotonic() - outage_since)
                            outage_since = None
                        self._on_connect()
                    self._on_event(response)
                self.last_error = "the master ended the stream (stopping)"
            except grpc.RpcError as e:
                if self._stop.is_set():
                    break
                self.last_error = f"{e.code().name}: {e.details()}"
            except Exception as e:  # a handler bug must not end discovery silently
                log.exception("master %s: node event handler failed; reconnecting", self.address)
                self.last_error = repr(e)
            finally:
                with self._lock:
                    self._call = None
                channel.close()
            self.connected = False
            if self._stop.is_set():
                break
            if outage_since is None:
                outage_since = time.monotonic()
                if self.ever_connected:
                    log.warning("master %s: node watch lost (%s); reconnecting every %.1fs at "
                                "most, known nodes keep serving", self.address,
                                self.last_error, self.retry_s)
                else:  # never connected: nothing was lost
                    log.warning("master %s: not reachable yet (%s); retrying every %.1fs at "
                                "most", self.address, self.last_error, self.retry_s)
            failures += 1
            self._stop.wait(backoff.delay(failures))
