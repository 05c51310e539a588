"""Membership as a pure state machine: events and a fake clock in, rotation and effects out."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from scripted_nodes import BASE, IDENTITY

from gridrl.trainer.fleet.backoff import Backoff
from gridrl.trainer.fleet.membership import MAX_PROBE_BACKOFF_S, Membership
from gridrl.trainer.fleet.outcomes import FailureKind, GenerateFailure
from gridrl.v1 import common_pb2, registry_pb2

A, B = "10.0.0.1:50051", "10.0.0.2:50051"
EV = registry_pb2


def info(address: str = A, version: int = 0, name: str = "", **identity) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(
        address=address, role=common_pb2.NODE_ROLE_ROLLOUT, backend=common_pb2.BACKEND_TORCH,
        adapter_format=common_pb2.ADAPTER_FORMAT_PEFT,
        base_model=common_pb2.BaseModel(model_id="tiny", **{**IDENTITY, **identity}),
        adapter=common_pb2.AdapterRef(name=name, version=version), capacity=8, dtype="float32")


def event(kind, address: str = A, healthy: bool = True, **kw) -> registry_pb2.WatchNodesResponse:
    status = common_pb2.NODE_STATUS_HEALTHY if healthy else common_pb2.NODE_STATUS_UNHEALTHY
    return registry_pb2.WatchNodesResponse(
        type=kind, node=registry_pb2.NodeRecord(info=info(address, **kw), status=status))


def rpc(code: str, detail: str) -> GenerateFailure:
    return GenerateFailure.of_rpc(grpc.StatusCode[code], detail)


def ref(name: str, version: int) -> common_pb2.AdapterRef:
    return common_pb2.AdapterRef(name=name, version=version)


@pytest.fixture
def members() -> Membership:
    m = Membership(BASE, max_consecutive_failures=2, probe_interval_s=5.0)
    m.add_static(A)
    return m


def rotation(m: Membership) -> list[str]:
    return [s.address for s in m.in_rotation()]


def test_static_node_probed_into_and_out_of_rotation(members) -> None:
    assert members.probes_due(0.0) == [A] and rotation(members) == []
    assert members.state(A).why_out() == "unhealthy: no GetNodeInfo answer yet"
    effects = members.probe_answered(A, info(), observed_at=1.0)
    assert rotation(members) == [A]
    assert [s.address for s in effects.notify] == [A] and effects.touched == {A}
    s = members.state(A)
    assert (s.backend, s.capacity, s.dtype, s.healthy) == ("torch", 8, "float32", True)
    assert members.probes_due(2.0) == []  # answering and not benched: not probed
    effects = members.probe_failed(A, "UNAVAILABLE", "connection refused")
    assert rotation(members) == [] and effects.notify == []
    assert members.state(A).why_out() == "unhealthy: GetNodeInfo: UNAVAILABLE: connection refused"
    assert members.probes_due(3.0) == [A]


def test_failures_bench_and_probe_backoff_doubles_until_a_generate_succeeds(members) -> None:
    members.probe_answered(A, info(), 0.0)
    members.generate_failed(A, rpc("UNAVAILABLE", "down"), now=10.0)
    assert rotation(members) == [A]  # one failure of two
    effects = members.generate_failed(A, rpc("DEADLINE_EXCEEDED", "slow"), now=11.0)
    assert rotation(members) == [] and effects.redial == [A]
    assert members.state(A).benched == ("2 consecutive Generate failures, last "
                                        "DEADLINE_EXCEEDED: slow")
    assert members.probes_due(15.9) == [] and members.probes_due(16.0) == [A]  # 5 s
    members.probe_answered(A, info(), 16.0)
    assert rotation(members) == [A] and members.state(A).failures == 0
    for t in (20.0, 21.0):  # benched again before any Generate succeeded: 10 s
        members.generate_failed(A, rpc("UNAVAILABLE", "down"), now=t)
    assert members.probes_due(30.9) == [] and members.probes_due(31.0) == [A]
    members.probe_answered(A, info(), 31.0)
    usable, _ = members.generate_succeeded(A, "", 0, started_at=32.0, seconds=0.5)
    assert usable and members.state(A).group_s == 0.5
    for t in (40.0, 41.0):  # the success reset the backoff: 5 s again
        members.generate_failed(A, rpc("UNAVAILABLE", "down"), now=t)
    assert members.probes_due(46.0) == [A]
    # INVALID_ARGUMENT is the request's fault
    members.probe_answered(A, info(), 47.0)
    for _ in range(3):
        members.generate_failed(A, rpc("INVALID_ARGUMENT", "prompt too long"), now=48.0)
    assert rotation(members) == [A]
    assert MAX_PROBE_BACKOFF_S >= 5.0


def test_base_model_mismatch_is_excluded_for_good(members) -> None:
    members.probe_answered(A, info(hidden_size=32), 0.0)
    s = members.state(A)
    assert not s.in_rotation and s.excluded == "hidden_size 32 != 64"
    assert members.probes_due(100.0) == [] and members.usable() == 0


def test_master_events_snapshot_orphans_and_removal() -> None:
    m = Membership(BASE)
    m.master_connected()
    m.master_event(event(EV.NODE_EVENT_TYPE_SNAPSHOT, A), 0.0)
    m.master_event(event(EV.NODE_EVENT_TYPE_SNAPSHOT, B), 0.0)
    m.master_event(EV.WatchNodesResponse(type=EV.NODE_EVENT_TYPE_SNAPSHOT_END), 0.0)
    assert rotation(m) == [A, B] and {s.source for s in m.states()} == {"master"}
    effects = m.master_event(event(EV.NODE_EVENT_TYPE_CHANGED, B, healthy=False), 1.0)
    assert rotation(m) == [A] and effects.notify == []
    # the master restarts without its store: the new snapshot lacks A and B
    m.master_connected()
    m.master_event(EV.WatchNodesResponse(type=EV.NODE_EVENT_TYPE_SNAPSHOT_END), 2.0)
    assert m.expire_orphans(31.0).forgotten == []  # within the grace, they keep serving
    assert rotation(m) == [A]
    m.master_event(event(EV.NODE_EVENT_TYPE_JOINED, A), 20.0)  # A re-registered
    assert m.expire_orphans(32.1).forgotten == [B]
    assert [s.address for s in m.states()] == [A]
    assert m.master_event(event(EV.NODE_EVENT_TYPE_REMOVED, A), 40.0).forgotten == [A]
    assert m.states() == []


def test_a_static_address_is_never_forgotten(members) -> None:
    members.master_event(event(EV.NODE_EVENT_TYPE_JOINED, A), 0.0)
    assert members.state(A).source == "static" and rotation(members) == [A]
    effects = members.master_event(event(EV.NODE_EVENT_TYPE_REMOVED, A), 1.0)
    assert effects.forgotten == [] and members.state(A) is not None


def test_a_node_entering_after_a_push_waits_for_the_adapter(members) -> None:
    members.probe_answered(A, info(), 0.0)
    members.set_target("run", 3)
    assert rotation(members) == [A]  # in rotation during a push: stays
    members.generate_failed(A, rpc("UNAVAILABLE", "down"), now=1.0)
    members.generate_failed(A, rpc("UNAVAILABLE", "down"), now=2.0)  # benched
    effects = members.probe_answered(A, info(version=0), observed_at=10.0)  # restarted
    s = members.state(A)
    assert not s.in_rotation and s.syncing and s.why_out().startswith("syncing")
    assert [n.address for n in effects.notify] == [A]  # the sync catches it up
    effects = members.push_succeeded(A, 3, ref("run", 3), now=11.0)
    assert rotation(members) == [A] and [n.address for n in effects.notify] == [A]
    assert (members.state(A).adapter_version, members.state(A).synced_version) == (3, 3)


def test_a_node_serving_the_target_enters_at_once(members) -> None:
    members.set_target("run", 3)
    members.probe_answered(A, info(version=3, name="run"), 0.0)
    assert rotation(members) == [A]
    members.probe_answered(B, info(B), 0.0)  # unknown address: ignored
    assert members.state(B) is None


def test_a_restarted_node_in_rotation_loses_its_group_and_syncs(members) -> None:
    members.probe_answered(A, info(), 0.0)
    members.set_target("run", 2)
    members.push_succeeded(A, 2, ref("run", 2), now=5.0)
    # a Generate started before the push may show the old version: fine
    usable, effects = members.generate_succeeded(A, "", 0, started_at=4.0, seconds=1.0)
    assert usable and rotation(members) == [A] and effects.notify == []
    # one started after it, showing the base model: the node restarted
    usable, effects = members.generate_succeeded(A, "", 0, started_at=6.0, seconds=1.0)
    assert not usable and rotation(members) == [] and members.state(A).syncing
    assert [n.address for n in effects.notify] == [A]
    members.push_succeeded(A, 2, ref("run", 2), now=8.0)
    assert rotation(members) == [A]


def test_the_masters_stale_copy_never_sends_a_node_to_syncing() -> None:
    m = Membership(BASE)
    m.master_event(event(EV.NODE_EVENT_TYPE_JOINED, A), 0.0)
    m.set_target("run", 4)
    m.push_succeeded(A, 4, ref("run", 4), now=1.0)
    effects = m.master_event(event(EV.NODE_EVENT_TYPE_CHANGED, A, version=3, name="run"), 2.0)
    assert rotation(m) == [A]  # a heartbeat older than the push: not evidence
    assert [n.address for n in effects.notify] == [A]  # but the sync is asked to check


def test_a_late_push_older_than_the_target_sends_the_node_back_to_syncing(members) -> None:
    """A catch-up of version 2 that lands after the push of version 3 (the node serves 2
    again): the node leaves rotation and waits for 3 instead of sampling a stale policy."""
    members.probe_answered(A, info(), 0.0)
    members.set_target("run", 2)
    members.push_succeeded(A, 2, ref("run", 2), now=1.0)
    members.set_target("run", 3)
    members.push_succeeded(A, 3, ref("run", 3), now=2.0)
    assert rotation(members) == [A]
    effects = members.push_succeeded(A, 2, ref("run", 2), now=3.0)
    s = members.state(A)
    assert rotation(members) == [] and s.syncing and s.adapter_version == 2
    assert [n.address for n in effects.notify] == [A]  # the sync catches it up again
    members.push_succeeded(A, 3, ref("run", 3), now=4.0)
    assert rotation(members) == [A]


def test_a_failed_push_benches_and_the_return_syncs(members) -> None:
    members.probe_answered(A, info(), 0.0)
    members.set_target("run", 1)
    effects = members.push_failed(A, 1, "DEADLINE_EXCEEDED", now=1.0)
    assert rotation(members) == [] and effects.redial == [A]
    assert members.state(A).benched == "adapter push of policy version 1 failed: DEADLINE_EXCEEDED"
    members.probe_answered(A, info(version=0), observed_at=7.0)
    assert members.state(A).syncing and rotation(members) == []


def test_flag_and_unflag(members) -> None:
    members.probe_answered(A, info(), 0.0)
    members.flag(A, "mismatched: KL 1e-1")
    s = members.state(A)
    assert not s.in_rotation and s.flagged == "mismatched: KL 1e-1"
    assert s.why_out() == "flagged: mismatched: KL 1e-1"
    assert members.probes_due(100.0) == []  # healthy: nothing to probe
    effects = members.unflag(A)
    assert rotation(members) == [A] and [n.address for n in effects.notify] == [A]


def test_membership_owns_every_flag(members) -> None:
    """One owner: the flags of members (benched) and of other addresses (recorded only), the
    reason kept current, every flag of the run remembered; a node that left the pool leaves
    its flag behind (it comes back as a new member)."""
    members.master_event(event(EV.NODE_EVENT_TYPE_JOINED, B), now=0.0)
    members.flag(B, "stale: 1")
    members.flag("elsewhere:1", "mismatched: ...")  # not a member: nothing to bench
    members.flag(B, "stale: 2")  # still bad: the reason is the latest
    assert members.flags() == {B: "stale: 2", "elsewhere:1": "mismatched: ..."}
    assert members.benched_flags() == {B: "stale: 2"} and members.state(B).flagged == "stale: 2"
    members.master_event(event(EV.NODE_EVENT_TYPE_REMOVED, B), now=1.0)
    assert members.flags() == {"elsewhere:1": "mismatched: ..."}
    members.master_event(event(EV.NODE_EVENT_TYPE_JOINED, B), now=2.0)
    assert members.state(B).in_rotation and not members.state(B).flagged
    members.unflag("elsewhere:1")
    assert members.flags() == {}
    assert members.flagged_ever() == {B: "stale: 1", "elsewhere:1": "mismatched: ..."}


def test_scheduler_view_and_in_flight(members) -> None:
    members.probe_answered(A, info(), 0.0)
    members.assign(A, now=3.0)
    members.assign(A, now=4.0)
    [c] = members.candidates()
    assert (c.address, c.in_flight, c.last_call_at, c.last_assigned) == (A, 2, 4.0, 2)
    assert members.busy()
    members.call_done(A)
    members.call_done(A)
    members.call_done(A)  # never below 0
    assert members.state(A).in_flight == 0 and not members.busy()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"^model_identity: missing vocab_size"):
        Membership(replace(BASE, vocab_size=0))
    with pytest.raises(ValueError, match=r"^max_consecutive_failures"):
        Membership(BASE, max_consecutive_failures=0)


def test_relayed_heartbeats_are_ordered_by_the_nodes_report_sequence(caplog) -> None:
    """A heartbeat the node sent before a push, relayed by the master after the push's answer
    arrived, is older by the node's own report numbers: no false "restarted?" alarm. A report
    the node made after the push, showing less, is a real loss (issue 20)."""

    def sequenced(kind, sequence: int, **kw) -> registry_pb2.WatchNodesResponse:
        e = event(kind, A, **kw)
        e.node.info.sequence = sequence
        return e

    m = Membership(BASE)
    m.master_event(sequenced(EV.NODE_EVENT_TYPE_JOINED, 100), 0.0)
    m.set_target("run", 18)
    m.push_succeeded(A, 18, ref("run", 18), now=1.0, sequence=110)
    caplog.set_level("INFO", logger="gridrl.trainer.fleet.membership")
    effects = m.master_event(sequenced(EV.NODE_EVENT_TYPE_CHANGED, 105, version=17, name="run"),
                             2.0)
    assert rotation(m) == [A] and effects.notify == []
    assert m.state(A).adapter_version == 18
    assert "restarted?" not in caplog.text
    # the node's later report (a restart: the base model), relayed: caught up
    effects = m.master_event(sequenced(EV.NODE_EVENT_TYPE_CHANGED, 200), 3.0)
    assert [n.address for n in effects.notify] == [A]
    assert "serves policy version 0 but was pushed 18 (master; restarted?)" in caplog.text


def test_generate_failures_are_typed() -> None:
    """A Generate that gave no group carries a kind the pool branches on; its label (logs,
    records, the failures metric) is the gRPC status's name or the kind's."""
    rejected = rpc("INVALID_ARGUMENT", "prompt too long")
    assert rejected.kind is FailureKind.REJECTED and not rejected.nodes_fault
    down = rpc("UNAVAILABLE", "down")
    assert (down.kind, down.label, down.nodes_fault) == (FailureKind.RPC_ERROR, "UNAVAILABLE",
                                                         True)
    malformed = GenerateFailure(FailureKind.MALFORMED_RESPONSE, "samples: 3 samples for n=4")
    assert malformed.label == "MALFORMED_RESPONSE" and malformed.nodes_fault
    assert not GenerateFailure(FailureKind.LOST_ADAPTER, "sampled with v1").nodes_fault


def test_the_fleets_backoff_doubles_to_its_cap() -> None:
    """One rule for the probes of a benched node, the reviews of a flagged one and the master's
    reconnections: first_s, doubled per failure in a row, capped."""
    probes = Backoff(5.0, MAX_PROBE_BACKOFF_S)
    assert [probes.delay(n) for n in (1, 2, 3, 4, 5, 50, 5000)] == [5, 10, 20, 40, 60, 60, 60]
    assert Backoff(0.2, 2.0).delay(3) == pytest.approx(0.8)
    with pytest.raises(ValueError, match=r"^failures"):
        probes.delay(0)


def test_a_node_the_master_lost_but_the_trainer_reaches_stays_in_rotation() -> None:
    """A partial cut: the master stops hearing B's heartbeats (UNHEALTHY) while the trainer
    still reaches it. B leaves rotation, is due for the trainer's own probe at once, and is
    back on that probe's answer; a failed probe keeps it out; DRAINING (the node's own word)
    is never probed back in; the master's HEALTHY ends the special case."""
    m = Membership(BASE, probe_interval_s=5.0)
    m.master_connected()
    for address in (A, B):
        m.master_event(event(EV.NODE_EVENT_TYPE_SNAPSHOT, address), 0.0)
    m.master_event(EV.WatchNodesResponse(type=EV.NODE_EVENT_TYPE_SNAPSHOT_END), 0.0)
    assert m.probes_due(0.0) == []  # healthy master nodes are not probed
    effects = m.master_event(event(EV.NODE_EVENT_TYPE_CHANGED, B, healthy=False), 10.0)
    assert rotation(m) == [A] and m.probes_due(10.0) == [B]
    assert effects.probe  # the probe loop runs now, not at its next turn
    m.probe_failed(B, "UNAVAILABLE", "no route to host")  # really gone: stays out
    assert rotation(m) == [A] and m.probes_due(11.0) == [B]  # and is probed again
    m.probe_answered(B, info(B), observed_at=12.0)  # it answers the trainer: back
    assert rotation(m) == [A, B] and m.probes_due(12.0) == []
    m.master_event(event(EV.NODE_EVENT_TYPE_CHANGED, B), 20.0)  # the master hears it again
    m.probe_failed(B, "UNAVAILABLE", "x")  # a probe of a master-healthy node decides nothing
    assert rotation(m) == [A, B]
    draining = event(EV.NODE_EVENT_TYPE_CHANGED, B)
    draining.node.status = common_pb2.NODE_STATUS_DRAINING
    m.master_event(draining, 30.0)
    assert rotation(m) == [A] and m.probes_due(30.0) == []
    m.probe_answered(B, info(B), observed_at=31.0)  # an answer does not undo DRAINING
    assert rotation(m) == [A]


