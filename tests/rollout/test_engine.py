"""The engine over a real tiny-llama backend: concurrent requests share batches, the queue is
bounded, large n is split without changing samples, adapter swaps wait for in-flight requests,
cancelled and closing requests."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from engine_helpers import PROMPT
from rollout_helpers import GatedBackend
from waiting import wait_for

from gridrl.common.errors import Kind, StatusError
from gridrl.engine.contract import SamplingConfig
from gridrl.rollout.jobs import GenerateJob, ServingAdapter
from gridrl.rollout.scheduler import BatchScheduler

T1 = SamplingConfig(max_tokens=6, temperature=1.0)


def _job(n: int = 2, seed: int = 1, prompt: list[int] | None = None, **kw) -> GenerateJob:
    return GenerateJob(prompt_ids=prompt or PROMPT, sampling=SamplingConfig(**{
        "max_tokens": 6, "temperature": 1.0, **kw}), n=n, seed=seed)


@pytest.fixture
def gated(tiny_backend):
    backend = GatedBackend(tiny_backend)
    engine = BatchScheduler(backend, capacity=16, max_queue=3, batch_window_s=0.0).start()
    yield backend, engine
    backend.gate.set()
    engine.close()


def test_concurrent_requests_share_one_batch(gated) -> None:
    backend, engine = gated
    blocker = engine.submit(_job(n=1, seed=99))
    wait_for(lambda: backend.entered == 1)  # the blocker is decoding, the gate holds it
    a = engine.submit(_job(n=3, seed=1))
    b = engine.submit(_job(n=2, seed=2, prompt=[10, 11, 12], temperature=0.5, top_k=5))
    backend.gate.set()
    outcome_a, outcome_b = a.result(30), b.result(30)
    blocker.result(30)
    assert outcome_a.batches == outcome_b.batches  # decoded together
    record = next(r for r in engine.recent_batches() if r.index == outcome_a.batches[0])
    assert record.sequences == 5 and len(record.requests) == 2
    assert len(outcome_a.samples) == 3 and len(outcome_b.samples) == 2
    # the same jobs alone give the same samples (seeds are per sequence)
    alone = engine.generate(_job(n=3, seed=1), timeout=30)
    assert [s.token_ids for s in alone.samples] == [s.token_ids for s in outcome_a.samples]
    assert len({tuple(s.token_ids) for s in alone.samples}) > 1  # samples differ from each other


def test_queue_bound_is_resource_exhausted(gated) -> None:
    backend, engine = gated
    running = engine.submit(_job(n=1))
    wait_for(lambda: backend.entered == 1)
    waiting = [engine.submit(_job(n=1, seed=i)) for i in range(3)]
    assert engine.queue_depth == 3
    with pytest.raises(StatusError) as e:
        engine.submit(_job(n=1))
    assert e.value.kind is Kind.RESOURCE_EXHAUSTED
    assert "queue full" in e.value.message
    backend.gate.set()
    for f in [running, *waiting]:
        assert len(f.result(30).samples) == 1
    assert engine.queue_depth == 0


def test_large_n_is_split_across_batches_with_the_same_samples(tiny_backend) -> None:
    small = BatchScheduler(tiny_backend, capacity=4, batch_window_s=0.0).start()
    big = BatchScheduler(tiny_backend, capacity=64, batch_window_s=0.0).start()
    try:
        split = small.generate(_job(n=10, seed=5), timeout=30)
        whole = big.generate(_job(n=10, seed=5), timeout=30)
    finally:
        small.close()
        big.close()
    assert len(split.batches) == 3 and len(whole.batches) == 1
    assert [s.token_ids for s in split.samples] == [s.token_ids for s in whole.samples]
    assert [r.sequences for r in small.recent_batches()] == [4, 4, 2]


def test_swap_waits_for_requests_in_flight(gated) -> None:
    backend, engine = gated
    in_flight = engine.submit(_job(n=2))
    wait_for(lambda: backend.entered == 1)
    swapped = threading.Event()
    new = ServingAdapter(name="x", version=7, handle=None)

    def swap() -> None:
        engine.call_between_batches(lambda: engine.set_serving(new))
        swapped.set()

    thread = threading.Thread(target=swap)
    thread.start()
    assert not swapped.wait(0.3)  # the batch in flight holds the swap back
    later = engine.submit(_job(n=1))
    backend.gate.set()
    thread.join(30)
    assert in_flight.result(30).adapter.version == 0  # finished on what it started with
    assert later.result(30).adapter.version == 7  # the swap ran before the next request
    with pytest.raises(RuntimeError):
        engine.set_serving(new)  # only between batches


def test_split_request_keeps_its_adapter(tiny_backend) -> None:
    backend = GatedBackend(tiny_backend)
    engine = BatchScheduler(backend, capacity=2, batch_window_s=0.0).start()
    try:
        request = engine.submit(_job(n=5))
        wait_for(lambda: backend.entered == 1)
        swap = concurrent.futures.ThreadPoolExecutor(1).submit(
            engine.call_between_batches,
            lambda: engine.set_serving(ServingAdapter("x", 3, None)))
        backend.gate.set()
        outcome = request.result(30)
        swap.result(30)
        assert outcome.adapter.version == 0 and len(outcome.batches) == 3
        assert engine.serving.version == 3
    finally:
        backend.gate.set()
        engine.close()


def test_cancelled_while_queued_is_dropped(gated) -> None:
    backend, engine = gated
    running = engine.submit(_job(n=1))
    wait_for(lambda: backend.entered == 1)
    dropped = engine.submit(_job(n=4))
    assert dropped.cancel()
    backend.gate.set()
    running.result(30)
    kept = engine.generate(_job(n=1), timeout=30)
    assert sum(r.sequences for r in engine.recent_batches()) == 2
    assert kept.batches == [engine.recent_batches()[-1].index]


def test_close_fails_waiting_requests(tiny_backend) -> None:
    backend = GatedBackend(tiny_backend)
    engine = BatchScheduler(backend, capacity=1, batch_window_s=0.0).start()
    running = engine.submit(_job(n=1))
    wait_for(lambda: backend.entered == 1)
    waiting = engine.submit(_job(n=1))
    closer = threading.Thread(target=engine.close)
    closer.start()
    backend.gate.set()
    closer.join(30)
    assert len(running.result(30).samples) == 1  # the batch in flight finishes
    with pytest.raises(StatusError) as e:
        waiting.result(30)
    assert e.value.kind is Kind.UNAVAILABLE
    with pytest.raises(StatusError):
        engine.submit(_job(n=1))


def test_close_with_interrupt_stops_the_batch_in_flight(tiny_backend) -> None:
    """A node stopping: the batch in flight ends at its next decode step with UNAVAILABLE,
    the scheduler thread is joined, and the backend decodes again for a later engine."""
    backend = GatedBackend(tiny_backend)
    engine = BatchScheduler(backend, capacity=4, batch_window_s=0.0).start()
    running = engine.submit(_job(n=2))
    wait_for(lambda: backend.entered == 1)  # held at the gate: in flight
    assert engine.scheduler_alive
    engine.close(timeout=30, interrupt=True)  # the held batch goes on and stops at once
    with pytest.raises(StatusError) as e:
        running.result(0)
    assert e.value.kind is Kind.UNAVAILABLE and "shutting down" in e.value.message
    assert not engine.scheduler_alive
    assert engine.recent_batches() == []  # no batch completed
    again = BatchScheduler(tiny_backend, capacity=4, batch_window_s=0.0).start()
    try:
        assert len(again.generate(_job(n=2), timeout=30).samples) == 2
    finally:
        again.close()


def test_backend_failure_fails_only_its_batch(tiny_backend) -> None:
    engine = BatchScheduler(tiny_backend, capacity=8, batch_window_s=0.0).start()
    try:
        bad = GenerateJob(prompt_ids=[10**6], sampling=T1, n=1, seed=0)  # beyond the embedding
        with pytest.raises(StatusError) as e:
            engine.generate(bad, timeout=30)
        assert e.value.kind is Kind.INTERNAL
        assert len(engine.generate(_job(n=2), timeout=30).samples) == 2
    finally:
        engine.close()


def test_the_scheduler_thread_releases_its_framework_state_on_every_way_out(
        tiny_backend, monkeypatch) -> None:
    """The scheduler thread frees its per-thread framework state (MLX streams,
    gridrl.engine.threads) as it ends: after close, and when loading the model on it failed."""
    import gridrl.rollout.scheduler as engine_module
    import gridrl.rollout.server as server_module

    released: list[str] = []

    def record() -> None:
        released.append(threading.current_thread().name)

    monkeypatch.setattr(engine_module, "release_thread_state", record)
    monkeypatch.setattr(server_module, "release_thread_state", record)
    engine = BatchScheduler(tiny_backend, capacity=4, batch_window_s=0.0).start()
    assert len(engine.generate(_job(n=2), timeout=30).samples) == 2
    assert released == []
    engine.close(timeout=30)
    assert released == ["rollout-scheduler"]

    def failed_load():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        server_module.run_on_engine_thread(failed_load)
    assert released == ["rollout-scheduler"] * 2
