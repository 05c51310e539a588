"""NodePool + AdapterSync against real ``gridrl-rollout serve`` processes on the tiny llama:
exact samples, seeds that give the same groups on any node, adapters pushed over the wire
(converted for MLX nodes), a node killed mid-run, discovery through a real master."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from scripted_nodes import peft_files
from waiting import wait_for

from gridrl.engine.contract import SamplingConfig
from gridrl.models import model_identity
from gridrl.trainer.fleet.pool import NodePool
from gridrl.trainer.fleet.sync import AdapterSync

NAME = "run-1"
PROMPTS = [[10 + i, 20, 30 + i] for i in range(6)]
SAMPLING = SamplingConfig(max_tokens=6, temperature=1.0)
GROUP = 3  # samples per group


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
        sync = AdapterSync(pool, name=NAME, base_model=kw["model_identity"], deadline_s=30)
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

    groups = pool.generate_groups(PROMPTS, SAMPLING, group_size=GROUP, seed=3)
    check_groups(groups, version=0)
    assert {g.node for g in groups} == {a.address, b.address}
    again = pool.generate_groups(PROMPTS, SAMPLING, group_size=GROUP, seed=3)  # groups may land elsewhere
    assert [[s.token_ids for s in g.samples] for g in again] == [
        [s.token_ids for s in g.samples] for g in groups]

    files = peft_files(1)
    report = sync.push(1, files)
    assert report.synced == sorted([a.address, b.address]) and report.skipped == {}
    check_groups(pool.generate_groups(PROMPTS, SAMPLING, group_size=GROUP, seed=4), version=1)
    assert sync.lagging_nodes(1) == []

    b.stop(signal.SIGKILL)
    groups = pool.generate_groups(PROMPTS, SAMPLING, group_size=GROUP, seed=5)
    check_groups(groups, version=1)
    assert {g.node for g in groups} == {a.address}
    files = peft_files(2)
    report = sync.push(2, files)
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
    report = sync.push(1, files)
    assert report.synced == [node.address], report.skipped
    check_groups(pool.generate_groups(PROMPTS, SAMPLING, group_size=GROUP, seed=3), version=1)


def test_real_node_found_through_the_master(tiny_llama_dir, service_factory, make_pool) -> None:
    master = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1", "--store", "",
                              "--heartbeat-interval", "0.5"], "master")
    node = serve_node(service_factory, tiny_llama_dir, "node-m", master=master.address)
    pool, sync = make_pool(master=master.address)
    [state] = pool.wait_for_nodes(1, timeout_s=60)
    assert state.address == node.address and state.source == "master"
    files = peft_files(1)
    assert sync.push(1, files).synced == [node.address]
    check_groups(pool.generate_groups(PROMPTS, SAMPLING, group_size=GROUP, seed=3), version=1)


def test_node_on_another_checkpoint_is_refused(tiny_llama_dir, service_factory, make_pool,
                                               tmp_path) -> None:
    """A trainer on one fine-tune and a node on another of the same architecture (two tiny
    llamas of different seeds): the node's weights fingerprint differs, it gets no rollouts
    and no adapters, and the error says why."""
    from gridrl.models.testing import make_tiny_llama

    mine = model_identity(make_tiny_llama(tmp_path / "seed1", seed=1))
    node = serve_node(service_factory, tiny_llama_dir, "node-other")
    pool, sync = make_pool(master=None, addresses=[node.address], model_identity=mine)
    wait_for(lambda: pool.node(node.address) is not None and pool.node(node.address).excluded,
               60, "the node to be judged")
    theirs = model_identity(tiny_llama_dir).weights_fingerprint
    assert mine.weights_fingerprint != theirs
    reason = pool.node(node.address).excluded
    assert reason.startswith(f"weights_fingerprint {theirs!r} != the trainer's "
                             f"{mine.weights_fingerprint!r}")
    with pytest.raises(RuntimeError, match=r"no rollout node can serve prompt 0 .*excluded: "
                                           r"weights_fingerprint"):
        pool.generate_groups(PROMPTS, SAMPLING, group_size=GROUP, seed=3)
    files = peft_files(1)
    report = sync.push(1, files)
    assert report.synced == []


def test_episodes_stay_on_their_node_and_a_killed_node_drops_only_its_own(
        tiny_llama_dir, service_factory, make_pool) -> None:
    """Multi-turn episodes over two real nodes (NodePool.sample_turns): a group's episodes
    and every later turn go to the node of the group's first turn, with keep_cache on every
    turn but the last. One node SIGKILLed between turn 1 and turn 2: its episodes are dropped
    and counted (``sampler``), never continued on the other node; the other node's episodes
    finish their three turns there."""
    from transformers import AutoTokenizer

    from gridrl.trainer.envs.base import Environment, EnvTurn, TaskItem
    from gridrl.trainer.envs.episode import EpisodeLimits
    from gridrl.trainer.envs.source import EpisodeSource

    a = serve_node(service_factory, tiny_llama_dir, "node-a")
    b = serve_node(service_factory, tiny_llama_dir, "node-b")
    pool, _ = make_pool(master=None, addresses=[a.address, b.address])
    pool.wait_for_nodes(2, timeout_s=60)
    killed: list[str] = []

    class Feedback(Environment):
        name = "feedback"

        def train_item(self, index):
            return TaskItem(f"w{index}", ({"role": "user", "content": f"red cat w{index}"},),
                            {})

        def eval_items(self):
            return [self.train_item(0)]

        def respond(self, item, transcript, state):
            if not killed:  # after every turn 1 came back, before any turn 2 is asked
                a.stop(signal.SIGKILL)
                killed.append(a.address)
            return EnvTurn([{"role": "user", "content": "again"}])

        def score(self, prompts, completions, **columns):
            return [0.0] * len(completions)

    calls: list[tuple[list, list]] = []
    sample_turns = pool.sample_turns

    def recording(requests, sampling):
        results = sample_turns(requests, sampling)
        calls.append((list(requests), results))
        return results

    pool.sample_turns = recording  # type: ignore[method-assign]
    env = Feedback()
    source = EpisodeSource(env, AutoTokenizer.from_pretrained(tiny_llama_dir), pool,
                           EpisodeLimits(max_turns=3, max_tokens=4))
    items = [env.train_item(i) for i in range(4)]
    groups, stats = source.generate(items, SamplingConfig(max_tokens=4, temperature=1.0),
                                    group_size=2, seed=9)

    first_requests, first_results = calls[0]
    assert all(r.n == 2 and r.keep_cache and not r.node for r in first_requests)
    node_of = {r.group: res[0].node for r, res in zip(first_requests, first_results, strict=True)}
    assert set(node_of.values()) == {a.address, b.address}  # the groups spread over both
    assert len(calls) == 3  # turns 2 and 3
    for turn, (requests, results) in enumerate(calls[1:], start=2):
        for r, res in zip(requests, results, strict=True):
            assert r.n == 1 and r.node == node_of[r.group]  # pinned to the group's node
            assert r.keep_cache == (turn < 3)  # the last turn keeps no cache
            if isinstance(res, BaseException):
                assert r.node == a.address
            else:
                assert {s.node for s in res} == {r.node} != {a.address}
    on_a = sum(v == a.address for v in node_of.values())
    assert stats.dropped == {"sampler": 2 * on_a} and stats.episodes == 8
    for g in groups:
        if node_of[g.prompt_index] == a.address:
            assert g.samples == []
        else:
            assert len(g.samples) == 2 and g.node == b.address
            assert all(s.episode.turns == 3 and s.node == b.address for s in g.samples)
