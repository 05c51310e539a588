"""The fuzz suite's parts, shared by ``tests/fuzz`` (a few hundred cases, deterministic) and
``bench/fuzz.py`` (10,000+): live services, hypothesis strategies over every RPC's request
message and over the PushAdapter stream, and the properties every answer must have.

Services (:class:`Cluster`): a master, a torch rollout node on the tiny llama and a trainer's
status server, in this process, on 127.0.0.1 port 0, called through real channels. Every call
carries a deadline (:data:`DEADLINE_S`): a hang fails as DEADLINE_EXCEEDED.

Properties (:func:`check_answer`) of every answer:

- the code is OK or a deliberate one (:data:`DELIBERATE`): never UNKNOWN (an exception the
  servicer did not mean), INTERNAL, DEADLINE_EXCEEDED (a hang) or UNAVAILABLE (a dead server);
- a refusal's message starts with the offending field, as a path of the request's fields
  (``sampling.top_p``, ``header.manifest.files[0].sha256``), or, for the PushAdapter stream,
  with ``adapter`` (the adapter's tensors as a whole) or the path of the file whose bytes are
  wrong (DATA_LOSS).

and of every push (:meth:`Cluster.push`): a refused or cut push changes nothing, on disk (the
adapter store's tree is the same once background writes are done: no half-written version, no
staging directory) or in what the node serves; an accepted one serves what its reply names and
is stored whole.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor as pb_descriptor
from hypothesis import strategies as st
from waiting import wait_for

from gridrl.master.config import Liveness
from gridrl.v1 import (
    common_pb2,
    registry_pb2,
    registry_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

# Seconds any fuzzed call may take: far above what the tiny model needs (milliseconds), so
# reaching it means the server hung.
DEADLINE_S = 30.0
# Codes a server answers on purpose to bad input or load.
DELIBERATE = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.DATA_LOSS,
})
# The node's bounds in the fuzzed cluster: small, so valid requests are cheap and the bounds
# are reachable.
MAX_N = 4
MAX_TOKENS = 6
MAX_ADAPTER_BYTES = 1 << 20

INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FLOAT32 = st.floats(width=32)  # NaN and infinities included
DOUBLE = st.floats()


# -- answers ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    """What a call got: the status code and its details ("" when OK)."""

    code: grpc.StatusCode
    details: str = ""


OK = Answer(grpc.StatusCode.OK)


def answer_of(call: Callable[[], Any]) -> tuple[Answer, Any]:
    """Run ``call`` (one RPC with a deadline); (its Answer, its response or None)."""
    try:
        return OK, call()
    except grpc.RpcError as e:
        return Answer(e.code(), e.details() or ""), None


def field_path_ok(details: str, message: type, extra_roots: frozenset[str] = frozenset()
                  ) -> bool:
    """Whether ``details`` starts with ``<path>: `` where ``path`` walks ``message``'s fields
    (dotted, list indexes allowed: ``header.manifest.files[2].size_bytes``; a oneof's name
    counts as a field) or is one of ``extra_roots``."""
    head, sep, _ = details.partition(": ")
    if not sep or not head:
        return False
    if head in extra_roots:
        return True
    desc = message.DESCRIPTOR
    for part in head.split("."):
        name = re.sub(r"\[\d+\]$", "", part)
        if desc is None:
            return False
        if name in desc.oneofs_by_name:
            desc = None  # a oneof: nothing below it to walk
            continue
        f = desc.fields_by_name.get(name)
        if f is None:
            return False
        desc = f.message_type if f.type == pb_descriptor.FieldDescriptor.TYPE_MESSAGE else None
    return True


def check_answer(answer: Answer, message: type, extra_roots: frozenset[str] = frozenset()
                 ) -> None:
    """The properties every fuzzed answer has (module docstring).

    Raises:
        AssertionError: naming the code and details.
    """
    if answer.code == grpc.StatusCode.OK:
        return
    assert answer.code in DELIBERATE, f"undeliberate status {answer.code.name}: {answer.details}"
    assert field_path_ok(answer.details, message, extra_roots), (
        f"{answer.code.name} does not start with a field of {message.DESCRIPTOR.name}: "
        f"{answer.details!r}")


class Tally:
    """How many cases ran per RPC and which codes they got (for ``bench/fuzz.py``)."""

    def __init__(self) -> None:
        self.codes: dict[str, Counter[str]] = defaultdict(Counter)

    def add(self, rpc: str, answer: Answer) -> None:
        self.codes[rpc][answer.code.name] += 1

    def total(self) -> int:
        return sum(sum(c.values()) for c in self.codes.values())


# -- services --------------------------------------------------------------------------------

def tree(root: Path) -> list[str]:
    """Every path under ``root`` (relative, sorted), hidden ones included."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def adapter_files(base_dir: Path, out: Path) -> dict[str, bytes]:
    """A random peft LoRA (all linear layers, r 4) for the model in ``base_dir``, as files."""
    from engine_helpers import make_peft_adapter

    from gridrl.adapters import read_dir

    return {p: bytes(b) for p, b in read_dir(make_peft_adapter(base_dir, out)).items()}


