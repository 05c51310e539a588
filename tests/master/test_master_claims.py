"""A node credential registers, heartbeats and deregisters only its own address: the first
credential to register an address holds it (across expiry and master restarts, through the
store) until it is revoked; a credential minted with an address registers only that one, and
nobody else may take that address first; aliases of an address (host case, a trailing dot,
a zero-padded port) are the same address; a node credential lists rollout nodes and a trainer
credential only its own trainer entry."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from master_helpers import node_info

from gridrl.common.rpc.channel import dial
from gridrl.common.security.minting import mint, revoke
from gridrl.common.security.policy import Security
from gridrl.common.security.tokens import AuthorizedTokens, read_token_file
from gridrl.master.registry import node_id_for
from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc

A, B = "10.0.0.1:6000", "10.0.0.2:6000"


@pytest.fixture
def cluster(tmp_path: Path, make_master):
    """Three node credentials (``one``, ``two``; ``bound`` may register only B), a trainer
    credential (``trainer``) and a master reading them, with its store in ``tmp_path``."""
    authorized = tmp_path / "authorized_tokens"
    tokens = {}
    for cid, scope, address in (("one", "node", None), ("two", "node", None),
                                ("bound", "node", B), ("trainer", "trainer", None)):
        mint(authorized, tmp_path / cid, scope, cid, address)
        tokens[cid] = read_token_file(tmp_path / cid)

    def start():
        return make_master(store_path=str(tmp_path / "master.sqlite"),
                              security=Security(authorized=AuthorizedTokens(authorized)))

    return start, tokens, authorized


def _stub(master, token: str) -> registry_pb2_grpc.RegistryServiceStub:
    return registry_pb2_grpc.RegistryServiceStub(dial(master.address, token))


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        _code.details = e.details()
        return e.code()
    return grpc.StatusCode.OK


def _register(stub, address: str, role: int = common_pb2.NODE_ROLE_ROLLOUT):
    return lambda: stub.RegisterNode(
        registry_pb2.RegisterNodeRequest(node=node_info(address, role=role)), timeout=10)


def _heartbeat(stub, address: str):
    return lambda: stub.Heartbeat(registry_pb2.HeartbeatRequest(node_id=node_id_for(address)),
                                  timeout=10)


def _deregister(stub, address: str):
    return lambda: stub.DeregisterNode(
        registry_pb2.DeregisterNodeRequest(node_id=node_id_for(address)), timeout=10)


def test_a_node_credential_holds_the_address_it_registered(cluster) -> None:
    start, tokens, authorized = cluster
    master = start()
    one, two = _stub(master, tokens["one"]), _stub(master, tokens["two"])
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert _code(_register(one, A)) == grpc.StatusCode.OK
    assert _code(_register(one, A)) == grpc.StatusCode.OK  # the node restarting
    assert _code(_register(two, A)) == denied
    assert _code.details == (f"node.address: {A} is held by credential 'one'; credential 'two' "
                             "may not register it")
    assert _code(_heartbeat(two, A)) == denied
    assert _code.details.startswith(f"node_id: {node_id_for(A)} ({A}) is held by credential "
                                    "'one'; credential 'two' may not heartbeat it")
    assert _code(_deregister(two, A)) == denied
    assert "may not deregister it" in _code.details
    assert _code(_heartbeat(one, A)) == grpc.StatusCode.OK
    # the claim outlives the node leaving, and the master restarting (it is in the store)
    assert _code(_deregister(one, A)) == grpc.StatusCode.OK
    assert _code(_register(two, A)) == denied
    master.stop(0)
    master = start()
    two = _stub(master, tokens["two"])
    assert _code(_register(two, A)) == denied
    # revoking the holder frees the address for the next credential
    revoke(authorized, "one")
    assert _code(_register(two, A)) == grpc.StatusCode.OK
    assert _code(_heartbeat(two, A)) == grpc.StatusCode.OK


def test_a_credential_bound_to_an_address_registers_only_that_one(cluster) -> None:
    start, tokens, _ = cluster
    master = start()
    bound = _stub(master, tokens["bound"])
    assert _code(_register(bound, A)) == grpc.StatusCode.PERMISSION_DENIED
    assert _code.details == f"node.address: credential 'bound' may register only {B}, not {A}"
    assert _code(_register(bound, B)) == grpc.StatusCode.OK
    assert _code(_register(_stub(master, tokens["one"]), B)) == \
        grpc.StatusCode.PERMISSION_DENIED


def test_without_credentials_no_claim_is_checked(make_master) -> None:
    master = make_master()
    stub = registry_pb2_grpc.RegistryServiceStub(dial(master.address))
    assert _code(_register(stub, A)) == grpc.StatusCode.OK
    assert master.claims is None


def test_an_address_minted_for_a_credential_is_reserved_before_it_registers(cluster) -> None:
    """Without the reservation, any node credential registering B first would hold it and
    lock the real node (minted for B) out."""
    start, tokens, authorized = cluster
    master = start()
    one = _stub(master, tokens["one"])
    assert _code(_register(one, B)) == grpc.StatusCode.PERMISSION_DENIED
    assert _code.details == (f"node.address: {B} is reserved for credential 'bound' (minted "
                             "for it); credential 'one' may not register it")
    assert _code(_register(one, "10.0.0.2:06000")) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(_register(_stub(master, tokens["bound"]), B)) == grpc.StatusCode.OK
    revoke(authorized, "bound")  # the reservation ends with the credential
    assert _code(_register(one, B)) == grpc.StatusCode.OK


def test_aliases_of_a_held_address_are_that_address(cluster) -> None:
    start, tokens, _ = cluster
    master = start()
    one, two = _stub(master, tokens["one"]), _stub(master, tokens["two"])
    assert _code(_register(one, "host-a.lan:6000")) == grpc.StatusCode.OK
    for alias in ("HOST-A.lan:6000", "host-a.lan.:6000", "host-a.lan:06000"):
        assert _code(_register(two, alias)) == grpc.StatusCode.PERMISSION_DENIED, alias
        assert "is held by credential 'one'" in _code.details
    assert _code(_register(one, "Host-A.lan:6000")) == grpc.StatusCode.OK  # its own, any case
    assert _code(_heartbeat(two, "Host-A.lan:6000")) == grpc.StatusCode.PERMISSION_DENIED


def test_a_trainer_credential_lists_its_own_trainer_entry_only(cluster) -> None:
    start, tokens, _ = cluster
    master = start()
    trainer, one = _stub(master, tokens["trainer"]), _stub(master, tokens["one"])
    denied, ok = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK
    trainer_role, T = common_pb2.NODE_ROLE_TRAINER, "10.0.0.9:7000"
    assert _code(_register(trainer, T, trainer_role)) == ok
    assert _code(_heartbeat(trainer, T)) == ok
    assert _code(_register(trainer, "10.0.0.9:7001")) == denied  # a rollout entry
    assert _code.details == ("RegistryService/RegisterNode: credential 'trainer' has scope "
                             "trainer; it may register trainer entries (node.role), not rollout")
    assert _code(_register(one, "10.0.0.1:7000", trainer_role)) == denied
    assert _code.details == ("RegistryService/RegisterNode: credential 'one' has scope node; "
                             "it may register rollout entries (node.role), not trainer")
    assert _code(_register(one, A)) == ok
    for action in (_heartbeat, _deregister):  # a node's entry, and one nobody registered
        for address in (A, "10.0.0.7:1"):
            assert _code(action(trainer, address)) == denied, (action, address)
            assert "may" in _code.details and "only the trainer entry it registered" in \
                _code.details
    assert _code(_deregister(trainer, T)) == ok


def test_a_trainer_whose_entry_expired_is_told_to_register_again(cluster) -> None:
    """A trainer cut off from the master past its expiry heartbeats an entry the master
    removed: NOT_FOUND (register again), not PERMISSION_DENIED, since it holds the address;
    another trainer credential still learns nothing about it."""
    from waiting import wait_for

    start, tokens, authorized = cluster
    mint(authorized, authorized.parent / "other", "trainer", "other")
    master = start()
    trainer = _stub(master, tokens["trainer"])
    other = _stub(master, read_token_file(authorized.parent / "other"))
    T = "10.0.0.9:7000"
    assert _code(_register(trainer, T, common_pb2.NODE_ROLE_TRAINER)) == grpc.StatusCode.OK
    wait_for(lambda: master.registry.expired_address(node_id_for(T)) == T, 30,
             "the entry to expire (1.2 s without a heartbeat)")
    assert _code(_heartbeat(trainer, T)) == grpc.StatusCode.NOT_FOUND
    assert _code(_heartbeat(other, T)) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(_register(trainer, T, common_pb2.NODE_ROLE_TRAINER)) == grpc.StatusCode.OK
    assert _code(_heartbeat(trainer, T)) == grpc.StatusCode.OK
