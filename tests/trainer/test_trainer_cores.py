"""``--threads 0`` in the torch trainer: the update shares the cores as a rollout node does
(:class:`gridrl.engine.backends.torch.cores.ThreadGovernor`), its thread count re-decided
between micro-batches from the CPU time other processes take. Observed through the decisions,
never through timings."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gridrl.engine.backends.torch.cores import CpuTimes, ThreadGovernor, allowed_cores
from gridrl.trainer.backends.base import TrainSequence, create_backend
from gridrl.trainer.config import TrainConfig


def _backend(model_dir, **settings):
    base = dict(model=str(model_dir), backend="torch", lora_rank=4, lora_alpha=8.0, lr=1e-2,
                steps=4, max_tokens=8, device="cpu", dtype="float32", rollout=["local"],
                run_dir="unused", seed=0, micro_batch_size=1)
    return create_backend(TrainConfig(**{**base, **settings}).finalize())


def _sequences(n: int = 6, width: int = 48) -> list[TrainSequence]:
    rng = np.random.default_rng(0)
    return [TrainSequence(tuple(int(t) for t in rng.integers(7, 512, width)),
                          tuple(int(t) for t in rng.integers(7, 512, width)),
                          (-6.0,) * width, (-1.0) ** i, i // 2) for i in range(n)]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_threads_zero_shares_the_cores_and_a_fixed_count_does_not(tiny_llama_dir,
                                                                   restore_threads):
    shared = _backend(tiny_llama_dir)
    assert isinstance(shared.cores, ThreadGovernor)
    fixed = _backend(tiny_llama_dir, threads=1)
    assert fixed.cores is None
    assert fixed.update(_sequences(2)).threads == 1


def test_the_update_re_decides_its_threads_between_micro_batches(tiny_llama_dir,
                                                                 restore_threads):
    """Scripted readings: another process takes one of 4 cores from the second window on."""
    clock = iter(range(1000))
    others = iter([0.0] + [1.0] * 999)
    busy = [0.0]

    def read() -> CpuTimes:
        t = float(next(clock))
        busy[0] += next(others)  # other processes' CPU-seconds in one wall second
        return CpuTimes(wall_s=t, busy_s=busy[0], own_s=0.0)

    changes: list[tuple[int, int]] = []
    backend = _backend(tiny_llama_dir)
    backend.cores = ThreadGovernor(window_s=1.0, read=read, cores=4,
                                   on_change=lambda old, new: changes.append((old, new)))
    assert backend.cores.threads == 4
    stats = backend.update(_sequences(6))
    assert stats.micro_batches == 6
    assert changes == [(4, 3)] and stats.threads == 3 == torch.get_num_threads()


@pytest.mark.skipif(len(allowed_cores()) < 2, reason="needs 2 cores to share")
def test_beside_a_busy_process_the_update_gives_up_a_thread(tiny_llama_dir, restore_threads):
    """A real process spinning on one of this process's cores: the update's governor reads it
    from /proc/stat and runs with fewer threads than cores."""
    cores = allowed_cores()
    spin = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.sched_setaffinity(0, {cores[0]}))
    try:
        changes: list[tuple[int, int]] = []
        backend = _backend(tiny_llama_dir)
        backend.cores = ThreadGovernor(window_s=0.2, cores=len(cores),
                                       on_change=lambda old, new: changes.append((old, new)))
        assert backend.cores.threads == len(cores)
        stats = backend.update(_sequences(12, width=96))
        assert changes and changes[0][1] < len(cores), changes
        assert stats.threads < len(cores) and backend.cores.others >= 0.5
    finally:
        spin.kill()
        spin.wait(timeout=30)