class Cluster:
    """A master, a torch rollout node (tiny llama; bounds :data:`MAX_N`, :data:`MAX_TOKENS`,
    :data:`MAX_ADAPTER_BYTES`; serving ``fuzz`` v1 from the start) and a trainer status server
    (a finished two-step run), in this process on loopback port 0, with a stub each.

    Args:
        model_dir: the tiny llama (``make_tiny_llama``).
        work: scratch directory (the adapter store lives under it).
    """

    def __init__(self, model_dir: Path, work: Path) -> None:
        from gridrl.common.rpc.channel import dial
        from gridrl.engine.backends.torch.backend import TorchBackend
        from gridrl.master.server import Master
        from gridrl.rollout.server import NodeConfig, RolloutNode
        from gridrl.trainer.report.status import RunStatus
        from gridrl.trainer.server import serve_trainer

        self._stopping: list[Callable[[], None]] = []
        try:
            self.master = Master("127.0.0.1:0", liveness=Liveness(5.0, 15.0, 60.0),
                                 grace_s=1.0).start()
            self._stopping.append(lambda: self.master.stop(0))
            self.node = RolloutNode(TorchBackend.from_pretrained(model_dir), NodeConfig(
                listen="127.0.0.1:0", adapter_root=work / "adapters", max_n=MAX_N,
                max_tokens=MAX_TOKENS, max_adapter_bytes=MAX_ADAPTER_BYTES, grace_s=1.0,
                keep_adapters=0, keep_runs=0)).start()
            self._stopping.append(lambda: self.node.stop(1.0))
            status = RunStatus()
            status.begin("fuzz", str(work / "run"), total_steps=2, model_id="tiny")
            for step in (1, 2):
                status.append(trainer_pb2.StepReport(step=step, policy_version=step,
                                                     reward_mean=0.5))
            status.finish()
            self.trainer = serve_trainer(status, "127.0.0.1:0", metrics_port=-1)
            self._stopping.append(lambda: self.trainer.stop(0))
            self.channels = [dial(s.address) for s in (self.master, self.node, self.trainer)]
            self.registry = registry_pb2_grpc.RegistryServiceStub(self.channels[0])
            self.rollout = rollout_pb2_grpc.RolloutServiceStub(self.channels[1])
            self.run = trainer_pb2_grpc.TrainerServiceStub(self.channels[2])
            self.files = adapter_files(model_dir, work / "adapter")
            self.vocab_size = self.node.limits.vocab_size
            self.node_ids: list[str] = []  # ids the master gave fuzzed registrations
            first = self.push_requests(version=1, chunk_size=1 << 16, trailer=False)
            response = self.rollout.PushAdapter(iter(first), timeout=DEADLINE_S)
            assert response.serving.version == 1, response
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for channel in getattr(self, "channels", []):
            channel.close()
        for stop in reversed(self._stopping):
            stop()

    # -- the adapter stream ------------------------------------------------------------------

    def push_requests(self, version: int, chunk_size: int, trailer: bool,
                      name: str = "fuzz") -> list[rollout_pb2.PushAdapterRequest]:
        """A valid PushAdapter stream of the cluster's adapter: digests in the header, or
        (``trailer``) in a trailer."""
        from gridrl.adapters import build_manifest
        from gridrl.common.transport import push_requests

        manifest = build_manifest(self.files, name=name, version=version,
                                  base_model=self.node.adapters.identity,
                                  hash_files=not trailer)
        return list(push_requests(manifest.to_dict(), self.files, chunk_size=chunk_size))

    def serving(self) -> tuple[str, int]:
        info = self.rollout.GetNodeInfo(rollout_pb2.GetNodeInfoRequest(), timeout=DEADLINE_S)
        return info.info.adapter.name, info.info.adapter.version

    def store_tree(self) -> list[str]:
        """The adapter store once every accepted push is written."""
        assert self.node.adapters.flush(timeout=DEADLINE_S), "a push still holds the store"
        return tree(self.node.adapters.store.root)

    def push(self, requests: list[rollout_pb2.PushAdapterRequest],
             cut_after: int | None = None) -> Answer:
        """Send ``requests`` as one PushAdapter stream (with ``cut_after``: the client cancels
        the call after sending that many messages, a client that goes away mid-stream) and
        check the push properties (module docstring).

        Returns:
            the answer (for a cancelled call: CANCELLED, seen by the client only).
        Raises:
            AssertionError: a property does not hold.
        """
        before_tree, before_serving = self.store_tree(), self.serving()
        if cut_after is None:
            answer, response = answer_of(lambda: self.rollout.PushAdapter(
                iter(requests), timeout=DEADLINE_S))
        else:
            answer, response = self._push_and_leave(requests, cut_after), None
        after_serving = self.serving()
        after_tree = self.store_tree()
        if answer.code == grpc.StatusCode.OK:  # serves what the reply says, stored whole
            served = (response.serving.name, response.serving.version)
            assert after_serving == served, (after_serving, served)
            header = next(r.header for r in requests if r.WhichOneof("payload") == "header")
            version_dir = f"pushed/{header.manifest.name}/v{header.manifest.version}"
            stored = {p.removeprefix(version_dir + "/") for p in after_tree
                      if p.startswith(version_dir + "/")}
            assert set(self.files) <= stored, f"{version_dir} stored partly: {sorted(stored)}"
        else:
            assert after_serving == before_serving, (
                f"{answer.code.name} push changed what serves: {before_serving} -> "
                f"{after_serving}")
            assert after_tree == before_tree, (
                f"{answer.code.name} push changed the store: "
                f"{sorted(set(after_tree) ^ set(before_tree))}")
        assert not any(".staging-" in p for p in after_tree), after_tree
        return answer

    def _push_and_leave(self, requests: list[rollout_pb2.PushAdapterRequest],
                        cut_after: int) -> Answer:
        sent = threading.Event()
        release = threading.Event()

        def stream() -> Iterator[rollout_pb2.PushAdapterRequest]:
            yield from requests[:cut_after]
            sent.set()
            release.wait(DEADLINE_S)  # the client is gone by then: nothing more is sent

        future = self.rollout.PushAdapter.future(stream(), timeout=DEADLINE_S)
        future.add_done_callback(lambda _: sent.set())  # refused before all were sent
        sent.wait(DEADLINE_S)
        future.cancel()
        release.set()
        try:
            future.result(timeout=DEADLINE_S)
            return OK
        except grpc.FutureCancelledError:
            return Answer(grpc.StatusCode.CANCELLED, "cancelled by the client")
        except grpc.RpcError as e:
            return Answer(e.code(), e.details() or "")

    def generate_ok(self, answer: Answer, request: rollout_pb2.GenerateRequest,
                    response: rollout_pb2.GenerateResponse | None) -> None:
        """An accepted Generate returned ``n`` samples of at most ``max_tokens`` tokens with
        one logprob per token, from what the node serves."""
        if response is None:
            return
        s = request.sampling
        assert len(response.samples) == (s.n or 1)
        for sample in response.samples:
            assert 1 <= len(sample.token_ids) <= s.max_tokens
            assert len(sample.logprobs) == len(sample.token_ids)


