"""The engine's streaming route (the OpenAI endpoint's side of it): token sinks get each decode
step of their own request, in batches shared with other requests and across a split request;
base-model requests decode without the serving adapter and never share a batch with it;
abandoned requests are dropped, and a batch of abandoned requests stops; a failing sink does
not fail the batch."""

from __future__ import annotations

import threading
from collections import defaultdict
from pathlib import Path

import pytest
from engine_helpers import PROMPT
from rollout_helpers import GatedBackend
from waiting import wait_for

from gridrl.common.errors import Kind, StatusError
from gridrl.engine.contract import SamplingConfig
from gridrl.rollout.jobs import BASE_MODEL, GenerateJob, ServingAdapter
from gridrl.rollout.scheduler import BatchScheduler


class Sink:
    """Records what the engine sends; ``abandon`` flips ``abandoned()``."""

    def __init__(self) -> None:
        self.adapters: list[ServingAdapter] = []
        self.tokens: dict[int, list[int]] = defaultdict(list)
        self.logprobs: dict[int, list[float]] = defaultdict(list)
        self.steps = 0
        self.gone = threading.Event()

    def started(self, adapter: ServingAdapter) -> None:
        self.adapters.append(adapter)

    def on_tokens(self, samples, token_ids, logprobs) -> None:
        self.steps += 1
        for i, token, logprob in zip(samples, token_ids, logprobs, strict=True):
            self.tokens[i].append(token)
            self.logprobs[i].append(logprob)

    def abandoned(self) -> bool:
        return self.gone.is_set()


def _job(n: int = 2, seed: int = 1, max_tokens: int = 6) -> GenerateJob:
    return GenerateJob(prompt_ids=PROMPT, sampling=SamplingConfig(max_tokens=max_tokens,
                                                                  temperature=1.0),
                       n=n, seed=seed)


def test_sinks_get_their_own_tokens_step_by_step(tiny_backend) -> None:
    backend = GatedBackend(tiny_backend)
    engine = BatchScheduler(backend, capacity=3, batch_window_s=0.0).start()
    try:
        blocker = engine.submit(_job(n=1, seed=9))
        wait_for(lambda: backend.entered == 1)
        sinks = [Sink(), Sink()]
        futures = [engine.submit(_job(n=2, seed=1), sink=sinks[0]),
                   engine.submit(_job(n=3, seed=2), sink=sinks[1]),
                   engine.submit(_job(n=1, seed=3))]  # a gRPC-like request without a sink
        backend.gate.set()
        outcomes = [f.result(60) for f in futures]
        blocker.result(60)
    finally:
        backend.gate.set()
        engine.close()
    assert len(outcomes[1].batches) == 2  # split: 1 sample with the first request, then 2
    for sink, outcome in zip(sinks, outcomes[:2], strict=True):
        assert sink.adapters == [BASE_MODEL]  # once, at its first batch
        assert dict(sink.tokens) == {i: r.token_ids for i, r in enumerate(outcome.samples)}
        assert dict(sink.logprobs) == {i: r.logprobs for i, r in enumerate(outcome.samples)}
        assert sink.steps >= max(len(r.token_ids) for r in outcome.samples)


def test_a_failing_sink_does_not_fail_the_batch(tiny_backend) -> None:
    class Broken(Sink):
        def on_tokens(self, samples, token_ids, logprobs) -> None:
            raise RuntimeError("boom")

    engine = BatchScheduler(tiny_backend, batch_window_s=0.05).start()
    try:
        broken = engine.submit(_job(seed=4), sink=Broken())
        fine = engine.submit(_job(seed=5), sink=Sink())
        assert len(broken.result(60).samples) == 2 and len(fine.result(60).samples) == 2
    finally:
        engine.close()


