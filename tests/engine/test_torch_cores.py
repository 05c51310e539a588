"""A node that shares its cores (backends/torch/cores.py): the thread policy as numbers, the
/proc/stat reading, the governor's windows (only time spent decoding counts), and the torch
backend decoding under it."""

from __future__ import annotations

from pathlib import Path

import pytest

from gridrl.engine.backends.torch.cores import (
    CpuTimes,
    ThreadGovernor,
    others_busy_cores,
    read_cpu_times,
    threads_for,
)


@pytest.mark.parametrize("cores,others,limit,want", [
    (2, 0.0, 0, 2),    # quiet
    (2, 0.3, 0, 2),    # a light neighbour: still worth the thread
    (2, 0.67, 0, 1),   # one busy loop beside our 2 threads gets its fair share, 2/3 of a core
    (2, 1.0, 0, 1),    # ... and a whole one beside our single thread: stable
    (2, 2.0, 0, 1),    # never fewer than one
    (16, 3.2, 0, 13),
    (16, 0.0, 4, 4),   # --threads-like limit
])
def test_threads_follow_the_cores_others_leave(cores, others, limit, want) -> None:
    assert threads_for(cores, others, limit) == want


def test_others_busy_cores_is_busy_time_minus_our_own_over_wall_time() -> None:
    before = CpuTimes(wall_s=10.0, busy_s=100.0, own_s=40.0)
    after = CpuTimes(wall_s=12.0, busy_s=103.5, own_s=42.0)  # 3.5 CPU-s busy, 2 ours
    assert others_busy_cores(before, after) == pytest.approx(0.75)
    assert others_busy_cores(after, after) == 0.0
    # our CPU time can run ahead of /proc/stat's 10 ms ticks: never below zero
    assert others_busy_cores(before, CpuTimes(11.0, 100.0, 41.0)) == 0.0


def test_the_reading_counts_only_the_allowed_cores_and_steal(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    #             user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  900 0 0 900 0 0 0 0 0 0\n"
                    "cpu0 100 10 20 500 7 3 2 5 0 0\n"
                    "cpu1 800 0 0 100 0 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    reading = read_cpu_times([0], stat)
    assert reading is not None
    assert reading.busy_s == pytest.approx((100 + 10 + 20 + 3 + 2 + 5) / ticks)  # not idle/iowait
    assert read_cpu_times([0, 1], stat).busy_s == pytest.approx(940 / ticks)
    assert read_cpu_times([0], tmp_path / "missing") is None
    real = read_cpu_times()
    assert real is not None and real.busy_s > 0 and real.own_s > 0


class FakeMachine:
    """Readings from a script: each read advances the clock; others' and our CPU use per
    second are set by the test."""

    def __init__(self) -> None:
        self.t = self.busy = self.own = 0.0
        self.others, self.ours = 0.0, 2.0
        self.applied: list[int] = []

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.busy += (self.others + self.ours) * seconds
        self.own += self.ours * seconds

    def read(self) -> CpuTimes:
        return CpuTimes(self.t, self.busy, self.own)


def test_the_governor_decides_from_decoding_time_only() -> None:
    machine = FakeMachine()
    changes: list[tuple[int, int]] = []
    governor = ThreadGovernor(window_s=0.5, read=machine.read, set_threads=machine.applied.append,
                              on_change=lambda old, new: changes.append((old, new)), cores=2)
    assert machine.applied == [2]  # one per core to start with
    # idle between batches while a trainer keeps both cores busy: not looked at
    machine.others, machine.ours = 2.0, 0.0
    machine.advance(5.0)
    governor.begin()
    machine.others, machine.ours = 0.0, 2.0  # the trainer waits for our samples
    for _ in range(10):
        machine.advance(0.1)
        assert governor.step() == 2
    assert changes == [] and governor.others == pytest.approx(0.0)
    # a busy loop starts: 2/3 of a core beside our two threads
    machine.others, machine.ours = 0.67, 1.33
    for _ in range(11):  # a whole window inside the new load
        machine.advance(0.1)
        governor.step()
    assert governor.threads == 1 and changes == [(2, 1)] and machine.applied == [2, 1]
    # at one thread the loop reads as a whole core: no flapping
    machine.others, machine.ours = 1.0, 1.0
    for _ in range(20):
        machine.advance(0.1)
        governor.step()
    assert changes == [(2, 1)]
    # it stops: back to both cores within a window
    machine.others = 0.0
    for _ in range(11):
        machine.advance(0.1)
        governor.step()
    assert governor.threads == 2 and changes == [(2, 1), (1, 2)]


def test_a_backend_sharing_its_cores_decodes_the_same_tokens(tiny_llama_dir, monkeypatch) -> None:
    """The governor only changes thread counts: the tokens and logprobs are those of a fixed
    count (the fused kernels split columns, not sums, between threads)."""
    import torch

    from gridrl.engine.backends.torch.backend import TorchBackend
    from gridrl.engine.contract import SamplingConfig, SequenceRequest

    monkeypatch.setenv("GRIDRL_CPU_KERNELS", "1")
    threads = torch.get_num_threads()
    try:
        backend = TorchBackend.from_pretrained(tiny_llama_dir, device="cpu")
        batch = [SequenceRequest(prompt_ids=[1, 2, 3], sampling=SamplingConfig(max_tokens=12),
                                 seed=s) for s in range(4)]
        torch.set_num_threads(1)
        fixed = backend.generate(batch, None)
        governor = backend.share_cores()
        counts = iter([1, 2] * 50)
        monkeypatch.setattr(governor, "_read", lambda: None)  # no window: decide by hand
        monkeypatch.setattr(governor, "step", lambda: torch.set_num_threads(next(counts)))
        shared = backend.generate(batch, None)
        assert [r.token_ids for r in shared] == [r.token_ids for r in fixed]
        assert [r.logprobs for r in shared] == [r.logprobs for r in fixed]
    finally:
        torch.set_num_threads(threads)


def test_while_others_take_cores_the_kernels_hand_blocks_out_dynamically(tiny_llama_dir,
                                                                         monkeypatch) -> None:
    from gridrl.engine.backends.torch.backend import TorchBackend

    monkeypatch.setenv("GRIDRL_CPU_KERNELS", "1")
    import torch

    threads = torch.get_num_threads()
    try:
        backend = TorchBackend.from_pretrained(tiny_llama_dir, device="cpu")
        governor = backend.share_cores()
        kernels = backend._lean.kernels
        seen: list[bool] = []
        monkeypatch.setattr(kernels, "set_dynamic_blocks", seen.append)
        governor._on_change(4, 1)  # as on a 4-core machine with 3 cores taken
        governor._on_change(1, governor.cores)  # and all of them free again
        assert seen == [governor.cores > 1, False]
    finally:
        torch.set_num_threads(threads)