# -- request strategies ----------------------------------------------------------------------
#
# A message is drawn field by field from its valid values, except for up to two fields drawn
# from anything their type holds ("wild": bounds, the type's extremes, NaN, odd strings), so
# cases reach past validation as well as hit every check.

def _enum(values: Any) -> st.SearchStrategy[int]:
    """An enum field: its values most often, else any int32 (open proto3 enums)."""
    return st.one_of(st.sampled_from(sorted(values)), INT32)


def _text(max_size: int = 24) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(["", "a", "..", "../x", "/abs", "a/../b", "a b", "é"]),
                     st.text(max_size=max_size))


def _some_wild(valid: dict[str, st.SearchStrategy], wild: dict[str, st.SearchStrategy],
               max_wild: int = 2) -> st.SearchStrategy[dict[str, Any]]:
    """Field values: each from ``valid``, except up to ``max_wild`` fields from ``wild``."""
    return st.sets(st.sampled_from(sorted(wild)), max_size=max_wild).flatmap(
        lambda broken: st.fixed_dictionaries(
            {k: (wild[k] if k in broken else v) for k, v in valid.items()}))


def generate_requests(vocab_size: int) -> st.SearchStrategy[rollout_pb2.GenerateRequest]:
    """GenerateRequest: a valid request (small, so accepted calls stay cheap) with up to two
    fields wild: prompts as ids out of the vocabulary, text, both or neither; every sampling
    field at and past its bounds (NaN, infinities, 0, the node's limits + 1, the type's
    extremes); no sampling at all."""
    in_vocab = st.integers(0, vocab_size - 1)
    token = st.one_of(in_vocab, INT32, st.sampled_from([-1, vocab_size]))
    valid = {
        "prompt": st.sampled_from(["ids", "ids", "text"]),
        "ids": st.lists(in_vocab, min_size=1, max_size=12),
        "text": st.sampled_from(["the cat", "hello world", "the dog and the cat"]),
        "chat": st.booleans(), "has_sampling": st.just(True),
        "n": st.integers(0, MAX_N), "max_tokens": st.integers(1, MAX_TOKENS),
        "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.5]),
        "top_p": st.one_of(st.none(), st.sampled_from([0.5, 0.9, 1.0])),
        "top_k": st.integers(0, 8), "seed": st.one_of(st.none(), UINT64),
        "stop_token_ids": st.lists(in_vocab, max_size=3), "request_id": _text(),
    }
    wild = {
        "prompt": st.sampled_from(["ids", "text", "both", "neither"]),
        "ids": st.lists(token, max_size=12), "text": _text(40),
        "has_sampling": st.just(False),
        "n": st.one_of(st.sampled_from([MAX_N + 1, 2**32 - 1]), UINT32),
        "max_tokens": st.one_of(st.sampled_from([0, MAX_TOKENS + 1, 2**32 - 1]), UINT32),
        "temperature": st.one_of(st.sampled_from([1e-5, -1.0, float("nan"), float("inf")]),
                                 FLOAT32),
        "top_p": st.one_of(st.sampled_from([0.0, 1.5, -0.5, float("nan")]), FLOAT32),
        "top_k": INT32, "stop_token_ids": st.lists(token, min_size=1, max_size=4),
    }
    return _some_wild(valid, wild).map(_generate)


