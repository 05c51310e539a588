"""NodePool over real gRPC servers: capacity weighting, retries, rotation, node death, model
mismatch, and discovery through a real ``gridrl-master serve``."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from concurrent import futures
from dataclasses import replace

import pytest
from scripted_nodes import BASE, IDENTITY, NodeFarm
from waiting import wait_for

from gridrl.common.registration import NodeRegistrar
from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.fleet.pool import NodePool
from gridrl.trainer.rollouts import group_seed

SAMPLING = SamplingConfig(max_tokens=8, temperature=1.0)
GROUP = 2  # samples per group


@pytest.fixture
def farm():
    f = NodeFarm()
    yield f
    f.close()


@pytest.fixture
def make_pool():
    pools: list[NodePool] = []

    def make(addresses=(), master=None, **kw) -> NodePool:
        kw.setdefault("probe_interval_s", 0.2)
        kw.setdefault("model_identity", BASE)
        pool = NodePool(master=master, addresses=list(addresses), **kw)
        pools.append(pool)
        pool.start()
        return pool

    yield make
    for pool in pools:
        pool.close()


@contextlib.contextmanager
def concurrent_call(fn):
    """Run ``fn`` on another thread for the duration of the block; yields its future."""
    with futures.ThreadPoolExecutor(1) as executor:
        future = executor.submit(fn)
        yield future
        future.result(timeout=30)


def prompts(n: int) -> list[list[int]]:
    return [[5, 6, 7 + i] for i in range(n)]


def test_groups_spread_by_capacity_in_order_with_versions(farm, make_pool) -> None:
    big = farm.start(capacity=8, generate_s=0.05, adapter=("run", 3))
    small = farm.start(capacity=2, generate_s=0.05, adapter=("run", 2))
    pool = make_pool([big.address, small.address])
    pool.wait_for_nodes(2, timeout_s=10)
    groups = pool.generate_groups(prompts(40), SAMPLING, group_size=GROUP, seed=7)

    assert [g.prompt_index for g in groups] == list(range(40))
    per_node = Counter(g.node for g in groups)
    # Slots: big 8 // 2 = 4 groups at a time, small 1: about 4x the groups on the big node.
    assert per_node[big.address] >= 2.5 * per_node[small.address], per_node
    assert per_node[small.address] >= 3, per_node
    assert big.max_active <= 4 and small.max_active == 1
    assert big.max_active >= 3  # the big node really ran groups concurrently
    for g in groups:
        assert g.prompt_ids == prompts(40)[g.prompt_index]
        assert len(g.samples) == 2 and g.seconds > 0
        want = 3 if g.node == big.address else 2
        assert {s.policy_version for s in g.samples} == {want}
        assert {s.node for s in g.samples} == {g.node}
        assert g.samples[0].finish_reason == "stop" and g.samples[0].logprobs == [-0.5, -0.25]
    requests = {tuple(r.prompt_token_ids): r for r in big.generates + small.generates}
    for i, p in enumerate(prompts(40)):
        r = requests[tuple(p)]
        assert r.sampling.n == 2 and r.sampling.max_tokens == 8
        assert r.sampling.seed == group_seed(7, i)
    assert len({group_seed(7, i) for i in range(40)} | {group_seed(8, 0)}) == 41


def test_slow_node_does_not_hold_steps_back(farm, make_pool, monkeypatch) -> None:
    """A node 40x slower than another (MLX on a Linux CPU beside torch): once both latencies
    are measured, groups go to the fast node, queueing there, instead of a batch waiting for
    the slow node; the slow node is tried again after sitting idle long enough.

    The scripted latencies are lower bounds (a busy machine only adds to them), so the slow
    node's 2 s beats three rounds on the fast one unless a 0.05 s call takes 0.6 s; its idle
    time runs on the pool's injected clock, moved on without sleeping."""
    from gridrl.trainer.fleet import scheduling

    fast = farm.start(capacity=4, generate_s=0.05)  # 2 groups at a time
    slow = farm.start(capacity=4, generate_s=2.0)
    skipped = [0.0]  # seconds the pool's clock is ahead of real time
    pool = make_pool([fast.address, slow.address],
                     clock=lambda: time.monotonic() + skipped[0])
    pool.wait_for_nodes(2, timeout_s=10)
    first = pool.generate_groups(prompts(4), SAMPLING, group_size=GROUP)  # measures both
    assert {g.node for g in first} == {fast.address, slow.address}
    states = {s.address: s for s in pool.nodes()}
    assert states[fast.address].group_s >= 0.05 and states[slow.address].group_s >= 2.0
    from prometheus_client import REGISTRY  # exported for the dashboard

    assert REGISTRY.get_sample_value("gridrl_trainer_node_group_seconds",
                                     {"node": slow.address}) == states[slow.address].group_s
    slow_calls = len(slow.generates)
    for _ in range(3):  # 3 batches of 2 on the fast node (~0.15 s) beat 2 s on the slow one
        groups = pool.generate_groups(prompts(6), SAMPLING, group_size=GROUP)
        assert [g.prompt_index for g in groups] == list(range(6))
        assert {g.node for g in groups} == {fast.address}
    assert len(slow.generates) == slow_calls
    # idle for REEXPLORE_AFTER latencies (min REEXPLORE_MIN_S): tried again
    monkeypatch.setattr(scheduling, "REEXPLORE_MIN_S", 0.0)
    monkeypatch.setattr(scheduling, "REEXPLORE_AFTER", 0.5)
    # the pool's clock: the slow node idle half its latency more, no sleep
    skipped[0] += 0.5 * pool.node(slow.address).group_s + 0.01
    groups = pool.generate_groups(prompts(6), SAMPLING, group_size=GROUP)
    assert slow.address in {g.node for g in groups}


