"""The fair share between runs on a node (issue 46 item 2): the pure logic
(``gridrl.rollout.fair_share``) without threads or clocks, then the scheduler with a greedy run
and a modest one (a backend held at a gate, so nothing depends on speed)."""

from __future__ import annotations

import math

import pytest
from rollout_helpers import GatedBackend
from waiting import wait_for

from gridrl.common.errors import Kind, StatusError
from gridrl.engine.contract import SamplingConfig
from gridrl.rollout.fair_share import FairShare, check_weight, within_share
from gridrl.rollout.jobs import GenerateJob, ServingAdapter
from gridrl.rollout.scheduler import BatchScheduler


def _simulate(fair: FairShare, queues: dict[str, int], weights: dict[str, float],
              picks: int, work: float = 1.0) -> list[str]:
    """Start ``picks`` requests from ``queues`` (run -> requests waiting, oldest run first)
    in the order the fair share gives; each charged ``work``."""
    order = []
    for _ in range(picks):
        waiting = [r for r, n in queues.items() if n > 0]
        run = fair.next_run(waiting)
        if run is None:
            break
        order.append(run)
        queues[run] -= 1
        fair.charge(run, work, weights.get(run, 1.0))
    return order


def test_a_greedy_run_cannot_starve_a_modest_one() -> None:
    fair = FairShare()
    fair.wake("greedy", [])
    fair.wake("modest", ["greedy"])
    order = _simulate(fair, {"greedy": 100, "modest": 3}, {}, 8)
    # the modest run's three requests start among the first six, not after the hundred
    assert order[:6].count("modest") == 3 and order[6:] == ["greedy", "greedy"]


def test_weights_set_the_shares() -> None:
    fair = FairShare()
    for run in ("a", "b"):
        fair.wake(run, ["a"])
    order = _simulate(fair, {"a": 100, "b": 100}, {"a": 3.0, "b": 1.0}, 40)
    assert order.count("a") == 30 and order.count("b") == 10
    assert fair.shares() == pytest.approx({"a": 0.75, "b": 0.25})


def test_idle_time_is_not_banked() -> None:
    fair = FairShare()
    fair.wake("a", [])
    _simulate(fair, {"a": 50}, {}, 50)  # a alone for a long time
    fair.wake("b", ["a"])  # b arrives: it starts at a's clock, not 50 turns behind it
    order = _simulate(fair, {"a": 50, "b": 50}, {}, 10)
    assert order.count("b") == 5
    fair.wake("a", ["b"])  # waking a run that waits already changes nothing
    assert fair.clocks["a"] >= fair.clocks["b"]


def test_weights_and_queue_shares() -> None:
    assert check_weight(0) == 1.0 and check_weight(2.5) == 2.5
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="share weight"):
            check_weight(bad)
    # a full queue of 10, 9 of them the greedy run's: the modest run is within its share
    waiting = {"greedy": 9, "modest": 1}
    assert within_share("modest", waiting, {}, 10)
    assert not within_share("greedy", waiting, {}, 10)
    assert within_share("new", waiting, {}, 10)
    assert not within_share("modest", waiting, {"greedy": 9.0}, 10)  # its share is 1 of 10


def _job(seed: int, adapter: str = "", n: int = 1, weight: float = 1.0) -> GenerateJob:
    return GenerateJob(prompt_ids=[5, 11, 12, 6], sampling=SamplingConfig(max_tokens=3),
                       n=n, seed=seed, adapter=adapter, share_weight=weight)


@pytest.fixture
def two_runs(tiny_llama_dir, tiny_adapters):
    """A scheduler (capacity 4, queue 6) on a gated lean backend with runs "greedy" (adapter
    a) and "modest" (adapter b) resident."""
    from gridrl.engine.backends.torch.backend import TorchBackend

    backend = GatedBackend(TorchBackend.from_pretrained(tiny_llama_dir))
    scheduler = BatchScheduler(backend, capacity=4, max_queue=6, batch_window_s=0.0)
    for name, key in (("greedy", "a"), ("modest", "b")):
        handle = backend.load_adapter(tiny_adapters[key], name)
        scheduler.set_serving(ServingAdapter(name, 1, handle), serve=False)
    scheduler.start()
    yield backend, scheduler
    backend.gate.set()
    scheduler.close()


def test_the_scheduler_starts_a_modest_run_before_the_greedy_runs_backlog(two_runs) -> None:
    backend, scheduler = two_runs
    blocker = scheduler.submit(_job(0, "greedy"))
    wait_for(lambda: backend.entered == 1)  # a batch in flight, held at the gate
    greedy = [scheduler.submit(_job(1 + i, "greedy")) for i in range(6)]  # the queue is full
    # the greedy run is at its share of the full queue: refused; the modest run is not
    with pytest.raises(StatusError) as refused:
        scheduler.submit(_job(50, "greedy"))
    assert refused.value.kind == Kind.RESOURCE_EXHAUSTED and "'greedy'" in str(refused.value)
    modest = [scheduler.submit(_job(100 + i, "modest")) for i in range(2)]
    backend.gate.set()
    outcomes = [f.result(60) for f in (blocker, *greedy, *modest)]
    first_after = outcomes[0].batches[0] + 1
    # both modest requests are in the first batch after the blocker, with greedy ones
    assert [o.batches[0] for o in outcomes[-2:]] == [first_after, first_after]
    batch = {r.index: r for r in scheduler.recent_batches()}[first_after]
    assert dict(batch.runs) == {"greedy": 2, "modest": 2}
    assert all(s.adapter.name == "modest" for s in outcomes[-2:])
    assert set(scheduler.shares()) == {"greedy", "modest"}


def test_a_request_for_an_adapter_not_resident_is_not_found(two_runs) -> None:
    backend, scheduler = two_runs
    backend.gate.set()
    with pytest.raises(StatusError) as e:
        scheduler.submit(_job(0, "nobody"))
    assert e.value.kind == Kind.NOT_FOUND and "'nobody'" in str(e.value)
    assert "--max-resident-adapters" in str(e.value)
    with pytest.raises(StatusError) as e:
        scheduler.submit(_job(0, "modest", weight=-1.0))
    assert e.value.kind == Kind.INVALID_ARGUMENT and "share_weight" in str(e.value)