def _generate(f: dict[str, Any]) -> rollout_pb2.GenerateRequest:
    r = rollout_pb2.GenerateRequest(apply_chat_template=f["chat"], request_id=f["request_id"])
    if f["prompt"] in ("ids", "both"):
        r.prompt_token_ids.extend(f["ids"])
        r.apply_chat_template = f["chat"] and f["prompt"] == "both"
    if f["prompt"] in ("text", "both"):
        r.prompt_text = f["text"]
    if f["has_sampling"]:
        s = r.sampling
        s.n, s.max_tokens, s.temperature, s.top_k = (f["n"], f["max_tokens"], f["temperature"],
                                                     f["top_k"])
        s.stop_token_ids.extend(f["stop_token_ids"])
        if f["top_p"] is not None:
            s.top_p = f["top_p"]
        if f["seed"] is not None:
            s.seed = f["seed"]
    return r


def reload_requests() -> st.SearchStrategy[rollout_pb2.ReloadAdapterRequest]:
    """ReloadAdapterRequest: no target, a version (0, the stored ones, others), a path (inside,
    absolute, leaving the root, missing) or base_model true/false."""
    return st.one_of(
        st.just(rollout_pb2.ReloadAdapterRequest()),
        st.builds(lambda v: rollout_pb2.ReloadAdapterRequest(version=v),
                  st.one_of(st.sampled_from([0, 1, 2, 3]), UINT64)),
        st.builds(lambda p: rollout_pb2.ReloadAdapterRequest(path=p),
                  st.one_of(st.sampled_from(["pushed/fuzz/v1", "pushed/fuzz", "pushed",
                                             "pushed/fuzz/v1/adapter_config.json",
                                             "../adapters", "/etc", "."]), _text())),
        st.builds(lambda b: rollout_pb2.ReloadAdapterRequest(base_model=b), st.booleans()))


def _wild_address() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(["0.0.0.0:7003", "[::]:7005", "127.0.0.1", "127.0.0.1:0",
                                      "127.0.0.1:70000", ":7004", "[::1", "a:b:c", ""]),
                     st.builds(lambda h, p: f"{h}:{p}", _text(12), st.integers(-5, 70000)),
                     _text())


def node_infos() -> st.SearchStrategy[common_pb2.NodeInfo]:
    """NodeInfo as a node registers it, up to two fields wild (address, role, backend,
    adapter format); the fields the master stores as given take any value."""
    valid = {
        "address": st.builds(lambda h, p: f"{h}:{p}",
                             st.sampled_from(["127.0.0.1", "node-a", "[::1]", "10.0.0.7"]),
                             st.integers(1, 65535)),
        "role": st.sampled_from([common_pb2.NODE_ROLE_ROLLOUT, common_pb2.NODE_ROLE_TRAINER]),
        "backend": st.sampled_from([common_pb2.BACKEND_TORCH, common_pb2.BACKEND_MLX,
                                    common_pb2.BACKEND_VLLM]),
        "adapter_format": st.sampled_from(sorted(common_pb2.AdapterFormat.values())),
        "base_model": st.builds(common_pb2.BaseModel, model_id=_text(), architecture=_text(),
                                hidden_size=UINT32, num_layers=UINT32, vocab_size=UINT32,
                                weights_fingerprint=_text()),
        "adapter": st.builds(common_pb2.AdapterRef, name=_text(), version=UINT64),
        "capacity": UINT32, "queue_depth": UINT32, "uptime_s": DOUBLE, "device": _text(),
        "dtype": _text(), "max_n": UINT32, "max_tokens": UINT32, "max_context": UINT32,
    }
    wild = {"address": _wild_address(), "role": _enum(common_pb2.NodeRole.values()),
            "backend": _enum(common_pb2.Backend.values()),
            "adapter_format": _enum(common_pb2.AdapterFormat.values())}
    return _some_wild(valid, wild).map(lambda f: common_pb2.NodeInfo(**f))