def test_batch_waits_for_a_node_busy_with_another_batch(farm, make_pool) -> None:
    """Two generate_groups calls at once (the pool is shared): a group whose best node is busy
    with the other call's group waits for it instead of failing with "no node can serve"."""
    fast = farm.start(capacity=2, generate_s=0.3)  # one group at a time
    slow = farm.start(capacity=2, generate_s=3.0)  # (lower bounds: two 0.3 s rounds beat 3 s)
    pool = make_pool([fast.address, slow.address])
    pool.wait_for_nodes(2, timeout_s=10)
    pool.generate_groups(prompts(2), SAMPLING, group_size=GROUP)  # measures both latencies
    fast.gate = threading.Event()  # the fast node holds its groups until the gate opens
    with concurrent_call(lambda: pool.generate_groups(prompts(1), SAMPLING, group_size=GROUP)) as other:
        wait_for(lambda: fast.active == 1, 5, "the other batch's group on the fast node")
        opener = threading.Timer(0.3, fast.gate.set)  # as if that group took 0.3 s more
        opener.start()
        groups = pool.generate_groups(prompts(1), SAMPLING, group_size=GROUP)  # waits for the fast node
        opener.join()
    assert [g.node for g in groups] == [fast.address]
    assert [g.node for g in other.result()] == [fast.address]
    assert len(slow.generates) == 1  # the measuring group only


@pytest.mark.parametrize("failure", ["error", "deadline"])
def test_failing_node_retried_elsewhere_benched_and_back(farm, make_pool, failure) -> None:
    good = farm.start(capacity=2, generate_s=0.2)  # busy long enough for bad to fail twice
    bad = farm.start(capacity=2)
    pool = make_pool([good.address, bad.address], request_timeout_s=0.5,
                     max_consecutive_failures=2, probe_interval_s=1.0)
    returned = []
    pool.add_listener(lambda s: returned.append(s.address))
    pool.wait_for_nodes(2, timeout_s=10)
    returned.clear()
    if failure == "error":
        bad.down = True  # every call fails, probes too
    else:
        bad.generate_s = 5.0  # Generate sleeps past the deadline
        bad.down = False
    groups = pool.generate_groups(prompts(8), SAMPLING, group_size=GROUP)

    assert [g.prompt_index for g in groups] == list(range(8))
    assert {g.node for g in groups} == {good.address}
    state = {s.address: s for s in pool.nodes()}[bad.address]
    assert not state.in_rotation
    assert "2 consecutive Generate failures" in state.benched
    assert ("UNAVAILABLE" if failure == "error" else "DEADLINE_EXCEEDED") in state.benched
    if failure == "error":
        assert len(bad.generates) == 0  # refused before recording
    else:
        assert len(bad.generates) == 2

    # Back once a probe answers (and only Generate was failing in the deadline case).
    bad.down = False
    bad.generate_s = 0.0
    wait_for(lambda: pool.node(bad.address).in_rotation, 5, "the node back in rotation")
    assert returned == [bad.address]
    # It gets groups again (most of them: it now answers at once while the other node holds
    # its group, and groups go where they are expected to finish first).
    served_before, good.gate = len(bad.generates), threading.Event()
    with concurrent_call(lambda: pool.generate_groups(prompts(8), SAMPLING, group_size=GROUP)) as batch:
        wait_for(lambda: len(bad.generates) - served_before >= 4, 30,
                 "groups on the node back in rotation")
        good.gate.set()
    assert Counter(g.node for g in batch.result())[bad.address] >= 4


