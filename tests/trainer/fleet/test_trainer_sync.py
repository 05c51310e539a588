"""AdapterSync over real gRPC servers that verify and record every push: concurrency, per-node
deadlines, skipped nodes catching up, restarted nodes, MLX conversion, foreign adapters."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from prometheus_client import REGISTRY
from scripted_nodes import BASE, IDENTITY, NodeFarm, peft_files
from waiting import wait_for

from gridrl.adapters import convert_files
from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.fleet.pool import NodePool
from gridrl.trainer.fleet.sync import AdapterSync

NAME = "run-1"


@pytest.fixture
def farm():
    f = NodeFarm()
    yield f
    f.close()


@pytest.fixture
def make_sync():
    made: list[tuple[NodePool, AdapterSync]] = []

    def make(nodes, deadline_s: float = 5.0, known_versions=None, listeners=(),
             **kw) -> tuple[NodePool, AdapterSync]:
        """``listeners``: more pool listeners, called after the sync's."""
        kw.setdefault("probe_interval_s", 0.2)
        pool = NodePool(master=None, addresses=[n.address for n in nodes],
                        model_identity=BASE, **kw)
        sync = AdapterSync(pool, name=NAME, base_model=BASE,
                           deadline_s=deadline_s, known_versions=known_versions)
        for fn in listeners:
            pool.add_listener(fn)
        made.append((pool, sync))
        pool.start()
        return pool, sync

    yield make
    for pool, sync in made:
        sync.close()
        pool.close()


def adapter(version: int) -> dict[str, bytes]:
    return peft_files(version)


def test_concurrent_push_deadline_skip_and_catch_up(farm, make_sync) -> None:
    # The three answer only once all three pushes are in flight: pushed one after another,
    # the first would wait past the deadline and be skipped.
    together = threading.Barrier(3)
    fast = [farm.start(push_barrier=together) for _ in range(3)]
    sleepy = farm.start(push_s=30.0)  # answers, but its push never finishes in time
    late = farm.start()
    late.down = True  # not up yet at the first push
    other_model = farm.start(identity={**IDENTITY, "num_layers": 4})
    pool, sync = make_sync([*fast, sleepy, late, other_model], deadline_s=1.0,
                           probe_interval_s=0.5)
    pool.wait_for_nodes(4, timeout_s=10)
    wait_for(lambda: pool.node(other_model.address).excluded, 5, "the mismatch to be seen")
    # The late node must have been probed (and refused) once, or its skip reason is only
    # "no GetNodeInfo answer yet" (seen once on a fast CI machine).
    wait_for(lambda: pool.node(late.address).last_error, 5, "the late node's failed probe")

    files = adapter(1)
    report = sync.push(1, files)

    assert report.synced == sorted(n.address for n in fast)
    assert set(report.skipped) == {sleepy.address, late.address}
    assert "DEADLINE_EXCEEDED" in report.skipped[sleepy.address]
    assert report.skipped[late.address].startswith("unhealthy: GetNodeInfo: UNAVAILABLE")
    # It waited for the sleepy node's deadline (the fast pushes ran at once: the barrier).
    assert report.seconds >= 1.0, report.seconds
    for node in fast:
        assert node.pushed_files == [files]
        assert node.pushes[0]["format"] == "peft" and node.pushes[0]["version"] == 1
        state = pool.node(node.address)
        assert (state.synced_version, state.adapter_version) == (1, 1)
    assert other_model.pushes == []  # a different base model never gets our adapter
    assert "adapter push of policy version 1 failed" in pool.node(sleepy.address).benched
    assert sync.lagging_nodes(1) == sorted([sleepy.address, late.address])
    # The lag is on the dashboard too, per node.
    assert REGISTRY.get_sample_value("gridrl_trainer_node_synced_version",
                                     {"node": fast[0].address}) == 1
    assert REGISTRY.get_sample_value("gridrl_trainer_node_synced_version",
                                     {"node": sleepy.address}) == 0
    assert REGISTRY.get_sample_value("gridrl_trainer_node_in_rotation",
                                     {"node": sleepy.address}) == 0
    assert REGISTRY.get_sample_value("gridrl_trainer_sync_failures_total",
                                     {"node": sleepy.address}) >= 1

    # Both come back and receive the newest version without another push.
    sleepy.push_s = 0.0
    late.down = False
    wait_for(lambda: sync.lagging_nodes(1) == [], 10, "the skipped nodes to catch up")
    for node in (sleepy, late):
        assert node.adapter == (NAME, 1) and node.pushed_files[-1] == files
        assert pool.node(node.address).in_rotation

    for node in fast:
        node.push_barrier = None  # the next push goes to five nodes
    files2 = adapter(2)
    report = sync.push(2, files2)
    assert report.skipped == {}
    assert report.synced == sorted(n.address for n in [*fast, sleepy, late])
    assert sync.lagging_nodes(2) == []


def test_mlx_nodes_receive_converted_files(farm, make_sync) -> None:
    torch_node = farm.start()
    mlx_node = farm.start(backend="mlx", adapter_format="mlx")
    pool, sync = make_sync([torch_node, mlx_node])
    pool.wait_for_nodes(2, timeout_s=10)
    files = adapter(1)
    report = sync.push(1, files)

    assert report.synced == sorted([torch_node.address, mlx_node.address])
    assert torch_node.pushes[0]["format"] == "peft" and torch_node.pushed_files == [files]
    pushed = mlx_node.pushes[0]
    assert pushed["format"] == "mlx" and pushed["version"] == 1 and pushed["name"] == NAME
    assert pushed["base_model"]["hidden_size"] == IDENTITY["hidden_size"]
    assert mlx_node.pushed_files == [convert_files(files, "mlx", IDENTITY["num_layers"])]
    assert set(mlx_node.pushed_files[0]) == {"adapter_config.json", "adapters.safetensors"}