def registry_requests(node_ids: Callable[[], list[str]]
                      ) -> dict[str, st.SearchStrategy[Any]]:
    """One strategy per RegistryService RPC. ``node_ids`` lists the ids the master handed out
    so far (read when a case runs): a node id is one of them (drawn as an index) or made up."""
    node_id = st.one_of(st.integers(0, 63).map(lambda i: _pick(node_ids(), i)),
                        st.integers(0, 63).map(lambda i: _pick(node_ids(), i)), _text())
    status = st.sampled_from([common_pb2.NODE_STATUS_UNSPECIFIED, common_pb2.NODE_STATUS_HEALTHY,
                              common_pb2.NODE_STATUS_DRAINING])
    heartbeat_valid = {
        "node_id": node_id, "queue_depth": UINT32, "load": st.floats(0, 1), "status": status,
        "adapter": st.builds(common_pb2.AdapterRef, name=_text(), version=UINT64)}
    heartbeat_wild = {"load": DOUBLE, "status": _enum(common_pb2.NodeStatus.values())}
    filters = {"role": st.sampled_from(sorted(common_pb2.NodeRole.values())),
               "backend": st.sampled_from(sorted(common_pb2.Backend.values())),
               "model_id": _text()}
    filters_wild = {"role": _enum(common_pb2.NodeRole.values()),
                    "backend": _enum(common_pb2.Backend.values())}
    return {
        "RegisterNode": st.one_of(st.just(registry_pb2.RegisterNodeRequest()),
                                  st.builds(registry_pb2.RegisterNodeRequest, node=node_infos())),
        "Heartbeat": _some_wild(heartbeat_valid, heartbeat_wild).map(
            lambda f: registry_pb2.HeartbeatRequest(**f)),
        "ListNodes": _some_wild(
            {**filters, "status": st.sampled_from(sorted(common_pb2.NodeStatus.values()))},
            {**filters_wild, "status": _enum(common_pb2.NodeStatus.values())}).map(
            lambda f: registry_pb2.ListNodesRequest(**f)),
        "WatchNodes": _some_wild(filters, filters_wild).map(
            lambda f: registry_pb2.WatchNodesRequest(**f)),
        "DeregisterNode": st.builds(registry_pb2.DeregisterNodeRequest, node_id=node_id),
    }


def _pick(ids: list[str], index: int) -> str:
    return ids[index % len(ids)] if ids else "unregistered"


def call_registry(cluster: Cluster, rpc: str, request: Any) -> Answer:
    """One RegistryService call with a deadline; WatchNodes reads up to SNAPSHOT_END and
    leaves. Records the node ids registrations got."""
    stub = cluster.registry
    if rpc == "WatchNodes":
        def watch() -> None:
            stream = stub.WatchNodes(request, timeout=DEADLINE_S)
            try:
                for event in stream:
                    if event.type == registry_pb2.NODE_EVENT_TYPE_SNAPSHOT_END:
                        return
            finally:
                stream.cancel()
        return answer_of(watch)[0]
    answer, response = answer_of(lambda: getattr(stub, rpc)(request, timeout=DEADLINE_S))
    if rpc == "RegisterNode" and response is not None:
        assert dialable(request.node.address), f"registered {request.node.address!r}"
        cluster.node_ids.append(response.node_id)
    return answer


def dialable(address: str) -> bool:
    """Whether ``address`` is a host:port other processes could dial: an IP address (IPv6 in
    brackets) or an ASCII host name, a port in 1..65535, not a wildcard."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.IPv6Address(host[1:-1]) != ipaddress.IPv6Address("::")
        except ValueError:
            return False
    try:
        return ipaddress.IPv4Address(host) != ipaddress.IPv4Address("0.0.0.0")
    except ValueError:
        labels = host.rstrip(".").split(".")
        return all(re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?", label)
                   for label in labels)


def call_trainer(cluster: Cluster, rpc: str, request: Any) -> Answer:
    """GetRunStatus, or WatchRun read to its end (the cluster's run has finished)."""
    if rpc == "WatchRun":
        return answer_of(lambda: list(cluster.run.WatchRun(request, timeout=DEADLINE_S)))[0]
    return answer_of(lambda: cluster.run.GetRunStatus(request, timeout=DEADLINE_S))[0]


TRAINER_REQUESTS = {
    "GetRunStatus": st.just(trainer_pb2.GetRunStatusRequest()),
    "WatchRun": st.builds(trainer_pb2.WatchRunRequest, include_history=st.booleans()),
}

# Every unary or server-streaming RPC of the three services: (service, request type).
RPCS: dict[str, type] = {
    "RegisterNode": registry_pb2.RegisterNodeRequest,
    "Heartbeat": registry_pb2.HeartbeatRequest,
    "ListNodes": registry_pb2.ListNodesRequest,
    "WatchNodes": registry_pb2.WatchNodesRequest,
    "DeregisterNode": registry_pb2.DeregisterNodeRequest,
    "Generate": rollout_pb2.GenerateRequest,
    "ReloadAdapter": rollout_pb2.ReloadAdapterRequest,
    "GetNodeInfo": rollout_pb2.GetNodeInfoRequest,
    "GetRunStatus": trainer_pb2.GetRunStatusRequest,
    "WatchRun": trainer_pb2.WatchRunRequest,
}


# -- raw request bytes -----------------------------------------------------------------------

_SERVICES = {"RegisterNode": "RegistryService", "Heartbeat": "RegistryService",
             "ListNodes": "RegistryService", "WatchNodes": "RegistryService",
             "DeregisterNode": "RegistryService", "Generate": "RolloutService",
             "ReloadAdapter": "RolloutService", "GetNodeInfo": "RolloutService",
             "PushAdapter": "RolloutService", "GetRunStatus": "TrainerService",
             "WatchRun": "TrainerService"}


def raw_bytes() -> st.SearchStrategy[bytes]:
    """Request bytes that are not what a stub would send: random bytes (mostly not protobuf),
    truncated varints, wrong wire types, unknown fields, huge length prefixes."""
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"\x08", b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05ab", b"\xff\xff",
                         b"\x12\x03abc", b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
                         b"\xf8\xff\xff\xff\x0f\x01", b"\x0d\x00\x00\x80\x7f", b""]))


