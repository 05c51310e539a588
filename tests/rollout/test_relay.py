"""Relay fan-out between nodes (FetchAdapter / ReadAdapter): real in-process nodes on the tiny
llama, on reserved loopback ports, over mutual TLS with node credentials minted for their
addresses and a trainer credential.

The trainer pushes once, to the chain's head, with a relay plan; every other node fetches
from the node before it, each checking every piece against the trainer's digests. Faults: a
relay stopped mid-stream (the reader resumes from an earlier holder), a relay that alters
what it forwards (refused, DATA_LOSS), a reader the trainer did not list or with the wrong
credential (PERMISSION_DENIED).
"""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from rollout_helpers import rpc_error

from gridrl.adapters import build_manifest, read_dir
from gridrl.common.rpc.channel import dial
from gridrl.common.rpc.server import GrpcServer
from gridrl.common.security.minting import mint
from gridrl.common.security.policy import Security
from gridrl.common.security.tokens import AuthorizedTokens
from gridrl.common.transport import push_requests, relay_plan
from gridrl.rollout.server import NodeConfig, RolloutNode
from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

PIECE = 1024  # small pieces: the tiny adapter spans many of them
WAIT = 60.0  # hang guard of every call


@dataclass
class Node:
    node: RolloutNode
    address: str
    stub: rollout_pb2_grpc.RolloutServiceStub  # as the trainer

    def serving(self) -> tuple[str, int]:
        info = self.stub.GetNodeInfo(rollout_pb2.GetNodeInfoRequest(), timeout=WAIT).info
        return info.adapter.name, info.adapter.version


@dataclass
class Fleet:
    nodes: list[Node]
    authorized: Path
    tokens: dict[str, str]
    pki: object

    def security(self, who: str) -> Security:
        return Security(tls=self.pki.tls("client" if who == "trainer" else "node"),
                        token=self.tokens[who])