def test_a_node_the_master_expired_but_the_trainer_reaches_is_kept_until_a_probe_fails() -> None:
    """The partial cut lasts past the master's ``--expire-after``: the master removes B
    (REMOVED with its UNHEALTHY record). B answered the trainer's probe since the verdict,
    so it stays in rotation; its first failed probe then drops it. A node removed while the
    trainer does not reach it (no answer since the verdict), or removed cleanly (its record
    HEALTHY: deregistered), is dropped at once; a kept node that registers again is the
    master's member as before."""
    m = Membership(BASE, probe_interval_s=5.0)
    m.master_connected()
    for address in (A, B):
        m.master_event(event(EV.NODE_EVENT_TYPE_SNAPSHOT, address), 0.0)
    m.master_event(EV.WatchNodesResponse(type=EV.NODE_EVENT_TYPE_SNAPSHOT_END), 0.0)
    m.master_event(event(EV.NODE_EVENT_TYPE_CHANGED, B, healthy=False), 10.0)
    m.probe_answered(B, info(B), observed_at=11.0)
    effects = m.master_event(event(EV.NODE_EVENT_TYPE_REMOVED, B, healthy=False), 70.0)
    assert effects.forgotten == [] and B in m and rotation(m) == [A, B]
    assert m.expire_orphans(200.0).forgotten == []  # not an orphan of a reconnected master
    m.master_event(event(EV.NODE_EVENT_TYPE_JOINED, B), 80.0)  # it registers again
    m.master_event(event(EV.NODE_EVENT_TYPE_CHANGED, B, healthy=False), 90.0)
    m.probe_answered(B, info(B), observed_at=91.0)
    m.master_event(event(EV.NODE_EVENT_TYPE_REMOVED, B, healthy=False), 150.0)
    assert rotation(m) == [A, B]
    effects = m.probe_failed(B, "UNAVAILABLE", "no route to host")  # now nobody reaches it
    assert effects.forgotten == [B] and B not in m and rotation(m) == [A]
    # expired without an answer to the trainer since the verdict: dropped at once
    m.master_event(event(EV.NODE_EVENT_TYPE_JOINED, B), 200.0)
    m.master_event(event(EV.NODE_EVENT_TYPE_CHANGED, B, healthy=False), 210.0)
    m.probe_failed(B, "UNAVAILABLE", "no route to host")
    assert m.master_event(event(EV.NODE_EVENT_TYPE_REMOVED, B, healthy=False),
                          270.0).forgotten == [B]
    # deregistered (a clean shutdown: its last record is not UNHEALTHY): dropped at once
    m.master_event(event(EV.NODE_EVENT_TYPE_JOINED, B), 300.0)
    assert m.master_event(event(EV.NODE_EVENT_TYPE_REMOVED, B), 310.0).forgotten == [B]