def call_raw(cluster: Cluster, rpc: str, payload: bytes) -> Answer:
    """Send ``payload`` as the serialized request of ``rpc`` (a PushAdapter stream of one
    message for the client-streaming RPC), reading a streamed reply to its end or
    SNAPSHOT_END."""
    service = _SERVICES[rpc]
    channel = {"RegistryService": cluster.channels[0], "RolloutService": cluster.channels[1],
               "TrainerService": cluster.channels[2]}[service]
    method = f"/gridrl.v1.{service}/{rpc}"
    ident = lambda b: b  # noqa: E731

    def call() -> None:
        if rpc == "PushAdapter":
            channel.stream_unary(method, ident, ident)(iter([payload]), timeout=DEADLINE_S)
        elif rpc in ("WatchNodes", "WatchRun"):
            stream = channel.unary_stream(method, ident, ident)(payload, timeout=DEADLINE_S)
            try:
                for chunk in stream:
                    if rpc == "WatchNodes" and registry_pb2.WatchNodesResponse.FromString(
                            chunk).type == registry_pb2.NODE_EVENT_TYPE_SNAPSHOT_END:
                        return
            finally:
                stream.cancel()
        else:
            channel.unary_unary(method, ident, ident)(payload, timeout=DEADLINE_S)
    return answer_of(call)[0]


# -- the PushAdapter stream ------------------------------------------------------------------

PUSH_ROOTS = frozenset({"adapter"})
# What a refusal of bytes that do not parse names: the request (``request[i]`` in a stream).
RAW_ROOTS = frozenset({"request", *(f"request[{i}]" for i in range(4))})


@dataclass
class PushCase:
    """One fuzzed push: a valid stream's shape and the mutations applied to it.

    Attributes:
        chunk_size: bytes per chunk of the valid stream.
        trailer: digests in a trailer (else in the header).
        version: the pushed version (1 is stored with the same files: a retry).
        mutations: (kind, *args) applied in order (:func:`mutate`).
        cut_after: the client cancels after this many messages (None: it half-closes).
    """

    chunk_size: int
    trailer: bool
    version: int
    mutations: list[tuple] = field(default_factory=list)
    cut_after: int | None = None


_MUTATIONS = st.one_of(
    st.tuples(st.just("swap"), st.integers(0, 999), st.integers(0, 999)),
    st.tuples(st.just("duplicate"), st.integers(0, 999)),
    st.tuples(st.just("drop"), st.integers(0, 999)),
    st.tuples(st.just("cut"), st.integers(0, 999)),
    st.tuples(st.just("grow"), st.integers(0, 999), st.integers(1, 5000)),
    st.tuples(st.just("shrink"), st.integers(0, 999), st.integers(1, 5000)),
    st.tuples(st.just("flip"), st.integers(0, 999), st.integers(0, 10**6)),
    st.tuples(st.just("offset"), st.integers(0, 999), st.one_of(UINT64, st.integers(-64, 64))),
    st.tuples(st.just("chunk_path"), st.integers(0, 999), _text()),
    st.tuples(st.just("size"), st.integers(0, 9),
              st.one_of(st.integers(-64, 64), st.sampled_from([2**64 - 1, 2**40, 2**20]))),
    st.tuples(st.just("sha256"), st.integers(0, 9),
              st.one_of(st.just(""), st.just("0" * 64), st.text("0123456789abcdefABCDEF",
                                                                  min_size=60, max_size=66))),
    st.tuples(st.just("file_path"), st.integers(0, 9), _text()),
    st.tuples(st.just("extra_file"), _text(), st.integers(0, 2**20)),
    st.tuples(st.just("trailer"), st.sampled_from(["zero", "drop_one", "add_one", "upper",
                                                   "remove", "add", "garbage"])),
    st.tuples(st.just("header"), st.sampled_from(["name", "version", "format", "base_model",
                                                  "hidden_size", "fingerprint", "extra",
                                                  "stage_only", "empty_files", "second", "missing"]),
              _text(), UINT64),
)


