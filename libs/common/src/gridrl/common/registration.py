"""Node side of the master's registry: register, heartbeat, re-register, deregister.

    registrar = NodeRegistrar("master:50050", info_fn=node.info, load_fn=node.load)
    registrar.start()            # returns at once; a background thread does the rest
    ...
    registrar.stop()             # deregisters (best effort) and joins the thread

The thread registers with ``info_fn()``, then heartbeats every interval the master asks for
(start to start), carrying ``info_fn()``'s adapter, queue depth, uptime, stored adapters and
report sequence, and ``load_fn()``.
A heartbeat answered NOT_FOUND (the master restarted without its store, or expired the node)
triggers an immediate re-registration. While the master is unreachable it retries every
``min(retry_interval_s, heartbeat interval)`` seconds on a fresh channel (so gRPC's reconnect
backoff never delays the return), logs once per outage, and never raises into the node.

A refusal that retrying cannot heal (the master answers UNAUTHENTICATED: an unknown or revoked
credential; or PERMISSION_DENIED: e.g. an address another credential holds) is reported on
``on_refused`` (the master's message; None once it accepts again), and after ``max_refusals``
refusals in a row the thread stops and calls ``on_give_up`` with the message, so the node can
exit and its supervisor show it failed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import grpc
import tenacity

from gridrl.common.address import parse_address
from gridrl.common.rpc.channel import Keepalive, connection_hint, dial
from gridrl.common.security.policy import Security
from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

# Deadline of one call to the master, in seconds (registration, deregistration, heartbeat).
CALL_TIMEOUT_S = 5.0
# Used until the master says otherwise.
DEFAULT_HEARTBEAT_INTERVAL_S = 5.0
# Codes after which the channel is replaced (its connection is likely gone).
_RECONNECT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
#: The master refused the credential: retrying with the same one cannot change the answer.
REFUSAL_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class _Stopped(Exception):
    """The registrar is stopping; the worker thread unwinds."""


class NodeRegistrar:
    """Registers a node with the master and heartbeats in a background thread.

    Args:
        master_address: host:port of the master.
        info_fn: returns the node's current ``NodeInfo`` (address, role, backend, adapter,
            queue depth...); called at each registration and each heartbeat.
        load_fn: returns busy slots / capacity in [0, 1]; clamped into [0, 1], NaN or an
            exception read as 0. None: always 0.
        security: the node's TLS files and token for the master (a bare string: a token
            over plaintext), if any.
        retry_interval_s: seconds between attempts while the master is unreachable (capped at
            the heartbeat interval).
        failure_level: ``logging`` level of the once-per-outage failure line (a best-effort
            registration, like the trainer's listing, logs at INFO).
        on_refused: called on the registrar's thread when the master starts refusing the
            credential (:data:`REFUSAL_CODES`; with its message) and when it accepts it again
            (None); it must return quickly.
        max_refusals: refusals in a row after which the registrar gives up (0: never).
        on_give_up: called once on the registrar's thread when it gives up, with the last
            refusal (``"register failed: UNAUTHENTICATED: ..."``); the thread then ends.
        keepalive: HTTP/2 keepalive of the channel to the master (:class:`Keepalive`; None:
            its defaults): a master whose link vanished is noticed after about ``time_s +
            timeout_s`` while no call is in flight, so the heartbeats after the link is back
            go on a fresh connection.

    Raises:
        StatusError: INVALID_ARGUMENT ``master_address: ...`` when not host:port.
    """

    def __init__(self, master_address: str, info_fn: Callable[[], common_pb2.NodeInfo],
                 load_fn: Callable[[], float] | None = None,
                 security: Security | str | None = None,
                 retry_interval_s: float = 2.0, failure_level: int = logging.WARNING,
                 on_refused: Callable[[str | None], None] | None = None,
                 max_refusals: int = 0,
                 on_give_up: Callable[[str], None] | None = None,
                 keepalive: Keepalive | None = None) -> None:
        parse_address(master_address, field="master_address")
        if not retry_interval_s > 0:
            raise ValueError(f"retry_interval_s must be > 0, got {retry_interval_s}")
        if max_refusals < 0:
            raise ValueError(f"max_refusals must be >= 0, got {max_refusals}")
        self._on_refused, self._on_give_up = on_refused, on_give_up
        self.max_refusals = max_refusals
        self._refusals = 0  # in a row
        self._gave_up: str | None = None
        self.master_address = master_address
        self._info_fn = info_fn
        self._load_fn = load_fn
        self._security = security
        self.keepalive = keepalive
        self.retry_interval_s = retry_interval_s
        self._failure_level = failure_level
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel: grpc.Channel | None = None
        self._node_id: str | None = None
        self._registered = False
        self._interval_s = DEFAULT_HEARTBEAT_INTERVAL_S
        self._failing_since: float | None = None  # monotonic start of the current outage
        self._last_failure: str | None = None
        self._logged_in_outage: set[str] = set()
        self._load_fn_failing = False

    @property
    def node_id(self) -> str | None:
        """Id of the last successful registration; None before the first one."""
        return self._node_id

    @property
    def registered(self) -> bool:
        """True while the master acknowledged the last registration or heartbeat."""
        return self._registered

    @property
    def last_failure(self) -> str | None:
        """Why the last call to the master failed, while it keeps failing (None once it
        answers): e.g. ``"register failed: PERMISSION_DENIED: node.address: ..."``."""
        return self._last_failure

    @property
    def refused(self) -> str | None:
        """The master's refusal of the credential while it lasts (None otherwise, and once
        the master accepts again)."""
        return self._last_failure if self._refusals else None

    @property
    def gave_up(self) -> str | None:
        """The last refusal, once the registrar gave up after ``max_refusals``; else None."""
        return self._gave_up

    @property
    def heartbeat_interval_s(self) -> float:
        """Seconds between heartbeats, as the master last said."""
        return self._interval_s

    def start(self) -> None:
        """Start the background thread and return at once. Idempotent.

        Raises:
            RuntimeError: after :meth:`stop` (a registrar is not restartable).
        """
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("NodeRegistrar was stopped; create a new one")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="node-registrar",
                                            daemon=True)
            self._thread.start()

    def stop(self, deregister: bool = True) -> None:
        """Stop heartbeating; with ``deregister``, tell the master the node is leaving (best
        effort: one call of at most ``CALL_TIMEOUT_S``; errors are logged, not raised).
        In-flight calls are cancelled, so this returns promptly. Idempotent."""
        with self._lock:
            already = self._stop.is_set()
            self._stop.set()
            thread = self._thread
        if already:
            return
        self._drop_channel()  # cancels a call in flight
        if thread is not None:
            thread.join()
        node_id = self._node_id
        self._registered = False
        if deregister and node_id is not None:
            channel = dial(self.master_address, self._security, keepalive=self.keepalive)
            try:
                registry_pb2_grpc.RegistryServiceStub(channel).DeregisterNode(
                    registry_pb2.DeregisterNodeRequest(node_id=node_id), timeout=CALL_TIMEOUT_S)
                log.info("deregistered %s from master %s", node_id, self.master_address)
            except grpc.RpcError as e:
                level = logging.DEBUG if e.code() == grpc.StatusCode.NOT_FOUND else logging.WARNING
                log.log(level, "could not deregister %s from master %s: %s: %s", node_id,
                            self.master_address, e.code().name, e.details())
            finally:
                channel.close()

    # -------------------------------------------------------------------------- thread

    def _run(self) -> None:
        """Register (retrying until the master accepts, :meth:`_retrying`), heartbeat until the
        master forgets the node, register again; until :meth:`stop`."""
        while not self._stop.is_set():
            try:
                if self._retrying(self._register):
                    self._heartbeat_until_lost()
            except _Stopped:
                break
            except Exception:  # never let the thread die: the node would silently vanish
                if self._stop.is_set():  # e.g. a call on the channel stop() just closed
                    break
                log.exception("registrar error; retrying")
                self._stop.wait(self._retry_wait_s())
        if self._gave_up is not None:
            self._drop_channel()
        if self._gave_up is not None and self._on_give_up is not None:
            try:
                self._on_give_up(self._gave_up)
            except Exception:
                log.exception("on_give_up failed")

    def _retrying(self, attempt: Callable[[], bool]) -> bool:
        """``attempt()`` until it returns True, every :meth:`_retry_wait_s` seconds (tenacity);
        False once :meth:`stop` was called."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda ok: not ok),
            wait=lambda _: self._retry_wait_s(), stop=tenacity.stop_when_event_set(self._stop),
            sleep=self._stop.wait, retry_error_callback=lambda _: False)
        return retrying(attempt)

    def _heartbeat_until_lost(self) -> None:
        """Heartbeat every interval (start to start; after a failed one, every retry wait)
        until the master answers NOT_FOUND or :meth:`stop`."""
        next_beat = time.monotonic() + self._interval_s
        while not self._stop.wait(max(0.0, next_beat - time.monotonic())):
            next_beat = time.monotonic() + self._interval_s
            outcome = self._heartbeat()
            if outcome == "not_found":
                return
            if outcome == "failed":
                next_beat = time.monotonic() + self._retry_wait_s()

    def _register(self) -> bool:
        try:
            info = self._info_fn()
        except Exception as e:
            self._note_failure("info_fn", f"info_fn raised {e!r}")
            return False
        try:
            response = self._stub().RegisterNode(
                registry_pb2.RegisterNodeRequest(node=info), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            self._rpc_failed("register", e)
            return False
        self._node_id = response.node_id
        self._set_interval(response.heartbeat_interval)
        self._registered = True
        self._note_success()
        log.info("registered %s with master %s as %s (heartbeat every %.2fs)", info.address,
                 self.master_address, response.node_id, self._interval_s)
        return True

    def _heartbeat(self) -> str:
        """One heartbeat; returns "ok", "not_found" or "failed"."""
        try:
            info = self._info_fn()
        except Exception as e:
            self._note_failure("info_fn", f"info_fn raised {e!r}")
            return "failed"
        request = registry_pb2.HeartbeatRequest(node_id=self._node_id or "", adapter=info.adapter,
                                                queue_depth=info.queue_depth, load=self._load(),
                                                sequence=info.sequence, uptime_s=info.uptime_s,
                                                stored_adapters=info.stored_adapters,
                                                resident_adapters=info.resident_adapters,
                                                run_shares=info.run_shares)
        try:
            response = self._stub().Heartbeat(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                self._registered = False
                log.info("master %s does not know %s (%s); registering again",
                         self.master_address, self._node_id, e.details())
                return "not_found"
            self._rpc_failed("heartbeat", e)
            return "failed"
        self._set_interval(response.heartbeat_interval)
        self._registered = True
        self._note_success()
        return "ok"

    def _load(self) -> float:
        if self._load_fn is None:
            return 0.0
        try:
            load = float(self._load_fn())
            self._load_fn_failing = False
        except Exception:
            if not self._load_fn_failing:
                log.exception("load_fn failed; reporting load 0")
            self._load_fn_failing = True
            return 0.0
        return 0.0 if math.isnan(load) else min(1.0, max(0.0, load))

    # ------------------------------------------------------------------------- helpers

    def _stub(self) -> registry_pb2_grpc.RegistryServiceStub:
        with self._lock:
            if self._stop.is_set():
                raise _Stopped
            if self._channel is None:
                self._channel = dial(self.master_address, self._security,
                                     keepalive=self.keepalive)
            return registry_pb2_grpc.RegistryServiceStub(self._channel)

    def _drop_channel(self) -> None:
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def _rpc_failed(self, what: str, e: grpc.RpcError) -> None:
        if self._stop.is_set():
            raise _Stopped
        self._registered = False
        code = e.code()
        if code in _RECONNECT_CODES:
            self._drop_channel()
        hint = connection_hint(code.name, e.details() or "", self._security)
        message = f"{what} failed: {code.name}: {e.details()}{hint}"
        self._note_failure(code.name, message)
        if code in REFUSAL_CODES:
            self._refused(message)

    def _refused(self, message: str) -> None:
        """Count a refusal; tell ``on_refused`` when they start; past ``max_refusals`` in a
        row, give up (the thread unwinds, then calls ``on_give_up``)."""
        self._refusals += 1
        if self._refusals == 1:
            self._tell_refused(message)
        if self.max_refusals and self._refusals >= self.max_refusals:
            log.error("master %s refused this node's credential %d times in a row: %s; giving "
                      "up", self.master_address, self._refusals, message)
            self._gave_up = message
            with self._lock:
                self._stop.set()
            raise _Stopped

    def _tell_refused(self, message: str | None) -> None:
        if self._on_refused is None:
            return
        try:
            self._on_refused(message)
        except Exception:
            log.exception("on_refused failed")

    def _note_failure(self, kind: str, message: str) -> None:
        """Log once per outage and kind of failure; later attempts log at debug level."""
        self._last_failure = message
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        if kind in self._logged_in_outage:
            log.debug("master %s: %s", self.master_address, message)
            return
        self._logged_in_outage.add(kind)
        log.log(self._failure_level, "master %s: %s; retrying every %.1fs until it answers",
                self.master_address, message, self._retry_wait_s())

    def _note_success(self) -> None:
        if self._refusals:
            self._refusals = 0
            self._tell_refused(None)
        if self._failing_since is not None:
            log.info("master %s answers again after %.1fs", self.master_address,
                     time.monotonic() - self._failing_since)
        self._failing_since = None
        self._last_failure = None
        self._logged_in_outage.clear()

    def _set_interval(self, duration) -> None:
        seconds = duration.ToNanoseconds() / 1e9
        if seconds > 0:
            self._interval_s = seconds

    def _retry_wait_s(self) -> float:
        return min(self.retry_interval_s, self._interval_s)
