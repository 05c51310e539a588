"""A flag acts: a flagged node is benched, re-pushed and checked afresh before it samples again
(scripted nodes over real gRPC); the fresh mismatch KL on the tiny llama."""

from __future__ import annotations

import math

import pytest
from prometheus_client import REGISTRY
from scripted_nodes import BASE, NodeFarm, peft_files
from waiting import wait_for

from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.fleet.pool import NodePool
from gridrl.trainer.fleet.probation import Probation, Review, fresh_mismatch_kl
from gridrl.trainer.fleet.sync import AdapterSync
from gridrl.trainer.report.console import ConsoleLines
from gridrl.trainer.report.events import NodeReviewed

NAME = "run-1"
SAMPLING = SamplingConfig(max_tokens=4, temperature=1.0, top_p=1.0, top_k=0)


class Console:
    """Collects the reviews as the run's console prints them (``ConsoleLines``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.reviews: list[Review] = []
        self._console = ConsoleLines(self, total_steps=1, remote=True)

    def print(self, line: str) -> None:
        self.lines.append(line)

    def on_review(self, review: Review) -> None:
        self.reviews.append(review)
        self._console.on_event(NodeReviewed(review))


@pytest.fixture
def setup():
    farm = NodeFarm()
    made = []

    def make(n_nodes: int = 1, kl: float = 1e-7, version: int = 1, interval_s: float = 0.2):
        nodes = [farm.start() for _ in range(n_nodes)]
        pool = NodePool(master=None, addresses=[n.address for n in nodes],
                        model_identity=BASE, probe_interval_s=0.2, wait_for_nodes_s=20)
        sync = AdapterSync(pool, name=NAME, base_model=BASE, deadline_s=5)
        pool.start()
        pool.wait_for_nodes(n_nodes, timeout_s=10)
        files = peft_files(1)
        sync.push(1, files)
        measured = {"kl": kl, "calls": 0}

        def check_kl(prompt, samples):
            measured["calls"] += 1
            assert prompt == [5, 6, 7] and len(samples) == 2
            return measured["kl"]

        console = Console()
        current = {"version": version}
        probation = Probation(pool, sync, check_kl=check_kl,
                              current_version=lambda: current["version"],
                              bound=lambda node: 0.01, prompt=[5, 6, 7], sampling=SAMPLING,
                              group_size=2,
                              on_review=console.on_review, interval_s=interval_s,
                              max_interval_s=2 * interval_s)
        probation.start()
        made.append((pool, sync, probation))
        return nodes, pool, probation, measured, console, current

    yield make
    for pool, sync, probation in made:
        probation.close()
        sync.close()
        pool.close()
    farm.close()


def flag(pool, probation, address: str, reason: str) -> None:
    """As the run does when the monitor flags a node: the flag to its owner (the pool's
    membership), then a review."""
    pool.flag(address, reason)
    probation.review(address)


def checks(address: str, result: str) -> float:
    return REGISTRY.get_sample_value("gridrl_trainer_node_checks_total",
                                     {"node": address, "result": result}) or 0.0


def test_flagged_node_gets_no_group_until_it_passes_a_fresh_check(setup) -> None:
    [node], pool, probation, measured, console, _ = setup(kl=0.5)
    flag(pool, probation, node.address, "mismatched: KL 5e-01")
    state = pool.node(node.address)
    assert state.flagged and not state.in_rotation
    wait_for(lambda: checks(node.address, "failed") >= 2, 10, "two failed reviews")
    assert pool.node(node.address).flagged  # still benched
    # every review re-pushed the adapter and sampled one check group, nothing else
    assert len(node.pushes) >= 3 and {p["version"] for p in node.pushes} == {1}
    assert {r.request_id for r in node.generates} == {"check"}
    assert any("stays benched: failed its fresh check: KL(behaviour || trainer) 5.00e-01"
               in line for line in console.lines)
    # a batch meanwhile waits: the only node is benched
    assert not any(r.passed for r in console.reviews)
    measured["kl"] = 1e-7  # the node is fixed
    groups = pool.generate_groups([[1, 2]], SamplingConfig(max_tokens=4, temperature=1.0),
                                  group_size=2)
    assert {s.policy_version for s in groups[0].samples} == {1}
    assert pool.node(node.address).in_rotation
    readmitted = [r for r in console.reviews if r.passed]
    assert [r.node for r in readmitted] == [node.address]
    assert "(KL 1.00e-07 nats/token at policy version 1)" in readmitted[0].message
    assert pool.flags() == {} and list(pool.flagged_ever()) == [node.address]
    assert checks(node.address, "passed") == 1
    assert any("passed a fresh mismatch check" in line for line in console.lines)
    assert probation.pending() == []


def test_a_check_waits_for_the_trainers_version_to_be_pushed(setup) -> None:
    """Waiting for the push is not a failed check: the check follows within ``poll_s``, not
    after the failed-check back-off (here 60 s)."""
    [node], pool, probation, measured, _, current = setup(version=2, interval_s=60.0)
    pushes = len(node.pushes)
    flag(pool, probation, node.address, "stale: ...")
    wait_for(lambda: probation.pending() == [node.address], 5, "the node under review")
    wait_for(lambda: probation.last_review(node.address), 5, "the first review")
    # the trainer is at version 2, the newest push is 1: nothing to check against yet
    assert probation.last_review(node.address) == (
        "waits for the trainer's policy version 2 to be pushed (newest pushed: 1)")
    assert measured["calls"] == 0 and len(node.pushes) == pushes
    current["version"] = 1
    wait_for(lambda: pool.node(node.address).in_rotation, 10, "the node readmitted")
    assert measured["calls"] == 1 and len(node.pushes) == pushes + 1


def test_a_check_group_of_another_version_fails(setup) -> None:
    [node], pool, probation, measured, _, _ = setup()
    node.serve_after_push = ("", 0)  # answers the push, keeps sampling the base model
    flag(pool, probation, node.address, "stale: ...")
    wait_for(lambda: checks(node.address, "failed") >= 1, 10, "a failed review")
    assert pool.node(node.address).flagged and measured["calls"] >= 1


def test_fresh_mismatch_kl_on_the_tiny_llama(tiny_llama_dir) -> None:
    """Through the trainer backend's ``logprobs`` (the loop never touches the model)."""
    import threading

    from gridrl.trainer.backends.base import create_backend
    from gridrl.trainer.config import TrainConfig
    from gridrl.trainer.envs.episode import TurnRequest
    from gridrl.trainer.local import LocalRollout
    from gridrl.trainer.rollouts import group_seed

    backend = create_backend(TrainConfig(
        model=str(tiny_llama_dir), lora_rank=4, lora_alpha=8, max_tokens=6, temperature=0.8,
        top_k=5, seed=0, device="cpu", dtype="float32", rollout=["local"],
        run_dir="unused").finalize())
    try:
        prompt = [5, 6, 7, 8]
        [samples] = LocalRollout(backend, lambda: 0).sample_turns(
            [TurnRequest(tuple(prompt), group_seed(1, 0), 4, 6)],
            SamplingConfig(max_tokens=6, temperature=0.8, top_k=5))
        lock = threading.Lock()
        assert fresh_mismatch_kl(backend, prompt, samples, lock=lock) < 1e-6  # same weights
        assert not lock.locked()
        for s in samples:  # another policy's logprobs: k3 = e^0.5 - 1 - 0.5 per token
            s.logprobs = [lp - 0.5 for lp in s.logprobs]
        assert fresh_mismatch_kl(backend, prompt, samples) == pytest.approx(
            math.exp(0.5) - 1.5, rel=1e-4)
        for s in samples:
            s.token_ids, s.logprobs = [], []
        assert fresh_mismatch_kl(backend, prompt, samples) is None
    finally:
        backend.close()
