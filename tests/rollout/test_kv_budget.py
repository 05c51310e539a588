"""A node that knows its memory (gridrl.rollout.kv_budget): how many KV-cache tokens fit, the
engine batching within them (same samples as unsplit), and a real node process with a small
--kv-memory-mb that advertises its capacity and refuses what cannot fit with
RESOURCE_EXHAUSTED instead of growing until it is killed."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from engine_helpers import PROMPT

from gridrl.common.errors import Kind, StatusError
from gridrl.common.rpc.channel import dial
from gridrl.engine.contract import SamplingConfig
from gridrl.rollout.jobs import GenerateJob
from gridrl.rollout.kv_budget import KvBudget, available_memory_bytes
from gridrl.rollout.scheduler import BatchScheduler
from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


def test_the_budget_in_tokens() -> None:
    # 1 MB for 1000-byte tokens, 4500-byte sequences (5 tokens' worth)
    b = KvBudget.for_backend(1000, 4500, 1.0)
    assert (b.tokens, b.overhead_tokens, b.limit) == (1000, 5, "--kv-memory-mb 1")
    assert b.batch_tokens(3, 100, 40) == 3 * 145
    assert b.rows_that_fit(100, 40) == 6  # 1000 // 145
    b.check(900, 95)  # 1000 exactly: fits
    with pytest.raises(StatusError) as e:
        b.check(900, 96)
    assert e.value.kind == Kind.RESOURCE_EXHAUSTED
    assert e.value.message == (
        "one sequence needs 1001 KV-cache tokens (900 prompt + max_tokens 96 + 5 for its "
        "sampling buffers); this node holds 1000 (--kv-memory-mb 1): shorten the request or "
        "use a node with more memory")
    # default: half of what is available
    half = KvBudget.for_backend(1000, 0, 0.0, available=8_000_000)
    assert half.tokens == 4000 and half.limit.startswith("half of the 8 MB available")
    # a backend that manages its own memory (vLLM) reports no per-token cost: not limited
    free = KvBudget.for_backend(0, 0, 1.0)
    assert free.tokens == 0 and free.rows_that_fit(10**6, 10**6) >= 1 << 30
    free.check(10**6, 10**6)


def test_available_memory_is_the_smaller_of_the_machine_and_the_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:    2000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert available_memory_bytes(meminfo, cgroup) == 2000 * 1024  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")
    assert available_memory_bytes(meminfo, cgroup) == 2000 * 1024
    (cgroup / "memory.max").write_text("1500000\n")
    (cgroup / "memory.current").write_text("1000000\n")
    assert available_memory_bytes(meminfo, cgroup) == 500000
    assert available_memory_bytes(tmp_path / "none", tmp_path / "none") is None
    assert (available_memory_bytes() or 0) > 0  # this machine's


@pytest.mark.parametrize("tiny_backend", ["lean"], indirect=True)
def test_the_engine_batches_within_the_budget(tiny_backend) -> None:
    """A group larger than the budget holds is decoded a few sequences at a time, with the
    samples it would have had in one batch; a sequence that cannot fit alone is refused."""
    kv, seq = tiny_backend.kv_bytes_per_token, tiny_backend.sequence_bytes
    assert kv == 2 * 2 * 2 * 16 * 4 and seq == 24 * 512  # 2 layers, 2 kv heads of 16, fp32
    per_row = len(PROMPT) + 6 + seq // kv
    budget = KvBudget(tokens=3 * per_row + 1, overhead_tokens=seq // kv, limit="test")
    small = BatchScheduler(tiny_backend, capacity=64, batch_window_s=0.0, kv_budget=budget).start()
    big = BatchScheduler(tiny_backend, capacity=64, batch_window_s=0.0).start()
    job = GenerateJob(prompt_ids=PROMPT, sampling=SamplingConfig(max_tokens=6), n=8, seed=4)
    try:
        split = small.generate(job, timeout=60)
        whole = big.generate(job, timeout=60)
        with pytest.raises(StatusError) as e:
            small.submit(GenerateJob(prompt_ids=PROMPT, n=1, sampling=SamplingConfig(
                max_tokens=budget.tokens)))
        assert e.value.kind == Kind.RESOURCE_EXHAUSTED and "(test)" in e.value.message
    finally:
        small.close()
        big.close()
    assert [r.sequences for r in small.recent_batches()] == [3, 3, 2]
    assert [s.token_ids for s in split.samples] == [s.token_ids for s in whole.samples]


def test_a_node_with_little_memory_refuses_what_cannot_fit(service_factory, tiny_llama_dir
                                                           ) -> None:
    node = service_factory(["gridrl-rollout", "serve", "--model", str(tiny_llama_dir),
                            "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--threads", "1",
                            "--kv-memory-mb", "0.05"], "rollout")
    stub = rollout_pb2_grpc.RolloutServiceStub(dial(node.address))
    info = stub.GetNodeInfo(rollout_pb2.GetNodeInfoRequest(), timeout=30).info
    assert info.kv_cache_tokens == 50_000 // 512 and info.sequence_overhead_tokens == 24
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(rollout_pb2.GenerateRequest(prompt_token_ids=PROMPT, sampling=(
            common_pb2.SamplingParams(n=1, max_tokens=70, temperature=1.0))), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.details() == (
        "one sequence needs 99 KV-cache tokens (5 prompt + max_tokens 70 + 24 for its sampling "
        "buffers); this node holds 97 (--kv-memory-mb 0.05): shorten the request or use a node "
        "with more memory")
    # a group of 8 that fits two sequences at a time: decoded, and the node still serves
    reply = stub.Generate(rollout_pb2.GenerateRequest(prompt_token_ids=PROMPT, sampling=(
        common_pb2.SamplingParams(n=8, max_tokens=12, temperature=1.0, seed=1))), timeout=60)
    assert len(reply.samples) == 8
    assert "KV cache: 97 tokens (--kv-memory-mb 0.05), 24 more a sequence" in node.log()