def _reserve(n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    return socks


@pytest.fixture
def fleet(tiny_llama_dir: Path, tmp_path: Path, pki) -> Iterator[Fleet]:
    """Three nodes n0, n1, n2 with node credentials bound to their addresses, a trainer
    credential, an unbound node credential ``loose`` and a ``read`` one."""
    from gridrl.engine.backends.torch.backend import TorchBackend

    socks = _reserve(3)
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    authorized = tmp_path / "authorized_tokens"
    tokens = {}
    for who, scope, address in ([(f"n{i}", "node", a) for i, a in enumerate(addresses)]
                                + [("trainer", "trainer", None), ("loose", "node", None),
                                   ("read", "read", None),
                                   ("stranger", "node", "127.0.0.1:1")]):
        mint(authorized, tmp_path / f"{who}.token", scope, who, address=address)
        tokens[who] = (tmp_path / f"{who}.token").read_text().strip()
    fleet = Fleet([], authorized, tokens, pki)
    try:
        for i, (sock, address) in enumerate(zip(socks, addresses, strict=True)):
            security = Security(tls=pki.tls("node"), authorized=AuthorizedTokens(authorized),
                                token=tokens[f"n{i}"])
            sock.close()
            backend = TorchBackend.from_pretrained(tiny_llama_dir)  # one per node: own keys
            node = RolloutNode(backend, NodeConfig(listen=address, security=security,
                                                   adapter_root=tmp_path / f"n{i}",
                                                   grace_s=0.5)).start()
            stub = rollout_pb2_grpc.RolloutServiceStub(dial(address, fleet.security("trainer")))
            fleet.nodes.append(Node(node, address, stub))
        yield fleet
    finally:
        for s in socks:
            s.close()
        for n in fleet.nodes:
            n.node.stop(0)


@pytest.fixture
def adapter(tiny_adapters: dict[str, Path]):
    files = read_dir(tiny_adapters["a"])
    manifest = build_manifest(files, name="run", version=3)  # every sha256 given
    return manifest, files


class Gate:
    """A push stream that stops after ``first`` chunks until :meth:`open`."""

    def __init__(self, requests: Iterator, first: int) -> None:
        self.requests, self.first = requests, first
        self.opened = threading.Event()
        self.sent = threading.Event()

    def __iter__(self):
        for i, message in enumerate(self.requests):
            if i == self.first + 1:  # the header, then `first` chunks
                self.sent.set()
                self.opened.wait(WAIT)
            yield message

    def open(self) -> None:
        self.opened.set()


def _fetch(fleet: Fleet, i: int, manifest, plan, sources: list[int | str]):
    request = rollout_pb2.FetchAdapterRequest(
        manifest=manifest.to_proto(), relay=plan,
        sources=[fleet.nodes[s].address if isinstance(s, int) else s for s in sources])
    return fleet.nodes[i].stub.FetchAdapter(request, timeout=WAIT)


def _in_thread(fn, *args):
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except grpc.RpcError as e:
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _wait(predicate, what: str) -> None:
    import time

    until = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < until, what
        time.sleep(0.01)


def test_a_chain_of_three_gets_the_version_with_one_upload(fleet: Fleet, adapter) -> None:
    manifest, files = adapter
    readers = [n.address for n in fleet.nodes[1:]]
    plan = relay_plan(manifest, files, readers, piece_bytes=PIECE)
    sent = []

    def counted():
        for message in push_requests(manifest, files, chunk_size=4096):
            if message.WhichOneof("payload") == "chunk":
                sent.append(len(message.chunk.data))
            yield message

    gate = Gate(_head_stream(manifest, files, plan, counted()), first=2)
    head, head_out = _in_thread(fleet.nodes[0].stub.PushAdapter, iter(gate), WAIT)
    gate.sent.wait(WAIT)
    second, second_out = _in_thread(_fetch, fleet, 1, manifest, plan, [0])
    third, third_out = _in_thread(_fetch, fleet, 2, manifest, plan, [1, 0])
    # pieces reach the end of the chain before the head has the whole adapter (a pipeline)
    _wait(lambda: (b := fleet.nodes[2].node.adapters.relays.wait_for("run", 3, 0)) is not None
          and b.verified > 0, "the third node got no piece while the head was receiving")
    assert not fleet.nodes[0].node.adapters.relays.wait_for("run", 3, 0).complete
    gate.open()
    for thread in (head, second, third):
        thread.join(WAIT)
    assert "error" not in head_out and "error" not in second_out and "error" not in third_out, (
        head_out, second_out, third_out)
    size = sum(len(b) for b in files.values())
    assert sum(sent) == size  # the trainer sent the adapter once
    assert second_out["value"].source == fleet.nodes[0].address
    assert third_out["value"].source == fleet.nodes[1].address
    assert third_out["value"].bytes_received == size
    assert third_out["value"].source_failures == 0
    for n in fleet.nodes:
        assert n.serving() == ("run", 3)
        assert n.node.adapters.flush(WAIT)  # stored like a push (written after the reply)
        assert ("run", 3) in {(r.name, r.version) for r in n.node.info().stored_adapters}


def _head_stream(manifest, files, plan, requests):
    """The push stream with ``plan`` in its header."""
    for message in requests:
        if message.WhichOneof("payload") == "header":
            message.header.relay.CopyFrom(plan)
        yield message


def test_a_relay_stopped_mid_stream_is_replaced_by_an_earlier_holder(fleet: Fleet,
                                                                     adapter) -> None:
    manifest, files = adapter
    plan = relay_plan(manifest, files, [n.address for n in fleet.nodes[1:]], piece_bytes=PIECE)
    gate = Gate(_head_stream(manifest, files, plan, push_requests(manifest, files,
                                                                  chunk_size=4096)), first=2)
    head, head_out = _in_thread(fleet.nodes[0].stub.PushAdapter, iter(gate), WAIT)
    gate.sent.wait(WAIT)
    second, _ = _in_thread(_fetch, fleet, 1, manifest, plan, [0])
    third, third_out = _in_thread(_fetch, fleet, 2, manifest, plan, [1, 0])
    _wait(lambda: (b := fleet.nodes[2].node.adapters.relays.wait_for("run", 3, 0)) is not None
          and b.verified > 0, "the third node got no piece from the relay")
    fleet.nodes[1].node.stop(0)  # the relay dies mid-stream
    gate.open()
    second.join(WAIT)
    head.join(WAIT)
    third.join(WAIT)
    assert "error" not in head_out and "error" not in third_out, (head_out, third_out)
    got = third_out["value"]
    assert got.source == fleet.nodes[0].address and got.source_failures == 1
    assert got.bytes_received == sum(len(b) for b in files.values())
    assert fleet.nodes[2].serving() == ("run", 3)


class _Tampering(rollout_pb2_grpc.RolloutServiceServicer):
    """A holder that flips a byte of every piece it forwards."""

    def __init__(self, manifest, files) -> None:
        self.blob = b"".join(files[f.path] for f in manifest.to_proto().files)

    def ReadAdapter(self, request, context):
        for offset in range(request.offset, len(self.blob), PIECE):
            piece = bytearray(self.blob[offset:offset + PIECE])
            piece[0] ^= 0xFF
            yield rollout_pb2.ReadAdapterResponse(offset=offset, data=bytes(piece))


def test_a_tampered_relay_payload_is_refused(fleet: Fleet, adapter, tmp_path: Path) -> None:
    manifest, files = adapter
    plan = relay_plan(manifest, files, [n.address for n in fleet.nodes[1:]], piece_bytes=PIECE)
    fake = GrpcServer("127.0.0.1:0", security=Security(
        tls=fleet.pki.tls("server"), authorized=AuthorizedTokens(fleet.authorized)))
    fake.add(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, _Tampering(manifest, files),
             "gridrl.v1.RolloutService")
    fake.start()
    try:
        e = rpc_error(lambda: _fetch(fleet, 1, manifest, plan, [fake.address]))
        assert e.code() == grpc.StatusCode.DATA_LOSS
        assert "piece 0" in e.details() and "does not match the trainer's" in e.details()
        assert fleet.nodes[1].serving() == ("", 0)  # nothing changed
        assert not fleet.nodes[1].node.info().stored_adapters
        # with an honest holder after it, the fetch completes from that one
        fleet.nodes[0].stub.PushAdapter(_head_stream(manifest, files, plan, push_requests(
            manifest, files, chunk_size=4096)), timeout=WAIT)
        got = _fetch(fleet, 1, manifest, plan, [fake.address, 0])
        assert got.source == fleet.nodes[0].address and got.source_failures == 1
        assert fleet.nodes[1].serving() == ("run", 3)
    finally:
        fake.stop(0)


@pytest.mark.parametrize("who,code", [
    ("stranger", grpc.StatusCode.PERMISSION_DENIED),  # a node the trainer did not list
    ("loose", grpc.StatusCode.PERMISSION_DENIED),  # a node credential with no address
    ("trainer", grpc.StatusCode.PERMISSION_DENIED),  # not a node's scope
    ("read", grpc.StatusCode.PERMISSION_DENIED),
])
def test_only_listed_nodes_may_read(fleet: Fleet, adapter, who: str, code) -> None:
    manifest, files = adapter
    plan = relay_plan(manifest, files, [fleet.nodes[1].address], piece_bytes=PIECE)
    fleet.nodes[0].stub.PushAdapter(_head_stream(manifest, files, plan, push_requests(
        manifest, files, chunk_size=4096)), timeout=WAIT)
    request = rollout_pb2.ReadAdapterRequest(name="run", version=3)
    with dial(fleet.nodes[0].address, fleet.security(who)) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        e = rpc_error(lambda: list(stub.ReadAdapter(request, timeout=WAIT)))
        assert e.code() == code, e.details()
    # n2 holds a node credential for its own address, but the trainer listed only n1
    with dial(fleet.nodes[0].address, fleet.security("n2")) as channel:
        e = rpc_error(lambda: list(rollout_pb2_grpc.RolloutServiceStub(channel).ReadAdapter(
            request, timeout=WAIT)))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "not among the nodes the trainer listed" in e.details()
    with dial(fleet.nodes[0].address, fleet.security("n1")) as channel:  # the listed one reads
        pieces = list(rollout_pb2_grpc.RolloutServiceStub(channel).ReadAdapter(
            request, timeout=WAIT))
        assert b"".join(p.data for p in pieces) == b"".join(
            files[f.path] for f in manifest.to_proto().files)


def test_bad_fetch_requests_name_the_field(fleet: Fleet, adapter) -> None:
    manifest, files = adapter
    plan = relay_plan(manifest, files, [], piece_bytes=PIECE)
    e = rpc_error(lambda: _fetch(fleet, 1, manifest, plan, []))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("sources:")
    short = rollout_pb2.RelayPlan(piece_bytes=PIECE, piece_sha256=list(plan.piece_sha256)[1:])
    e = rpc_error(lambda: _fetch(fleet, 1, manifest, short, [0]))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith("relay.piece_sha256:")
    assert fleet.nodes[1].serving() == ("", 0)


# -- the trainer's side: AdapterSync over the same nodes --------------------------------------


@pytest.fixture
def trainer_sync(fleet: Fleet, tiny_llama_dir: Path):
    from gridrl.models import model_identity
    from gridrl.trainer.fleet.pool import NodePool
    from gridrl.trainer.fleet.sync import AdapterSync

    identity = model_identity(tiny_llama_dir)
    pool = NodePool(master=None, addresses=[n.address for n in fleet.nodes],
                    model_identity=identity, security=fleet.security("trainer"),
                    probe_interval_s=0.2)
    sync = AdapterSync(pool, name="run", base_model=identity, deadline_s=WAIT,
                       piece_bytes=PIECE)
    pool.start()
    pool.wait_for_nodes(3, timeout_s=WAIT)
    yield sync
    sync.close()
    pool.close()


def test_the_trainer_uploads_each_push_once_and_the_chain_relays_it(
        fleet: Fleet, trainer_sync, tiny_adapters: dict[str, Path]) -> None:
    files = read_dir(tiny_adapters["a"])
    size = sum(len(b) for b in files.values())
    chain = sorted(n.address for n in fleet.nodes)
    for version in (1, 2):
        report = trainer_sync.push(version, files)
        assert report.synced == chain and report.skipped == {}
        # every node but the chain's head fetched it from a peer (the head is the node whose
        # last sync was fastest, so which one it is depends on the timings)
        assert len(report.relayed) == len(chain) - 1 and set(report.relayed) < set(chain)
        assert report.sent_bytes == size  # the trainer uploaded the adapter once
        for n in fleet.nodes:
            assert n.serving() == ("run", version)


def test_a_node_no_peer_will_serve_gets_the_push_from_the_trainer(
        fleet: Fleet, trainer_sync, tiny_adapters: dict[str, Path]) -> None:
    import dataclasses

    files = read_dir(tiny_adapters["a"])
    size = sum(len(b) for b in files.values())
    chain = sorted(fleet.nodes, key=lambda n: n.address)
    last = chain[-1].node  # reads from its peers with a credential bound to no address
    last.config = dataclasses.replace(last.config, security=dataclasses.replace(
        last.config.security, token=fleet.tokens["loose"]))
    for version in (1, 2):  # after the first refusal, the trainer pushes to it directly
        report = trainer_sync.push(version, files)
        assert report.synced == [n.address for n in chain] and report.skipped == {}
        # one of the two others heads the chain (the faster last sync), the other relays
        assert len(report.relayed) == 1 and report.relayed[0] in {n.address for n in chain[:2]}
        assert report.sent_bytes == 2 * size  # the head's push and the direct push
        assert chain[-1].serving() == ("run", version)
    assert trainer_sync._no_relay == {chain[-1].address}


# -- the relay buffer alone (no servers) -------------------------------------------------------


def test_the_buffer_keeps_only_verified_pieces_and_resumes_after_a_bad_one(adapter) -> None:
    from gridrl.common.errors import Kind, StatusError
    from gridrl.rollout.relay import RelayBuffer

    manifest, files = adapter
    plan = relay_plan(manifest, files, [], piece_bytes=PIECE)
    blob = b"".join(files[f.path] for f in manifest.to_proto().files)
    buffer = RelayBuffer(manifest.to_proto(), plan)
    buffer.write(0, blob[:PIECE + 10])  # a piece and a bit: only the piece is readable
    assert buffer.verified == PIECE
    bad = bytearray(blob[PIECE + 10:2 * PIECE])
    bad[-1] ^= 1
    with pytest.raises(StatusError) as e:
        buffer.write(PIECE + 10, bytes(bad))
    assert e.value.kind is Kind.DATA_LOSS and "piece 1" in e.value.message
    assert buffer.verified == PIECE  # the bad piece is not kept
    buffer.rewind()  # another source resumes at the first missing piece
    for offset in range(PIECE, len(blob), PIECE):
        buffer.write(offset, blob[offset:offset + PIECE])
    assert buffer.complete
    assert b"".join(p for _, p in buffer.pieces(0, None)) == blob
    assert {k: bytes(v) for k, v in buffer.files().items()} == {k: bytes(v) for k, v in
                                                                files.items()}
    with pytest.raises(StatusError) as e:
        list(buffer.pieces(3, None))
    assert e.value.kind is Kind.INVALID_ARGUMENT and e.value.field == "offset"


def test_the_buffer_takes_any_split_and_checks_each_file_against_the_manifest(adapter) -> None:
    from gridrl.common.errors import Kind, StatusError
    from gridrl.rollout.relay import RelayBuffer

    manifest, files = adapter
    proto = manifest.to_proto()
    blob = b"".join(files[f.path] for f in proto.files)
    assert proto.files[0].size_bytes % PIECE  # a piece spans the first two files
    plan = relay_plan(manifest, files, [], piece_bytes=PIECE)
    buffer = RelayBuffer(proto, plan)
    with pytest.raises(StatusError) as e:
        buffer.files()
    assert e.value.kind is Kind.FAILED_PRECONDITION  # not complete yet
    for offset in range(0, len(blob), 333):  # writes that straddle pieces and files
        buffer.write(offset, memoryview(blob)[offset:offset + 333])
        written = min(len(blob), offset + 333)  # verified: whole pieces, then the short last
        assert buffer.verified == (written if written == len(blob) else written // PIECE * PIECE)
    got = buffer.files()
    assert {k: bytes(v) for k, v in got.items()} == {k: bytes(v) for k, v in files.items()}
    assert buffer.files()[proto.files[-1].path] is got[proto.files[-1].path]  # no copies
    pieces = list(buffer.pieces(0, None))
    assert [o for o, _ in pieces] == list(range(0, len(blob), PIECE))
    assert b"".join(p for _, p in pieces) == blob
    with pytest.raises(TypeError):  # a reader cannot alter what the node serves
        pieces[-1][1][0] = 0
    # a plan that matches the bytes, a manifest that does not: refused at the end
    wrong = manifest.to_proto()
    wrong.files[-1].sha256 = hashlib.sha256(b"other").hexdigest()
    buffer = RelayBuffer(wrong, plan)
    buffer.write(0, blob)
    assert buffer.complete
    with pytest.raises(StatusError) as e:
        buffer.files()
    assert e.value.kind is Kind.DATA_LOSS
    assert e.value.message.startswith(f"{wrong.files[-1].path}: sha256")


def test_a_relayed_push_is_received_into_its_relay_buffer(adapter) -> None:
    from gridrl.common.errors import Kind, StatusError
    from gridrl.common.transport import receive_push
    from gridrl.rollout.relay import RelayBuffer

    manifest, files = adapter
    plan = relay_plan(manifest, files, [], piece_bytes=PIECE)
    buffer = RelayBuffer(manifest.to_proto(), plan)
    stream = list(_head_stream(manifest, files, plan, push_requests(manifest, files,
                                                                   chunk_size=1500)))
    got = receive_push(stream, 1 << 30, into=buffer)
    assert buffer.complete and got.bytes_received == buffer.total
    held = buffer.files()
    assert all(got.files[path] is held[path] for path in files)  # one copy of each byte
    assert {k: bytes(v) for k, v in got.files.items()} == {k: bytes(v) for k, v in files.items()}
    # a push whose bytes do not match the plan is refused at the first bad piece
    bad = list(_head_stream(manifest, files, plan, push_requests(manifest, files,
                                                                chunk_size=1500)))
    chunk = bad[-1].chunk
    chunk.data = bytes([chunk.data[0] ^ 1]) + chunk.data[1:]
    buffer = RelayBuffer(manifest.to_proto(), plan)
    with pytest.raises(StatusError) as e:
        receive_push(bad, 1 << 30, into=buffer)
    assert e.value.kind is Kind.DATA_LOSS and "does not match the trainer's" in e.value.message
    assert not buffer.complete
    # a relayed push must give the digests in its header
    bare = manifest.to_proto()
    for f in bare.files:
        f.sha256 = ""
    header = rollout_pb2.PushAdapterRequest(header=rollout_pb2.PushAdapterHeader(manifest=bare))
    with pytest.raises(StatusError) as e:
        receive_push([header], 1 << 30, into=RelayBuffer(manifest.to_proto(), plan))
    assert e.value.kind is Kind.INVALID_ARGUMENT and e.value.field == "header.manifest.files"