def test_node_killed_mid_step_run_continues(farm, make_pool) -> None:
    a, b, c = (farm.start(capacity=2, generate_s=0.1) for _ in range(3))
    pool = make_pool([a.address, b.address, c.address], request_timeout_s=5)
    pool.wait_for_nodes(3, timeout_s=10)
    killer = threading.Timer(0.25, b.kill)
    killer.start()
    groups = pool.generate_groups(prompts(30), SAMPLING, group_size=GROUP)
    killer.join()

    assert [g.prompt_index for g in groups] == list(range(30))
    per_node = Counter(g.node for g in groups)
    assert per_node[a.address] > 0 and per_node[c.address] > 0
    assert per_node[b.address] < 10  # it died a quarter of the way through
    # The next step goes on without it.
    groups = pool.generate_groups(prompts(6), SAMPLING, group_size=GROUP)
    assert b.address not in {g.node for g in groups}


def test_all_nodes_dead_raises_quickly(farm, make_pool) -> None:
    a, b = farm.start(), farm.start()
    pool = make_pool([a.address, b.address], request_timeout_s=5)
    pool.wait_for_nodes(2, timeout_s=10)
    a.kill()
    b.kill()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        pool.generate_groups(prompts(4), SAMPLING, group_size=GROUP)
    assert time.monotonic() - start < 5
    assert a.address in str(e.value) and b.address in str(e.value)
    assert "UNAVAILABLE" in str(e.value)
    wait_for(lambda: all(s.in_flight == 0 for s in pool.nodes()), 5, "no call left in flight")


def test_model_mismatch_is_excluded_loudly(farm, make_pool, caplog) -> None:
    good = farm.start()
    other = farm.start(identity={**IDENTITY, "hidden_size": 32})
    caplog.set_level(logging.ERROR, logger="gridrl.trainer.fleet.pool")
    pool = make_pool([good.address, other.address])
    pool.wait_for_nodes(1, timeout_s=10)
    wait_for(lambda: pool.node(other.address).excluded, 5, "the mismatch to be seen")

    state = pool.node(other.address)
    assert not state.in_rotation and state.excluded == "hidden_size 32 != 64"
    assert any("EXCLUDED" in r.message and other.address in r.message for r in caplog.records)
    groups = pool.generate_groups(prompts(6), SAMPLING, group_size=GROUP)
    assert {g.node for g in groups} == {good.address}
    assert other.generates == []


def test_another_checkpoint_of_the_architecture_is_excluded(farm, make_pool, caplog) -> None:
    """Same architecture and sizes, other weights (another fine-tune): the fingerprints differ;
    a node that does not report one (unknown) is not judged by it."""
    mine, theirs = "wfp1:" + "a" * 32, "wfp1:" + "b" * 32
    same = farm.start(identity={**IDENTITY, "weights_fingerprint": mine})
    unknown = farm.start()
    other = farm.start(identity={**IDENTITY, "weights_fingerprint": theirs})
    caplog.set_level(logging.ERROR, logger="gridrl.trainer.fleet.pool")
    pool = make_pool([same.address, unknown.address, other.address],
                     model_identity=replace(BASE, weights_fingerprint=mine))
    pool.wait_for_nodes(2, timeout_s=10)
    wait_for(lambda: pool.node(other.address).excluded, 5, "the mismatch to be seen")
    assert pool.node(other.address).excluded == (
        f"weights_fingerprint {theirs!r} != the trainer's {mine!r} (another checkpoint of this "
        "architecture: start the node on the trainer's --model)")
    assert not pool.node(same.address).excluded and not pool.node(unknown.address).excluded
    assert any("EXCLUDED" in r.message and other.address in r.message for r in caplog.records)
    groups = pool.generate_groups(prompts(6), SAMPLING, group_size=GROUP)
    assert {g.node for g in groups} == {same.address, unknown.address}
    assert other.generates == []


