"""NodePool + AdapterSync against real ``gridrl-rollout serve`` processes on the tiny llama:
exact samples, seeds that give the same groups on any node, adapters pushed over the wire
(converted for MLX nodes), a node killed mid-run, discovery through a real master."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from scripted_nodes import peft_files, peft_manifest, wait_until

from gridrl.models import model_identity
from gridrl.trainer.pool import NodePool
from gridrl.trainer.sync import AdapterSync

NAME = "run-1"
PROMPTS = [[10 + i, 20, 30 + i] for i in range(6)]
SAMPLING = {"group_size": 3, "max_tokens": 6, "temperature": 1.0}


def serve_node(service_factory, model_dir: Path, name: str, backend: str = "torch",
               master: str | None = None):
    root = model_dir.parent / f"adapters-{name}-{time.monotonic_ns()}"
    argv = ["gridrl-rollout", "serve", "--backend", backend, "--model", str(model_dir),
            "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--threads", "1",
            "--capacity", "8", "--adapter-root", str(root), "--name", name]
    if master:
        argv += ["--master", master]
    return service_factory(argv, name)


@pytest.fixture
def make_pool(tiny_llama_dir):
    made = []

    def make(**kw) -> tuple[NodePool, AdapterSync]:
        kw.setdefault("addresses", [])
        kw.setdefault("model_identity", model_identity(tiny_llama_dir))
        pool = NodePool(probe_interval_s=0.2, request_timeout_s=60, **kw)
        sync = AdapterSync(pool, name=NAME, num_layers=2, deadline_s=30)
        made.append((pool, sync))
        pool.start()
        return pool, sync

    yield make
    for pool, sync in made:
        sync.close()
        pool.close()


def check_groups(groups, version: int) -> None:
    assert [g.prompt_index for g in groups] == list(range(len(PROMPTS)))
    for g in groups:
        assert g.prompt_ids == PROMPTS[g.prompt_index] and len(g.samples) == 3
        for s in g.samples:
            assert 1 <= len(s.token_ids) <= 6 and len(s.logprobs) == len(s.token_ids)
            assert all(lp <= 0.0 for lp in s.logprobs)
            assert s.finish_reason in ("stop", "length")
            assert s.policy_version == version and s.node == g.node


def test_real_torch_nodes_sample_sync_and_survive_a_death(tiny_llama_dir, service_factory,
                                                          make_pool) -> None:
    a = serve_node(service_factory, tiny_llama_dir, "node-a")
    b = serve_node(service_factory, tiny_llama_dir, "node-b")
    pool, sync = make_pool(master=None, addresses=[a.address, b.address])
    nodes = pool.wait_for_nodes(2, timeout_s=60)
    assert {(n.backend, n.adapter_format) for n in nodes} == {("torch", "peft")}

    groups = pool.generate_groups(PROMPTS, seed=3, **SAMPLING)
    check_groups(groups, version=0)
    assert {g.node for g in groups} == {a.address, b.address}
    again = pool.generate_groups(PROMPTS, seed=3, **SAMPLING)  # groups may land elsewhere
    assert [[s.token_ids for s in g.samples] for g in again] == [
        [s.token_ids for s in g.samples] for g in groups]

    files = peft_files(1)
    report = sync.push(1, files, peft_manifest(files, NAME, 1))
    assert report.synced == sorted([a.address, b.address]) and report.skipped == {}
    check_groups(pool.generate_groups(PROMPTS, seed=4, **SAMPLING), version=1)
    assert sync.lagging_nodes(1) == []

    b.stop(signal.SIGKILL)
    groups = pool.generate_groups(PROMPTS, seed=5, **SAMPLING)
    check_groups(groups, version=1)
    assert {g.node for g in groups} == {a.address}
    files = peft_files(2)
    report = sync.push(2, files, peft_manifest(files, NAME, 2))
    assert report.synced == [a.address] and list(report.skipped) == [b.address]


@pytest.mark.mlx
def test_real_mlx_node_takes_the_converted_adapter(tiny_llama_dir, service_factory,
                                                   make_pool) -> None:
    pytest.importorskip("mlx_lm")
    node = serve_node(service_factory, tiny_llama_dir, "node-mlx", backend="mlx")
    pool, sync = make_pool(master=None, addresses=[node.address])
    [state] = pool.wait_for_nodes(1, timeout_s=60)
    assert (state.backend, state.adapter_format) == ("mlx", "mlx")
    files = peft_files(1)
    report = sync.push(1, files, peft_manifest(files, NAME, 1))
    assert report.synced == [node.address], report.skipped
    check_groups(pool.generate_groups(PROMPTS, seed=3, **SAMPLING), version=1)


def test_real_node_found_through_the_master(tiny_llama_dir, service_factory, make_pool) -> None:
    master = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1", "--store", "",
                              "--heartbeat-interval", "0.5"], "master")
    node = serve_node(service_factory, tiny_llama_dir, "node-m", master=master.address)
    pool, sync = make_pool(master=master.address)
    [state] = pool.wait_for_nodes(1, timeout_s=60)
    assert state.address == node.address and state.source == "master"
    files = peft_files(1)
    assert sync.push(1, files, peft_manifest(files, NAME, 1)).synced == [node.address]
    check_groups(pool.generate_groups(PROMPTS, seed=3, **SAMPLING), version=1)


def test_node_on_another_checkpoint_is_refused(tiny_llama_dir, service_factory, make_pool,
                                               tmp_path) -> None:
    """A trainer on one fine-tune and a node on another of the same architecture (two tiny
    llamas of different seeds): the node's weights fingerprint differs, it gets no rollouts
    and no adapters, and the error says why."""
    from gridrl.models.testing import make_tiny_llama

    mine = model_identity(make_tiny_llama(tmp_path / "seed1", seed=1))
    node = serve_node(service_factory, tiny_llama_dir, "node-other")
    pool, sync = make_pool(master=None, addresses=[node.address], model_identity=mine)
    wait_until(lambda: pool.node(node.address) is not None and pool.node(node.address).excluded,
               60, "the node to be judged")
    theirs = model_identity(tiny_llama_dir).weights_fingerprint
    assert mine.weights_fingerprint != theirs
    reason = pool.node(node.address).excluded
    assert reason.startswith(f"weights_fingerprint {theirs!r} != the trainer's "
                             f"{mine.weights_fingerprint!r}")
    with pytest.raises(RuntimeError, match=r"no rollout node can serve prompt 0 .*excluded: "
                                           r"weights_fingerprint"):
        pool.generate_groups(PROMPTS, seed=3, **SAMPLING)
    files = peft_files(1)
    report = sync.push(1, files, peft_manifest(files, NAME, 1))
    assert report.synced == []
