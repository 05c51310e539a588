"""RolloutService over gRPC, and the wiring of a rollout node (backend, engine, adapter store,
server, registration with the master).

    node = RolloutNode(backend, NodeConfig(listen="127.0.0.1:50051", master="m:50050"))
    node.start()   # binds; node.address / node.port
    node.wait()    # until SIGTERM/SIGINT or node.stop()
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

from gridrl.adapters.wire import adapter_format_to_proto, base_model_to_proto
from gridrl.common.errors import Kind, StatusError
from gridrl.common.faults import pause_in_stream, pause_point
from gridrl.common.rpc.channel import NODE_REQUEST_BYTES, dial
from gridrl.common.rpc.server import GrpcServer
from gridrl.common.security.access import caller, relay_reader_refusal
from gridrl.common.sequence import ReportSequence
from gridrl.common.transport import decode_read_response, encode_read_response
from gridrl.engine.contract import Backend
from gridrl.engine.threads import release_thread_state
from gridrl.rollout.adapter_manager import AdapterManager
from gridrl.rollout.adapter_store import AdapterStore
from gridrl.rollout.apply_deadline import ApplyDeadline
from gridrl.rollout.cache import ephemeral_dir
from gridrl.rollout.config import NodeConfig, adapter_root, node_name
from gridrl.rollout.jobs import GenerateOutcome
from gridrl.rollout.kv_budget import KvBudget
from gridrl.rollout.relay import ARRIVAL_WAIT_S
from gridrl.rollout.scheduler import BatchScheduler
from gridrl.rollout.text import TextCodec
from gridrl.rollout.validation import Limits, validate_generate
from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from gridrl.v1.enums import enum_value

log = logging.getLogger(__name__)

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


# ReadAdapter's method path (read_from_peer calls it with its own response decoder)
READ_ADAPTER = f"/{SERVICE_NAME}/ReadAdapter"


def software_version() -> str:
    """Version of the installed gridrl-rollout distribution."""
    try:
        return importlib.metadata.version("gridrl-rollout")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """gRPC face of a :class:`RolloutNode`. Handlers raise ``StatusError``; the shared server
    interceptor turns it into the status the client sees."""

    def __init__(self, node: RolloutNode) -> None:
        self._node = node

    def Generate(self, request: rollout_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> rollout_pb2.GenerateResponse:
        """Sample ``sampling.n`` completions of the prompt, batched with concurrent requests.

        Returns the samples (token ids, one float32 behaviour logprob per token, text, finish
        reason, adapter name and version), the prompt's token ids and the seconds from arrival
        to the end of the request's last batch.

        Raises:
            StatusError: INVALID_ARGUMENT naming the field (see
                :func:`gridrl.rollout.validation.validate_generate`); RESOURCE_EXHAUSTED when
                the queue is full; UNAVAILABLE while shutting down; CANCELLED when the client
                went away before the request started.
        """
        node = self._node
        job = validate_generate(request, node.limits, node.codec.encode)
        future = node.engine.submit(job, base_model=request.base_model)
        context.add_callback(future.cancel)  # drops it from the queue if the client leaves
        pause_point("rollout.generate")  # test-only (gridrl.common.faults): kill here
        try:
            outcome: GenerateOutcome = future.result()
        except concurrent.futures.CancelledError as e:
            raise StatusError(Kind.CANCELLED, "request cancelled before it "
                                                         "started") from e
        adapter = outcome.adapter
        samples = [common_pb2.Sample(
            token_ids=r.token_ids, logprobs=r.logprobs, text=node.codec.decode(r.token_ids),
            finish_reason=enum_value(common_pb2.FinishReason, r.finish_reason, default=0), adapter_version=adapter.version,
            adapter_name=adapter.name) for r in outcome.samples]
        return rollout_pb2.GenerateResponse(samples=samples, prompt_token_ids=job.prompt_ids,
                                            duration_s=outcome.duration_s)

    def PushAdapter(self, request_iterator, context: grpc.ServicerContext
                    ) -> rollout_pb2.PushAdapterResponse:
        """Receive an adapter (header, then chunks), verify, convert, store and serve it.
        See :meth:`gridrl.rollout.adapter_manager.AdapterManager.push` for the errors."""
        # test-only pause after the header (gridrl.common.faults): kill mid-push
        return self._node.adapters.push(pause_in_stream(request_iterator, "rollout.push"),
                                        ApplyDeadline.of_rpc(context))

    def FetchAdapter(self, request: rollout_pb2.FetchAdapterRequest,
                     context: grpc.ServicerContext) -> rollout_pb2.FetchAdapterResponse:
        """Fetch an adapter from the peers the trainer names (relay fan-out), verify every
        piece and file against the trainer's digests, then apply it like a push. See
        :meth:`gridrl.rollout.adapter_manager.AdapterManager.fetch` for the errors."""
        return self._node.adapters.fetch(request, self._node.read_from_peer,
                                         ApplyDeadline.of_rpc(context))

    def ReadAdapter(self, request: rollout_pb2.ReadAdapterRequest,
                    context: grpc.ServicerContext):
        """Stream the verified pieces of an adapter version this node holds or is receiving,
        from ``request.offset`` on, to a node the trainer listed as one of its readers.

        Yields:
            ``ReadAdapterResponse`` (offset in the concatenated files, one piece of bytes),
            serialized here (``transport.encode_read_response``: one copy of the piece).
        Raises:
            StatusError: PERMISSION_DENIED (the caller's credential has no address, or its
                address is not among the version's readers), NOT_FOUND (the version neither
                held nor arriving within ``relay.ARRIVAL_WAIT_S`` or the call's deadline),
                INVALID_ARGUMENT (name empty, offset not a piece boundary), ABORTED (this
                node's own transfer of it failed), DEADLINE_EXCEEDED.
        """
        credential = caller()
        if credential is not None and not credential.address:
            raise StatusError(Kind.PERMISSION_DENIED,
                              relay_reader_refusal(credential, ()) or "no address")
        if not request.name:
            raise StatusError(Kind.INVALID_ARGUMENT, "name: is empty")
        left = context.time_remaining()
        until = None if left is None else time.monotonic() + left
        wait = ARRIVAL_WAIT_S if left is None else min(ARRIVAL_WAIT_S, left)
        buffer = self._node.adapters.relays.wait_for(request.name, request.version, wait)
        if buffer is None:
            raise StatusError(Kind.NOT_FOUND, f"{request.name} v{request.version}: not held "
                                              f"or arriving on this node")
        refusal = relay_reader_refusal(credential, buffer.readers)
        if refusal is not None:
            raise StatusError(Kind.PERMISSION_DENIED, refusal)
        for offset, piece in buffer.pieces(request.offset, until, context.is_active):
            yield encode_read_response(offset, piece)  # the message's bytes: one copy

    def ReloadAdapter(self, request: rollout_pb2.ReloadAdapterRequest,
                      context: grpc.ServicerContext) -> rollout_pb2.ReloadAdapterResponse:
        """Serve a stored version, a directory under the adapter root, or the base model.
        See :meth:`gridrl.rollout.adapter_manager.AdapterManager.reload` for the errors."""
        return self._node.adapters.reload(request, ApplyDeadline.of_rpc(context))

    def GetNodeInfo(self, request: rollout_pb2.GetNodeInfoRequest,
                    context: grpc.ServicerContext) -> rollout_pb2.GetNodeInfoResponse:
        """The node's model, backend, adapter, bounds, queue depth and uptime."""
        return rollout_pb2.GetNodeInfoResponse(info=self._node.info())


class RolloutNode:
    """A rollout node process: engine over ``backend``, adapter store, gRPC server and the
    optional registration with a master.

    Raises:
        OSError: the adapter root cannot be created.
        StatusError: INVALID_ARGUMENT naming the setting's flag (:meth:`NodeConfig.validate`).
    """

    def __init__(self, backend: Backend, config: NodeConfig) -> None:
        config.validate()
        self.config = config
        self.backend = backend
        self.started = time.monotonic()
        identity = backend.identity
        low, high = backend.temperature_range
        self.limits = Limits(max_n=config.max_n, max_tokens=config.max_tokens,
                             vocab_size=backend.vocab_size,
                             max_context=identity.max_context, min_temperature=low,
                             max_temperature=high)
        self.codec = TextCodec(backend.tokenizer)
        self.kv_budget = KvBudget.for_backend(backend.kv_bytes_per_token,
                                              backend.sequence_bytes, config.kv_memory_mb)
        if self.kv_budget.tokens:
            log.info("KV cache: %d tokens (%s), %d more a sequence for sampling",
                     self.kv_budget.tokens, self.kv_budget.limit,
                     self.kv_budget.overhead_tokens)
        self.engine = BatchScheduler(
            backend, capacity=config.capacity, max_queue=config.max_queue,
            batch_window_s=config.batch_window_s, kv_budget=self.kv_budget,
            max_resident=config.max_resident_adapters,
            max_adapter_bytes=int(config.adapter_memory_mb * 1e6))
        self.name = node_name(config)
        self.reports = ReportSequence()  # orders info, heartbeats and push answers
        self.adapters = AdapterManager(self.engine, AdapterStore(adapter_root(config)), identity,
                                       config.max_adapter_bytes, keep=config.keep_adapters,
                                       keep_names=config.keep_runs, reports=self.reports)
        workers = min(1024, config.max_queue + config.capacity + 16)
        self.server = GrpcServer(config.listen, metrics_port=config.metrics_port,
                                 security=config.security, max_workers=workers,
                                 grace_s=config.grace_s, max_receive_bytes=NODE_REQUEST_BYTES)
        self.server.add(rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                        RolloutServicer(self), SERVICE_NAME)
        self.registrar = None
        self.failure: str | None = None  # why the node stopped by itself (None: it did not)
        self.server.on_stopping(self._stop_registrar)
        self.openai = None
        if config.openai_listen:
            from gridrl.rollout.openai_server import OpenAIServer

            self.openai = OpenAIServer(self.engine, self.codec, self.limits,
                                       config.openai_listen, security=config.security,
                                       grace_s=config.grace_s)
            self.server.on_stopping(self.openai.stop)
        self.server.on_stop(self._close_engine)
        self._peers: dict[str, grpc.Channel] = {}  # relay sources (read_from_peer)
        self._peer_lock = threading.Lock()
        self.server.on_stop(self._close_peers)
        self.server.on_stop(self._flush_adapters)
        self._ephemeral_dir = ephemeral_dir(config.listen, config.name, config.adapter_root)
        if self._ephemeral_dir is not None:  # a port-0 node's directory is never reused
            self.server.on_stop(self._remove_ephemeral_dir)

    def read_from_peer(self, address: str, request: rollout_pb2.ReadAdapterRequest,
                       timeout_s: float):
        """ReadAdapter on the peer at ``address`` with this node's own TLS identity and token
        (its ``--auth-token-file``: a node credential), over a channel kept per peer."""
        with self._peer_lock:
            channel = self._peers.get(address)
            if channel is None:
                channel = self._peers[address] = dial(address, self.config.security,
                                                             keepalive=self.config.keepalive())
        # the stub's call with a decoder that views each piece in the received bytes
        read = channel.unary_stream(
            READ_ADAPTER, request_serializer=rollout_pb2.ReadAdapterRequest.SerializeToString,
            response_deserializer=decode_read_response)
        return read(request, timeout=timeout_s)

    def _close_peers(self) -> None:
        with self._peer_lock:
            for channel in self._peers.values():
                channel.close()
            self._peers.clear()

    @property
    def address(self) -> str:
        """The bound address (valid after :meth:`start`)."""
        return self.server.address

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int:
        return self.server.metrics_port

    @property
    def advertise_address(self) -> str:
        """What the node tells the master and GetNodeInfo callers to dial."""
        return self.config.advertise_address or self.server.address

    def start(self) -> RolloutNode:
        """Start the engine, bind and serve (gRPC, and the OpenAI endpoint when configured),
        then register with the master (if any)."""
        self.engine.start()
        self.server.start()
        if self.openai is not None:
            try:
                self.openai.start()
            except BaseException:
                self.server.stop(0)
                raise
        if self.config.master:
            from gridrl.common.registration import NodeRegistrar

            if _loopback(self.advertise_address) and not _loopback(self.config.master):
                log.warning("registering %s with master %s: other machines cannot dial a "
                            "loopback address; set --advertise-address", self.advertise_address,
                            self.config.master)

            self.registrar = NodeRegistrar(self.config.master, info_fn=self.info,
                                           load_fn=self.engine.load,
                                           security=self.config.security,
                                           on_refused=self._refused,
                                           max_refusals=self.config.max_refusals,
                                           on_give_up=self._give_up,
                                           keepalive=self.config.keepalive())
            self.registrar.start()
            self._watch_waits(self.registrar)
        log.info("rollout node %s: %s backend, %s on %s (%s), adapters in %s", self.name,
                 self.backend.name, self.backend.identity.model_id, self.backend.device,
                 self.backend.dtype, self.adapters.store.root)
        return self

    def _refused(self, refusal: str | None) -> None:
        """The master refuses this node's credential (NOT_SERVING: it samples for nobody's
        run), or accepts it again (SERVING)."""
        self.server.set_serving(refusal is None)
        if refusal is not None:
            log.error("master %s refuses this node: %s; health NOT_SERVING%s", self.config.master,
                      refusal, f", exiting after {self.config.max_refusals} refusals in a row"
                      if self.config.max_refusals else "")

    def _give_up(self, refusal: str) -> None:
        """After ``--max-refusals``: stop serving; :attr:`failure` says why (the command exits
        non-zero with it)."""
        self.failure = (f"the master at {self.config.master} refused this node's credential "
                        f"{self.config.max_refusals} times in a row: {refusal}")
        threading.Thread(target=self.stop, name="node-stop", daemon=True).start()

    def _close_engine(self) -> None:
        """On stop (every call has ended by then): stop the batch in progress, whose callers
        are gone, and join the scheduler thread before the process exits."""
        self.engine.close(interrupt=True)

    def _watch_waits(self, registrar: Any) -> None:
        """Status lines while the node waits for the master to accept it and for the trainer's
        first adapter (:class:`gridrl.common.progress.StatusLine`: on a terminal, live lines;
        in logs, plain lines at growing intervals); they end by themselves."""
        from gridrl.common.progress import StatusLine

        waiting = f"waiting for the master at {self.config.master} to register this node"

        def registered() -> bool:  # the line says why, while the master refuses or is away
            failure = registrar.last_failure
            master_line.update(f"{waiting}; last answer: {failure}" if failure else waiting)
            return registrar.registered

        master_line = StatusLine(waiting, until=registered, logger=log)
        lines = [master_line,
                 StatusLine("waiting for a first adapter; serving the base model until one "
                            "is pushed", until=lambda: self.engine.serving.version > 0
                            or bool(self.engine.serving.name), logger=log,
                            max_log_every_s=300.0)]
        for line in lines:
            line.start()
            self.server.on_stopping(lambda line=line: line.stop("stopped"))

    def _flush_adapters(self) -> None:
        """On stop: let a push being stored in the background finish writing."""
        if not self.adapters.flush(timeout=30):
            log.warning("stopping while a pushed adapter is still being stored")

    def _remove_ephemeral_dir(self) -> None:
        """On stop, after the adapters are flushed: remove a port-0 node's own directory."""

        shutil.rmtree(self._ephemeral_dir, ignore_errors=True)
        log.info("removed this port-0 node's directory %s", self._ephemeral_dir)

    def _stop_registrar(self) -> None:
        if self.registrar is not None:
            self.registrar.stop(deregister=True)

    def stop(self, grace_s: float | None = None) -> None:
        """Deregister, stop serving (calls in flight get ``grace_s``), close the engine."""
        self.server.stop(grace_s)

    def wait(self) -> None:
        """Serve until SIGTERM/SIGINT or :meth:`stop`."""
        self.server.wait()

    def info(self) -> common_pb2.NodeInfo:
        """What the node is and serves now (GetNodeInfo, and what the master is told).

        Reads snapshots only (the serving adapter, queue depth, the stored-adapter listing):
        it never waits on a push, a reload or a batch, so liveness holds during both."""
        sequence = self.reports.next()  # before reading the state (ReportSequence.next)
        b, i = self.backend, self.backend.identity
        serving = self.engine.serving
        return common_pb2.NodeInfo(
            address=self.advertise_address, role=common_pb2.NODE_ROLE_ROLLOUT,
            backend=enum_value(common_pb2.Backend, b.name, default=0),
            adapter_format=adapter_format_to_proto(b.adapter_format),
            base_model=base_model_to_proto(i),
            adapter=common_pb2.AdapterRef(name=serving.name, version=serving.version),
            capacity=self.config.capacity, queue_depth=self.engine.queue_depth,
            uptime_s=time.monotonic() - self.started, device=b.device, dtype=b.dtype,
            max_n=self.config.max_n, max_tokens=self.config.max_tokens,
            max_context=i.max_context, stored_adapters=self.adapters.stored_refs(),
            software_version=software_version(), sequence=sequence,
            kv_cache_tokens=self.kv_budget.tokens,
            sequence_overhead_tokens=self.kv_budget.overhead_tokens,
            resident_adapters=[common_pb2.AdapterRef(name=a.name, version=a.version)
                               for a in self.engine.resident()],
            run_shares=[common_pb2.RunShare(run=run, share=share)
                        for run, share in sorted(self.engine.shares().items())])


def _loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def run_on_engine_thread(load: Callable[[], RolloutNode]) -> RolloutNode:
    """Call ``load`` (which builds the backend and the node) on a new thread that then runs
    the node engine's scheduler loop (:meth:`BatchScheduler.run`) until the engine closes.

    Model loading and decoding then happen on the same thread. With libgomp, every thread
    that starts torch parallel work keeps an OpenMP thread team; a second team (the main
    thread's, from loading) makes the runtime throttle spin-waits because more threads are
    managed than there are cores, which cost ~20% of fp32 decode speed on 2 cores.

    Returns:
        the node, its engine running (:meth:`RolloutNode.start` starts the server).
    Raises:
        whatever ``load`` raised (the thread then ends).
    """
    result: Future[RolloutNode] = Future()

    def body() -> None:
        try:
            node = load()
            node.engine.claim_thread()
        except BaseException as e:  # handed to the caller, which re-raises it
            release_thread_state()  # the thread ends here (MLX streams it made: threads.py)
            result.set_exception(e)
            return
        result.set_result(node)
        node.engine.run()

    threading.Thread(target=body, name="rollout-scheduler", daemon=True).start()
    return result.result()