def push_cases(max_mutations: int = 3) -> st.SearchStrategy[PushCase]:
    """Pushes of the cluster's adapter with 1..``max_mutations`` mutations (reordered,
    duplicated, dropped, oversized, shrunk or flipped chunks; a manifest lying about sizes,
    digests or files; a lying, missing, misplaced or extra trailer; header fields made wrong;
    the stream cut short), one in ten cancelled by the client mid-stream."""
    return st.builds(PushCase, chunk_size=st.sampled_from([4096, 16384, 1 << 16]),
                     trailer=st.booleans(), version=st.sampled_from([1, 2, 3]),
                     mutations=st.lists(_MUTATIONS, min_size=1, max_size=max_mutations),
                     cut_after=st.one_of(st.none(), st.none(), st.none(), st.none(), st.none(),
                                         st.none(), st.none(), st.none(), st.none(),
                                         st.integers(0, 40)))


def mutate(requests: list[rollout_pb2.PushAdapterRequest], mutations: list[tuple]
           ) -> list[rollout_pb2.PushAdapterRequest]:
    """``requests`` (copied) with ``mutations`` applied; indexes wrap around the list."""
    out = [_copy(r) for r in requests]
    for kind, *args in mutations:
        chunks = [i for i, r in enumerate(out) if r.WhichOneof("payload") == "chunk"]
        headers = [r.header.manifest for r in out if r.WhichOneof("payload") == "header"]
        trailers = [r.trailer for r in out if r.WhichOneof("payload") == "trailer"]
        if kind in ("swap", "duplicate", "drop", "cut") and out:
            i = args[0] % len(out)
            if kind == "swap":
                j = args[1] % len(out)
                out[i], out[j] = out[j], out[i]
            elif kind == "duplicate":
                out.insert(i, _copy(out[i]))
            elif kind == "drop":
                del out[i]
            else:
                del out[i:]
        elif kind in ("grow", "shrink", "flip", "offset", "chunk_path") and chunks:
            c = out[chunks[args[0] % len(chunks)]].chunk
            if kind == "grow":
                c.data += bytes(args[1])
            elif kind == "shrink":
                c.data = c.data[:max(0, len(c.data) - args[1])]
            elif kind == "flip" and c.data:
                pos = args[1] % len(c.data)
                c.data = c.data[:pos] + bytes([c.data[pos] ^ 0xFF]) + c.data[pos + 1:]
            elif kind == "offset":
                c.offset = args[1] % 2**64 if args[1] < 0 else args[1]
            elif kind == "chunk_path":
                c.path = args[1]
        elif kind in ("size", "sha256", "file_path") and headers and headers[0].files:
            f = headers[0].files[args[0] % len(headers[0].files)]
            if kind == "size":
                f.size_bytes = max(0, f.size_bytes + args[1]) if abs(args[1]) <= 64 else args[1]
            elif kind == "sha256":
                f.sha256 = args[1]
            else:
                f.path = args[1]
        elif kind == "extra_file" and headers:
            headers[0].files.add(path=args[0], size_bytes=args[1])
        elif kind == "trailer":
            _mutate_trailer(out, trailers, args[0])
        elif kind == "header":
            _mutate_header(out, headers, *args)
    return out


def _mutate_trailer(out: list, trailers: list, how: str) -> None:
    if how == "add":
        out.append(rollout_pb2.PushAdapterRequest(trailer=rollout_pb2.PushAdapterTrailer(
            file_sha256=["0" * 64])))
        return
    if not trailers:
        return
    digests = trailers[0].file_sha256
    if how == "zero" and digests:
        digests[0] = "0" * 64
    elif how == "drop_one" and digests:
        del digests[-1]
    elif how == "add_one":
        digests.append(hashlib.sha256(b"extra").hexdigest())
    elif how == "upper" and digests:
        digests[0] = digests[0].upper()
    elif how == "garbage" and digests:
        digests[0] = "not a digest"
    elif how == "remove":
        out[:] = [r for r in out if r.WhichOneof("payload") != "trailer"]


def _mutate_header(out: list, headers: list, how: str, text: str, number: int) -> None:
    if how == "missing":
        out[:] = [r for r in out if r.WhichOneof("payload") != "header"]
        return
    if not headers:
        return
    m = headers[0]
    if how == "name":
        m.name = text
    elif how == "version":
        m.version = number % 4 if number % 2 else number
    elif how == "format":
        m.format = number % 2**31
    elif how == "base_model":
        m.base_model.model_id = text
        m.base_model.num_layers = number % 2**32
    elif how == "hidden_size":
        m.base_model.hidden_size = number % 2**32
    elif how == "fingerprint":
        m.base_model.weights_fingerprint = text or "other"
    elif how == "extra":
        m.rank, m.scale = number % 2**32, float(number)
        m.target_modules.append(text)
    elif how == "stage_only":
        next(r for r in out if r.WhichOneof("payload") == "header").header.stage_only = True
    elif how == "empty_files":
        del m.files[:]
    elif how == "second":
        out.insert(1, rollout_pb2.PushAdapterRequest(
            header=rollout_pb2.PushAdapterHeader(manifest=m)))