def test_wait_for_nodes_timeout_names_nodes(farm, make_pool) -> None:
    node = farm.start()
    node.down = True
    pool = make_pool([node.address])
    wait_for(lambda: pool.node(node.address).last_error, 5, "the first probe to fail")
    with pytest.raises(TimeoutError) as e:
        pool.wait_for_nodes(1, timeout_s=0.5)
    assert node.address in str(e.value) and "UNAVAILABLE" in str(e.value)


def test_invalid_request_rejected_by_every_node_is_a_value_error(farm, make_pool) -> None:
    node = farm.start()
    pool = make_pool([node.address])
    pool.wait_for_nodes(1, timeout_s=10)
    with pytest.raises(ValueError, match=r"prompt 0: 1020 prompt tokens \+ max_tokens 8"):
        pool.generate_groups([[1] * 1020], SAMPLING, group_size=GROUP)  # beyond the node's max_context 1024
    with pytest.raises(ValueError, match=r"prompt 1: rejected by every node in rotation: "
                                         r".*prompt_token_ids\[0\]: 600 is outside"):
        pool.generate_groups([[1], [600]], SAMPLING, group_size=GROUP)  # the node refuses token 600
    state = pool.node(node.address)
    assert state.in_rotation and state.failures == 0


# ----------------------------------------------------------------------------- master


def _register(node, master_address: str) -> NodeRegistrar:
    registrar = NodeRegistrar(master_address, info_fn=node.info, retry_interval_s=0.2)
    registrar.start()
    return registrar


def test_master_discovery_rotation_and_restart(farm, make_pool, service_factory, tmp_path) -> None:
    store = tmp_path / "master.sqlite"
    args = ["gridrl-master", "serve", "--metrics-port", "-1", "--store", str(store),
            "--heartbeat-interval", "0.2", "--unhealthy-after", "0.8", "--expire-after", "5"]
    master = service_factory([*args, "--listen", "127.0.0.1:0"], "master")
    a, b = farm.start(capacity=4), farm.start(capacity=4)
    registrars = [_register(a, master.address), _register(b, master.address)]
    try:
        pool = make_pool(master=master.address, max_consecutive_failures=1)
        joined = []
        pool.add_listener(lambda s: joined.append(s.address))
        pool.wait_for_nodes(2, timeout_s=10)
        assert {s.source for s in pool.nodes()} == {"master"}
        groups = pool.generate_groups(prompts(8), SAMPLING, group_size=GROUP)
        assert {g.node for g in groups} == {a.address, b.address}

        # b sleeps: Generate fails, heartbeats stop -> benched, then UNHEALTHY at the master.
        b.down = True
        registrars[1].stop(deregister=False)
        groups = pool.generate_groups(prompts(8), SAMPLING, group_size=GROUP)
        assert {g.node for g in groups} == {a.address}
        wait_for(lambda: not pool.node(b.address).healthy, 5, "the master to mark b unhealthy")
        # b wakes up and heartbeats: the master's CHANGED(HEALTHY) puts it back.
        joined.clear()
        b.down = False
        registrars[1] = _register(b, master.address)
        wait_for(lambda: pool.node(b.address).in_rotation, 5, "b back in rotation")
        assert joined == [b.address]

        # The master restarts on the same port (with its store): the pool reconnects, keeps
        # its nodes meanwhile, and sees a node that joins after the restart.
        port = master.address.rsplit(":", 1)[1]
        master.stop()
        groups = pool.generate_groups(prompts(4), SAMPLING, group_size=GROUP)  # no master: still served
        assert len(groups) == 4
        master = service_factory([*args, "--listen", f"127.0.0.1:{port}"], "master2")
        c = farm.start(capacity=4)
        registrars.append(_register(c, master.address))
        wait_for(lambda: pool.node(c.address) is not None and pool.node(c.address).in_rotation,
                   10, "c discovered after the master restart")
        assert {s.address for s in pool.nodes()} == {a.address, b.address, c.address}

        # A node deregistering leaves the pool.
        registrars[0].stop(deregister=True)
        wait_for(lambda: pool.node(a.address) is None, 5, "a removed")
    finally:
        for r in registrars:
            r.stop(deregister=False)


