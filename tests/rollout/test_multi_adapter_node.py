"""Several runs' adapters on one node (issue 46 item 1): a push of run A's next version never
interrupts run B's rows (on the torch lean forward A's rows stop between two decode steps and
decode again, whole, on the new version, while B's go on); resident adapters are bounded
(--max-resident-adapters, LRU; --adapter-memory-mb refuses what cannot fit with
RESOURCE_EXHAUSTED naming the limit). The batch is held at a decode step by the test (an
event), so nothing depends on speed."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import pytest
from rollout_helpers import GatedBackend, push_dir, rpc_error
from waiting import wait_for

from gridrl.common.errors import Kind, StatusError
from gridrl.engine.contract import SamplingConfig
from gridrl.rollout.jobs import GenerateJob, ServingAdapter
from gridrl.rollout.scheduler import BatchScheduler
from gridrl.v1 import common_pb2, rollout_pb2

PROMPT = [5, 11, 12, 13, 6]


class HeldBackend(GatedBackend):
    """The real backend; the first batch's observer holds at decode step ``hold_at`` until
    ``release()`` says so (the scheduler's own observer is still asked between steps)."""

    def __init__(self, inner: Any, hold_at: int = 3) -> None:
        super().__init__(inner)
        self.gate.set()
        self.hold_at = hold_at
        self.held = threading.Event()
        self.release: Any = lambda: True
        self.calls = 0

    @property
    def stops_rows(self) -> bool:  # type: ignore[override]
        return self.inner.stops_rows

    def generate(self, batch, adapter, observer=None):
        return self.generate_mixed(batch, [adapter] * len(batch), observer)

    def generate_mixed(self, batch, adapters, observer=None):
        self.calls += 1
        watched = _Held(self, observer) if self.calls == 1 else observer
        return self.inner.generate_mixed(batch, adapters, watched)


class _Held:
    def __init__(self, backend: HeldBackend, inner: Any) -> None:
        self.backend, self.inner, self.steps = backend, inner, 0

    def on_tokens(self, rows, token_ids, logprobs, top=None):
        self.inner.on_tokens(rows, token_ids, logprobs, top)
        self.steps += 1
        if self.steps == self.backend.hold_at:
            self.backend.held.set()
            wait_for(self.backend.release, 60)

    def interrupted(self):
        return self.inner.interrupted()

    def rows_to_stop(self):
        return self.inner.rows_to_stop()


def _job(adapter: str, seed: int) -> GenerateJob:
    return GenerateJob(prompt_ids=PROMPT, n=2, seed=seed, adapter=adapter,
                       sampling=SamplingConfig(max_tokens=12, temperature=1.0))


def _backend_and_adapters(forward: str, tiny_llama_dir, tiny_adapters, tmp_path
                          ) -> tuple[Any, dict[str, Any]]:
    """The backend of ``forward`` ("lean", "transformers": torch; "mlx") and two adapters of
    its format ("a", "b")."""
    if forward == "mlx":
        pytest.importorskip("mlx_lm")
        from engine_helpers import write_mlx_adapter

        from gridrl.engine.backends.mlx.backend import MlxBackend

        return MlxBackend.from_pretrained(tiny_llama_dir), {
            "a": write_mlx_adapter(tmp_path / "a", tiny_llama_dir, rank=4, scale=2.0,
                                   num_layers=-1, seed=1,
                                   keys=["self_attn.q_proj", "mlp.down_proj"]),
            "b": write_mlx_adapter(tmp_path / "b", tiny_llama_dir, rank=8, scale=1.0,
                                   num_layers=-1, seed=2,
                                   keys=["self_attn.q_proj", "self_attn.v_proj"])}
    from gridrl.engine.backends.torch.backend import TorchBackend

    return TorchBackend.from_pretrained(tiny_llama_dir, lean=forward == "lean"), tiny_adapters


def _unloaded(backend: Any, handle: Any) -> bool:
    loaded = getattr(backend, "_loaded", None)
    return handle.key not in loaded if loaded is not None else not handle.loaded


@pytest.mark.parametrize("forward", ["lean", "transformers",
                                     pytest.param("mlx", marks=pytest.mark.mlx)])
def test_a_push_of_run_a_never_interrupts_run_b(tiny_llama_dir, tiny_adapters, tmp_path,
                                                forward: str) -> None:
    inner, tiny_adapters = _backend_and_adapters(forward, tiny_llama_dir, tiny_adapters,
                                                 tmp_path)
    backend = HeldBackend(inner)
    scheduler = BatchScheduler(backend, capacity=8, batch_window_s=0.0)
    handles = {"A": inner.load_adapter(tiny_adapters["a"], "A-v1"),
               "B": inner.load_adapter(tiny_adapters["b"], "B-v1")}
    for name, handle in handles.items():
        scheduler.set_serving(ServingAdapter(name, 1, handle), serve=False)
    run_a, run_b = scheduler.submit(_job("A", 1)), scheduler.submit(_job("B", 2))
    backend.release = scheduler.preempt_pending  # held until the push waits
    pool = concurrent.futures.ThreadPoolExecutor(1)
    new_a: dict[str, Any] = {}

    def push_a_v2() -> None:  # what a push does on the scheduler thread
        new_a["handle"] = backend.load_adapter(tiny_adapters["b"], "A-v2")
        scheduler.set_serving(ServingAdapter("A", 2, new_a["handle"]), serve=False)

    try:
        scheduler.start()
        assert backend.held.wait(60)
        pushed = pool.submit(scheduler.call_between_batches, push_a_v2, 60, True, "A")
        b_out, a_out = run_b.result(60), run_a.result(60)
        pushed.result(60)
        first, *later = scheduler.recent_batches()
        # B's rows were never interrupted: they finished in the first batch, on B v1
        assert b_out.batches == [first.index] and not first.interrupted
        assert (b_out.adapter.name, b_out.adapter.version) == ("B", 1)
        if forward != "transformers":  # A's rows, running when v2 came, stopped between steps
            assert backend.stops_rows and first.cut == 2  # and decoded again, whole, on v2
            assert a_out.batches == [later[0].index]
            assert (a_out.adapter.name, a_out.adapter.version) == ("A", 2)
        else:  # no single row stops there: the push waited for the end of the batch, and
            # A's rows finished on the version they started with
            assert not backend.stops_rows and first.cut == 0
            assert a_out.batches == [first.index]
            assert (a_out.adapter.name, a_out.adapter.version) == ("A", 1)
        assert dict(first.runs) == {"A": 2, "B": 2}
        # each equals what it gets alone on its version (A: v2 on the lean forward)
        again_b = scheduler.generate(_job("B", 2), timeout=60)
        assert [s.token_ids for s in b_out.samples] == [s.token_ids for s in again_b.samples]
        if forward != "transformers":
            again_a = scheduler.generate(_job("A", 1), timeout=60)
            assert [s.token_ids for s in a_out.samples] == \
                [s.token_ids for s in again_a.samples]
        assert _unloaded(inner, handles["A"])  # v1 unloaded once no batch used it
    finally:
        backend.release = lambda: True
        scheduler.close()
        pool.shutdown()


@pytest.mark.parametrize("forward", ["lean", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_resident_adapters_are_bounded_least_recently_used_first(tiny_llama_dir, tmp_path,
                                                                 tiny_adapters, forward) -> None:
    backend, tiny_adapters = _backend_and_adapters(forward, tiny_llama_dir, tiny_adapters,
                                                   tmp_path)
    scheduler = BatchScheduler(backend, capacity=8, batch_window_s=0.0, max_resident=2,
                               max_adapter_bytes=1000)
    try:
        scheduler.start()
        loaded = {}

        def put(name: str, nbytes: int = 100) -> None:
            def apply() -> None:
                loaded[name] = backend.load_adapter(tiny_adapters["a"], f"{name}-key")
                scheduler.set_serving(ServingAdapter(name, 1, loaded[name], nbytes),
                                      serve=False)
            scheduler.call_between_batches(apply, timeout=60)

        put("x")
        put("y")
        scheduler.generate(_job("x", 1), timeout=60)  # x used after y: y is the LRU
        put("z")
        assert [a.name for a in scheduler.resident()] == ["x", "z"]
        assert _unloaded(backend, loaded["y"])
        with pytest.raises(StatusError) as e:
            scheduler.submit(_job("y", 1))
        assert e.value.kind == Kind.NOT_FOUND
        put("big", 950)  # fits alone, not beside the others: they go
        assert [a.name for a in scheduler.resident()] == ["big"]
        with pytest.raises(StatusError) as e:
            scheduler.check_fits("huge", 1001)
        assert e.value.kind == Kind.RESOURCE_EXHAUSTED and "--adapter-memory-mb" in str(e.value)
    finally:
        scheduler.close()


def test_node_serves_runs_by_name_and_refuses_what_does_not_fit(live_node, tiny_backend,
                                                               tiny_adapters) -> None:
    """Through gRPC: two pushed runs, each Generate naming its run gets that run's adapter;
    a push larger than --adapter-memory-mb is RESOURCE_EXHAUSTED naming the flag."""
    node = live_node(tiny_backend, batch_window_s=0.0)
    push_dir(node.stub, tiny_adapters["a"], "run-a", 1, timeout=60)
    push_dir(node.stub, tiny_adapters["b"], "run-b", 1, timeout=60)  # serves by default now
    for run in ("run-a", "run-b", ""):
        reply = node.stub.Generate(rollout_pb2.GenerateRequest(
            prompt_token_ids=PROMPT, adapter_name=run, share_weight=2.0,
            sampling=common_pb2.SamplingParams(max_tokens=4, n=2, seed=3)), timeout=60)
        assert {s.adapter_name for s in reply.samples} == {run or "run-b"}
    # a run that has not pushed yet asks for the base model, whatever serves (run-b here)
    reply = node.stub.Generate(rollout_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, base_model=True,
        sampling=common_pb2.SamplingParams(max_tokens=4, n=2, seed=3)), timeout=60)
    assert {(s.adapter_name, s.adapter_version) for s in reply.samples} == {("", 0)}
    err = rpc_error(lambda: node.stub.Generate(rollout_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, base_model=True, adapter_name="run-a",
        sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=60))
    assert err.code().name == "INVALID_ARGUMENT" and "base_model" in err.details()
    info = node.stub.GetNodeInfo(rollout_pb2.GetNodeInfoRequest(), timeout=30).info
    assert [(a.name, a.version) for a in info.resident_adapters] == [("run-a", 1),
                                                                      ("run-b", 1)]
    shares = {s.run: s.share for s in info.run_shares}
    assert set(shares) == {"run-a", "run-b", ""} and sum(shares.values()) == pytest.approx(1.0)
    # the master's dashboard row shows them (fleet_view, from the node's heartbeat/info)
    from gridrl.master.fleet_view import fleet_rows
    from gridrl.v1 import registry_pb2

    record = registry_pb2.NodeRecord(node_id="n1", info=info)
    row = fleet_rows([record], [], {}, 0.0)[0]
    assert row["run_shares"] == shares and row["resident"] == ["run-a v1", "run-b v1"]
    err = rpc_error(lambda: node.stub.Generate(rollout_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, adapter_name="run-c",
        sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=60))
    assert err.code().name == "NOT_FOUND" and "run-c" in err.details()
    err = rpc_error(lambda: node.stub.Generate(rollout_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, share_weight=-1,
        sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=60))
    assert err.code().name == "INVALID_ARGUMENT" and "share_weight" in err.details()
    small = live_node(tiny_backend, batch_window_s=0.0, adapter_memory_mb=0.001)
    err = rpc_error(lambda: push_dir(small.stub, tiny_adapters["a"], "run-a", 1, timeout=60))
    assert err.code().name == "RESOURCE_EXHAUSTED" and "--adapter-memory-mb" in err.details()