def test_restarted_node_is_caught_up_before_its_samples_are_used(farm, make_sync) -> None:
    """A node that lost its adapter (restarted between two steps, unnoticed) answers a group
    with base-model samples: the group is discarded, the node waits out of rotation for the
    current adapter, gets it, and the group is sampled again on it, at version 1."""
    node = farm.start()
    pool, sync = make_sync([node], wait_for_nodes_s=10)
    pool.wait_for_nodes(1, timeout_s=10)
    files = adapter(1)
    assert sync.push(1, files).synced == [node.address]

    node.adapter = ("", 0)  # the process restarted: it serves the base model again
    groups = pool.generate_groups([[1, 2]], SamplingConfig(max_tokens=4, temperature=1.0),
                                  group_size=2)
    assert {s.policy_version for s in groups[0].samples} == {1}  # sampled after the catch-up
    assert node.adapter == (NAME, 1)
    assert len(node.pushes) == 2 and node.pushed_files[-1] == files
    assert len(node.generates) == 2  # the base-model group, then the one kept
    state = pool.node(node.address)
    assert state.in_rotation and not state.syncing
    assert sync.lagging_nodes(1) == []


def test_a_catch_up_overtaken_by_a_newer_push_never_rolls_the_node_back(farm, make_sync) -> None:
    """The fault test's race: a catch-up of version 1 waits for the node's push lock while the
    push of version 2 runs; whichever takes the lock first, the node ends serving version 2,
    in rotation, and version 1 is never pushed once version 2 exists (it was superseded)."""
    node = farm.start()
    pool, sync = make_sync([node], wait_for_nodes_s=10)
    pool.wait_for_nodes(1, timeout_s=10)
    files1 = adapter(1)
    assert sync.push(1, files1).synced == [node.address]
    node.adapter = ("", 0)  # restarted, unnoticed: the catch-up below finds it on the base model

    lock = sync._node_lock(node.address)
    lock.acquire()  # hold the node's push lock: both pushes queue on it
    infos = node.infos
    # the pool's listener call for a node seen serving the base model: catch it up to version
    # 1 (the newest, for now)
    sync._on_node(dataclasses.replace(pool.node(node.address), adapter_version=0))
    wait_for(lambda: node.infos > infos, 10, what="the catch-up's GetNodeInfo")
    files2 = adapter(2)
    pushing = threading.Thread(target=sync.push, args=(2, files2))
    pushing.start()
    wait_for(lambda: sync.newest_version == 2, 10, what="the push of version 2 to begin")
    lock.release()
    pushing.join(10)
    sync.close()  # waits for the catch-up
    assert node.adapter == (NAME, 2)
    assert [m["version"] for m in node.pushes] == [1, 2]  # version 1 never pushed after version 2
    state = pool.node(node.address)
    assert state.in_rotation and (state.adapter_version, state.synced_version) == (2, 2)


def test_foreign_adapter_reset_to_base_before_first_push(farm, make_sync) -> None:
    node = farm.start(adapter=("someone-elses-run", 7))
    pool, _sync = make_sync([node])
    pool.wait_for_nodes(1, timeout_s=10)
    wait_for(lambda: node.reloads == 1, 5, "the node switched to the base model")
    assert node.adapter == ("", 0)
    wait_for(lambda: pool.node(node.address).adapter_version == 0, 5, "version 0 recorded")


def test_same_name_adapter_of_an_earlier_run_reset_to_base(farm, make_sync) -> None:
    """A fresh run reusing a run name: v7 of that name is not in this run's lineage."""
    node = farm.start(adapter=(NAME, 7))
    pool, _sync = make_sync([node])
    pool.wait_for_nodes(1, timeout_s=10)
    wait_for(lambda: node.reloads == 1, 5, "the node switched to the base model")
    assert node.adapter == ("", 0)


def test_resumed_run_keeps_a_node_on_its_own_lineage(farm, make_sync) -> None:
    node = farm.start(adapter=(NAME, 7))
    seen = threading.Event()
    pool, sync = make_sync([node], known_versions=lambda: {0: 0, 6: 3, 7: 4},
                           listeners=[lambda state: seen.set()])
    pool.wait_for_nodes(1, timeout_s=10)
    assert seen.wait(10), "the pool never announced the node"  # the sync's listener ran
    sync.close()  # a reset the listener submitted would have run by now
    assert node.reloads == 0 and node.adapter == (NAME, 7)


def test_push_refuses_inconsistent_input(farm, make_sync) -> None:
    node = farm.start()
    pool, sync = make_sync([node])
    pool.wait_for_nodes(1, timeout_s=10)
    files = adapter(2)
    with pytest.raises(ValueError, match=r"not a peft or mlx-lm adapter"):  # not an adapter's files
        sync.push(2, {"weights.bin": b"..."})
    sync.push(2, files)
    files1 = adapter(1)
    with pytest.raises(ValueError, match=r"^version: 1 is older than the last push \(2\)"):
        sync.push(1, files1)
    assert [p["version"] for p in node.pushes] == [2]
    # the manifest is the sync's own: its adapter name, the version pushed, the base model
    assert node.pushes[0]["name"] == NAME and node.pushes[0]["format"] == "peft"
    assert node.pushes[0]["base_model"]["num_layers"] == BASE.num_layers