def _copy(r: rollout_pb2.PushAdapterRequest) -> rollout_pb2.PushAdapterRequest:
    c = rollout_pb2.PushAdapterRequest()
    c.CopyFrom(r)
    return c


def push_case(cluster: Cluster, case: PushCase) -> Answer:
    """Build, mutate and send one fuzzed push; check the push properties and the answer.

    Returns:
        the answer (CANCELLED when the client cancelled it).
    """
    valid = cluster.push_requests(case.version, case.chunk_size, case.trailer)
    requests = mutate(valid, case.mutations)
    if case.cut_after is not None:
        answer = cluster.push(requests, cut_after=min(case.cut_after, len(requests)))
        assert answer.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK) or \
            answer.code in DELIBERATE, answer
        return answer
    answer = cluster.push(requests)
    files = {f.path for r in requests if r.WhichOneof("payload") == "header"
             for f in r.header.manifest.files} | set(cluster.files)
    check_answer(answer, rollout_pb2.PushAdapterRequest, PUSH_ROOTS | files)
    return answer


def wait_idle(cluster: Cluster, timeout: float = DEADLINE_S) -> None:
    """Wait until the node has no request queued (cases leave none behind)."""
    wait_for(lambda: not cluster.node.engine.queue_depth, timeout_s=timeout,
             what="the queued requests to finish (cases leave none behind)", every_s=0.01)


# -- credentials -----------------------------------------------------------------------------

class SecuredMaster:
    """A master on loopback that accepts only the credentials it mints here (scopes node,
    trainer, read), for fuzzing the ``authorization`` metadata; ``tokens`` by scope, and
    ``wrong``, a well-formed token it does not list.

    Args:
        work: scratch directory (token files).
    """

    def __init__(self, work: Path) -> None:
        from gridrl.common.rpc.channel import dial
        from gridrl.common.security.minting import mint
        from gridrl.common.security.policy import Security
        from gridrl.common.security.tokens import AuthorizedTokens, new_token
        from gridrl.master.server import Master

        authorized = work / "authorized_tokens"
        self.tokens = {}
        for scope in ("node", "trainer", "read"):
            mint(authorized, work / f"{scope}.token", scope, f"{scope}-1")
            self.tokens[scope] = (work / f"{scope}.token").read_text().strip()
        self.tokens["wrong"] = new_token()
        self.master = Master("127.0.0.1:0", security=Security(
            authorized=AuthorizedTokens(authorized)), grace_s=1.0).start()
        self.channel = dial(self.master.address)
        self.stub = registry_pb2_grpc.RegistryServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.master.stop(0)


def auth_headers(tokens: dict[str, str]) -> st.SearchStrategy[str | None]:
    """``authorization`` values: none, every scope's token (right and wrong scheme, padded,
    truncated), a token the server does not list, and printable junk."""
    token = st.sampled_from(sorted(tokens.values()))
    printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
    return st.one_of(
        st.none(), token.map(lambda t: f"Bearer {t}"), token.map(lambda t: f"bearer  {t} "),
        token.map(lambda t: f"Bearer {t[:-1]}"), token.map(lambda t: f"Basic {t}"),
        token, st.just("Bearer"), st.just("Bearer "), printable,
        printable.map(lambda s: f"Bearer {s}"))


def call_with_auth(secured: SecuredMaster, rpc: str, header: str | None) -> Answer:
    """ListNodes (read scope) or RegisterNode (node scope; a valid request) with ``header``
    as the ``authorization`` metadata."""
    metadata = () if header is None else (("authorization", header),)
    if rpc == "ListNodes":
        request: Any = registry_pb2.ListNodesRequest()
    else:
        request = registry_pb2.RegisterNodeRequest(node=common_pb2.NodeInfo(
            address="127.0.0.1:7001", role=common_pb2.NODE_ROLE_ROLLOUT,
            backend=common_pb2.BACKEND_TORCH))
    return answer_of(lambda: getattr(secured.stub, rpc)(request, metadata=metadata,
                                                        timeout=DEADLINE_S))[0]


def check_auth_answer(answer: Answer, rpc: str) -> None:
    """A credential refusal is UNAUTHENTICATED or PERMISSION_DENIED and starts with the RPC
    refused (the offending input is the call's ``authorization`` metadata, not a field)."""
    if answer.code == grpc.StatusCode.OK:
        return
    assert answer.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), \
        answer
    assert answer.details.startswith(f"RegistryService/{rpc}: "), answer.details