# ------------------------------------------------------------------------ waiting for nodes


def test_no_node_in_rotation_waits_reports_and_goes_on(farm, make_pool) -> None:
    """The only node dies mid-step: the batch waits (reporting what for and how long is
    left, also as metrics) instead of failing, and finishes once the node answers again."""
    from prometheus_client import REGISTRY

    node = farm.start(capacity=2)
    reports = []
    pool = make_pool([node.address], max_consecutive_failures=1, wait_for_nodes_s=30,
                     on_wait=reports.append)
    pool.wait_for_nodes(1, timeout_s=10)
    assert all(r is None or r.starting for r in reports)  # the start's own wait, if any
    started = len(reports)
    node.down = True
    with concurrent_call(lambda: pool.generate_groups(prompts(3), SAMPLING, group_size=GROUP)) as batch:
        wait_for(lambda: len(reports) >= started + 2, 10, "the wait to be reported")
        wait = reports[-1]
        assert wait is not None and not wait.starting
        assert 0 < wait.left_s <= 30 and wait.waited_s >= 0
        assert node.address in wait.waiting_for and "benched" in wait.waiting_for
        assert REGISTRY.get_sample_value("gridrl_trainer_node_wait_left_seconds") > 0
        node.down = False  # it wakes up: the prober sees it, the batch goes on
    groups = batch.result()
    assert [g.prompt_index for g in groups] == [0, 1, 2]
    assert {g.node for g in groups} == {node.address}
    assert reports[-1] is None  # the wait ended
    assert REGISTRY.get_sample_value("gridrl_trainer_node_wait_left_seconds") == 0


def test_every_node_gone_fails_after_the_wait(farm, make_pool) -> None:
    a, b = farm.start(), farm.start()
    pool = make_pool([a.address, b.address], request_timeout_s=5, wait_for_nodes_s=0.5)
    pool.wait_for_nodes(2, timeout_s=10)
    a.kill()
    b.kill()
    with pytest.raises(RuntimeError) as e:
        pool.generate_groups(prompts(4), SAMPLING, group_size=GROUP)
    assert "(0 in rotation) after waiting" in str(e.value) and "--outage-wait-s" in str(e.value)
    assert a.address in str(e.value) and b.address in str(e.value)


def test_a_stuck_group_is_hedged_on_another_node_and_the_first_answer_wins(
        farm, make_pool) -> None:
    """With --hedge-after, a group running k times its node's latency (here: unmeasured, so
    --hedge-min-s) on the injected clock is started again on a free node; its answer is the
    group's, the stuck call is cancelled and counted as a hedge."""
    from gridrl.trainer.fleet import metrics
    from gridrl.trainer.fleet.hedging import HedgePolicy

    stuck = farm.start(capacity=1, generate_s=60.0)
    fast = farm.start(capacity=1)
    now = [1000.0]
    pool = make_pool([stuck.address, fast.address], clock=lambda: now[0],
                     hedge=HedgePolicy(3.0, 5.0))
    pool.wait_for_nodes(2, timeout_s=30)
    hedges = metrics.REDISPATCHED.labels(stuck.address, "hedge")
    before = hedges._value.get()
    with concurrent_call(lambda: pool.generate_groups(
            prompts(2), SamplingConfig(max_tokens=4, temperature=1.0), group_size=2)) as result:
        wait_for(lambda: len(stuck.generates) == 1 and len(fast.generates) == 1, 30,
                 "one group on each node")
        assert not result.done()
        now[0] += 4.0  # under --hedge-min-s: nothing happens
        wait_for(lambda: pool.node(fast.address).in_flight == 0, 30, "the fast group done")
        assert len(fast.generates) == 1 and not result.done()
        now[0] += 2.0  # 6 s > 5 s: hedged on the free node
        groups = result.result(timeout=30)
    assert {g.node for g in groups} == {fast.address}
    assert len(fast.generates) == 2 and len(stuck.generates) == 1
    assert hedges._value.get() == before + 1