def test_base_model_requests_skip_the_adapter_in_the_same_batch(
        tiny_llama_dir: Path, tiny_adapters) -> None:
    from gridrl.engine.backends.torch.backend import TorchBackend

    backend = GatedBackend(TorchBackend.from_pretrained(tiny_llama_dir))
    engine = BatchScheduler(backend, capacity=16, batch_window_s=0.0).start()
    try:
        backend.gate.set()
        base_alone = engine.generate(_job(seed=7), timeout=60)
        handle = backend.load_adapter(tiny_adapters["a"], "a")
        adapter = ServingAdapter("run-a", 2, handle)
        engine.call_between_batches(lambda: engine.set_serving(adapter))
        tuned_alone = engine.generate(_job(seed=7), timeout=60)
        assert [s.token_ids for s in tuned_alone.samples] != \
            [s.token_ids for s in base_alone.samples]
        backend.gate.clear()
        blocker = engine.submit(_job(n=1, seed=9))
        wait_for(lambda: backend.entered == 3)
        sink = Sink()
        tuned = engine.submit(_job(seed=7))
        base = engine.submit(_job(seed=7), sink=sink, base_model=True)
        tuned_too = engine.submit(_job(seed=8))
        backend.gate.set()
        outcomes = [f.result(60) for f in (blocker, tuned, base, tuned_too)]
    finally:
        backend.gate.set()
        engine.close()
    _, tuned_out, base_out, tuned_too_out = outcomes
    assert base_out.adapter == BASE_MODEL and sink.adapters == [BASE_MODEL]
    assert tuned_out.adapter is adapter and tuned_too_out.adapter is adapter
    assert [s.token_ids for s in base_out.samples] == [s.token_ids for s in base_alone.samples]
    assert [s.token_ids for s in tuned_out.samples] == \
        [s.token_ids for s in tuned_alone.samples]
    # one batch holds rows of the adapter and of the base model (issue 46: multi-adapter
    # batches), each decoded as it is alone
    assert tuned_out.batches == base_out.batches == tuned_too_out.batches
    record = {r.index: r for r in engine.recent_batches()}[base_out.batches[0]]
    assert dict(record.runs) == {"run-a": 4, "": 2}


class LeavesAfterFirstStep(Sink):
    """A caller that goes away once it has the first token."""

    def on_tokens(self, samples, token_ids, logprobs) -> None:
        super().on_tokens(samples, token_ids, logprobs)
        self.gone.set()


@pytest.fixture
def gated_engine(tiny_llama_dir: Path):
    from gridrl.engine.backends.torch.backend import TorchBackend

    backend = GatedBackend(TorchBackend.from_pretrained(tiny_llama_dir))
    engine = BatchScheduler(backend, capacity=2, batch_window_s=0.0).start()
    yield backend, engine
    backend.gate.set()
    engine.close()


def _cancelled(future) -> bool:
    with pytest.raises(StatusError) as e:
        future.result(60)
    return e.value.kind is Kind.CANCELLED


def test_a_batch_whose_requests_all_left_stops(gated_engine) -> None:
    backend, engine = gated_engine
    backend.gate.set()
    sink = LeavesAfterFirstStep()
    assert _cancelled(engine.submit(_job(n=2, max_tokens=300), sink=sink))
    assert sink.steps == 1  # stopped before the second step, not after 300
    assert engine.recent_batches() == []  # never decoded to the end
    assert len(engine.generate(_job(n=1), timeout=60).samples) == 1  # the engine goes on


def test_abandoned_requests_are_dropped_from_the_queue(gated_engine) -> None:
    backend, engine = gated_engine
    blocker = engine.submit(_job(n=1, seed=9))
    wait_for(lambda: backend.entered == 1)
    plain = engine.submit(_job(n=1, seed=1))  # no sink: the batch decodes to the end
    split_sink, queued_sink = LeavesAfterFirstStep(), Sink()
    split = engine.submit(_job(n=3, seed=2), sink=split_sink)  # 1 sample fits, 2 wait
    queued = engine.submit(_job(n=1, seed=3), sink=queued_sink)
    queued_sink.gone.set()  # leaves while queued
    backend.gate.set()
    assert len(blocker.result(60).samples) == 1 and len(plain.result(60).samples) == 1
    assert _cancelled(split) and _cancelled(queued)
    assert len(engine.recent_batches()) == 2  # the blocker's, then plain + split's sample 0
    assert set(split_sink.tokens) == {0} and queued_sink.adapters == []
