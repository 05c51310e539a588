"""``--memory-mb`` on the MLX trainer (tiny llama, float32, MLX's CPU build): micro-batches
planned from token counts within the budget give the unbounded loss and gradients at float32
rounding (``float_bounds``), budgets that cannot hold one sequence are refused naming the
least that fits: before step 1 (INVALID_ARGUMENT) or at the step (RESOURCE_EXHAUSTED, nothing
stepped), a step wider than the start-up probe probes no more than one sequence of its width,
the update's arrays stay within the planned activations and the optimizer's reserve, and its
peak resident memory within the budget. (The cost's arithmetic without a model:
``tests/trainer/test_trainer_memory_costs.py``.)"""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from float_bounds import ROUNDING_REL, assert_close_to_largest, assert_within
from lora_gradients import capture_gradients, random_adapter

from gridrl.common.errors import Kind, StatusError
from gridrl.trainer.backends.base import TrainSequence, create_backend
from gridrl.trainer.backends.memory import MIB, RESERVE_BYTES
from gridrl.trainer.config import TrainConfig

pytestmark = pytest.mark.mlx
mx = pytest.importorskip("mlx.core")

VOCAB = 512


def _backend(model_dir, **settings):
    base = dict(model=str(model_dir), backend="mlx", lora_rank=4, lora_alpha=8.0, lr=1e-2,
                steps=4, max_tokens=8, device="cpu", dtype="float32", rollout=["local"],
                run_dir="unused", seed=0, memory_mb=1 << 20)
    return create_backend(TrainConfig(**{**base, **settings}).finalize())


def _sequences(widths, seed: int = 5) -> list[TrainSequence]:
    rng = np.random.default_rng(seed)
    seqs = []
    for i, (p, c) in enumerate(widths):
        prompt = tuple(int(t) for t in rng.integers(7, VOCAB, p))
        completion = tuple(int(t) for t in rng.integers(7, VOCAB, c))
        behaviour = tuple(float(x) for x in rng.uniform(-7.0, -5.0, c))
        seqs.append(TrainSequence(prompt, completion, behaviour, (-1.0) ** i * (1 + i % 3),
                                  i // 2))
    return seqs


def test_mlx_micro_batches_fit_the_budget_with_the_unbounded_loss_and_gradients(
        tiny_llama_dir):
    from gridrl.trainer.backends.mlx.memory import MlxUpdateMemory

    seqs = _sequences([(12, 20), (12, 9), (30, 12), (30, 40), (20, 60), (20, 15)])
    results = []
    for bounded in (False, True):
        backend = _backend(tiny_llama_dir)
        assert backend.memory is not None  # --memory-mb is honoured: measured at start-up
        backend.load_adapter_files(random_adapter(backend.adapter_files(), seed=7))
        if bounded:
            cost = MlxUpdateMemory(backend, 1 << 40, rss=lambda: 0).cost(128)
            assert cost.per_token > 0  # measured on the model, not guessed
            room = cost.bytes(2, 82)  # two of the longest: the six cannot share one
            backend.memory = MlxUpdateMemory(backend, int(room) + RESERVE_BYTES,
                                             rss=lambda: 0)
        else:
            backend.memory = None
        grads = capture_gradients(backend)
        results.append((backend.update(seqs), grads))
        backend.close()
    (want, want_grads), (got, got_grads) = results
    assert want.micro_batches == 1 and got.micro_batches >= 3
    assert got.peak_rss_bytes and got.peak_rss_bytes > 0
    assert_within(abs(got.loss - want.loss), ROUNDING_REL * abs(want.loss), "loss")
    assert set(got_grads) == set(want_grads) and want_grads
    for key, g in want_grads.items():
        assert np.abs(g).max() > 0, key
        assert_close_to_largest(got_grads[key], g, ROUNDING_REL, str(key))


def test_mlx_budgets_too_small_are_refused_naming_the_least_that_fits(tiny_llama_dir):
    from gridrl.trainer.backends.memory import current_rss_bytes
    from gridrl.trainer.backends.mlx.memory import MlxUpdateMemory

    # before step 1: the process as it is leaves no room for one sequence
    least = current_rss_bytes() // MIB + 1
    with pytest.raises(StatusError) as e:
        _backend(tiny_llama_dir, memory_mb=int(least))
    assert e.value.kind is Kind.INVALID_ARGUMENT and e.value.field == "--memory-mb"
    named = int(e.value.message.split("needs --memory-mb ")[1].split()[0])
    assert named > least
    # at the step: room for one short sequence, not for a long one
    backend = _backend(tiny_llama_dir)
    cost = MlxUpdateMemory(backend, 1 << 40, rss=lambda: 0).cost(128)
    # (1.2x: a new bound measures again, and MLX's peak varies by a few percent)
    backend.memory = MlxUpdateMemory(backend, int(1.2 * cost.bytes(1, 128)) + RESERVE_BYTES,
                                     rss=lambda: 0)
    before = backend.adapter_files()
    with pytest.raises(StatusError) as e:
        backend.update(_sequences([(10, 10), (100, 400)]))
    assert e.value.kind is Kind.RESOURCE_EXHAUSTED and e.value.field == "--memory-mb"
    assert "needs --memory-mb" in e.value.message
    assert backend.adapter_files() == before  # nothing stepped
    backend.close()


def test_a_step_wider_than_the_start_up_probe_probes_one_sequence_of_its_width_at_most(
        tiny_llama_dir, monkeypatch):
    """A step of 174-token sequences, wider than the start-up probe (128), is measured at 192
    (174 rounded up to 32) by one sequence 96 wide, two of those and one 192 wide: never more
    tokens than one sequence of the step (it had probed 1 and 2 sequences of 256, twice the
    tokens of a one-sequence micro-batch twice over). A narrower step reuses that measurement;
    a wider one measures again."""
    from gridrl.trainer.backends.mlx import memory as mlx_memory

    probes: list[tuple[int, int]] = []
    real = mlx_memory.probe_peak_bytes

    def spy(backend, n, width):
        probes.append((n, width))
        return real(backend, n, width)

    monkeypatch.setattr(mlx_memory, "probe_peak_bytes", spy)
    backend = _backend(tiny_llama_dir)
    assert probes == [(1, 64), (2, 64), (1, 128)]  # start-up, at PROBE_WIDTH
    probes.clear()
    stats = backend.update(_sequences([(80, 94), (30, 40), (60, 100), (12, 20)]))
    assert stats.micro_batches >= 1
    assert probes == [(1, 96), (2, 96), (1, 192)]
    assert max(n * w for n, w in probes) <= 192
    probes.clear()
    backend.update(_sequences([(70, 80), (20, 30)]))  # 150 wide: the 192 measurement serves
    backend.logprobs(_sequences([(90, 100)]))  # 190: so does it for the logprobs' plan
    assert probes == []
    backend.update(_sequences([(100, 100)]))  # 200 wide: measured again at 224
    assert probes == [(1, 112), (2, 112), (1, 224)]
    assert sorted(backend.memory._costs.measured) == [128, 192, 224]
    backend.close()


def test_the_update_s_arrays_stay_within_the_planned_activations_and_the_optimizer_reserve(
        tiny_llama_dir):
    """A rank-64 LoRA, large beside four short sequences' activations: AdamW's first step adds
    its two moments, and the MLX update holds the running sum of the gradients and a clipped
    copy beside them. MLX's own peak counter over each whole update (micro-batches and the
    optimizer's step) stays within the plan's peak plus :meth:`optimizer_reserve_bytes`
    (5 LoRA-sized sets before the first step, 3 after), which the plan alone would not hold."""
    from mlx.utils import tree_flatten

    from gridrl.trainer.backends.mlx.memory import MlxUpdateMemory

    backend = _backend(tiny_llama_dir, lora_rank=64)
    backend.memory = None
    backend.update_cfg = dataclasses.replace(backend.update_cfg, micro_batch_size=1)
    lora = sum(v.nbytes for _, v in tree_flatten(backend.model.trainable_parameters()))
    memory = MlxUpdateMemory(backend, 1 << 40, rss=lambda: 0)
    seqs = _sequences([(6, 5), (6, 4), (7, 5), (7, 3)])
    beyond_plan = []
    for step in range(3):
        reserve = memory.optimizer_reserve_bytes()
        assert reserve == (5 if step == 0 else 3) * lora
        plan = memory.plan(seqs, list(range(len(seqs))), 1)
        assert len(plan.chunks) == len(seqs)
        mx.eval(backend.model.parameters(), backend.optimizer.state)
        gc.collect()  # arrays of earlier tests freed now, not during the update
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        stats = backend.update(seqs)
        peak = mx.get_peak_memory() - before
        assert stats.micro_batches == len(seqs)
        assert peak <= plan.peak_bytes + reserve, (step, peak / lora, plan.peak_bytes / lora)
        beyond_plan.append((peak > plan.peak_bytes, peak / lora, plan.peak_bytes / lora))
    assert all(b for b, *_ in beyond_plan), beyond_plan  # the plan alone is exceeded
    backend.close()


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import mlx.core as mx
    from gridrl.trainer.backends.base import TrainSequence, create_backend
    from gridrl.trainer.backends.memory import MIB, current_rss_bytes, trim_free_memory
    from gridrl.trainer.backends.mlx import memory as mlx_memory
    from gridrl.trainer.config import TrainConfig

    model_dir, room_mb, bounded = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    cfg = TrainConfig(model=model_dir, backend="mlx", lora_rank=4, lora_alpha=8.0, lr=1e-2,
                      steps=4, max_tokens=8, device="cpu", dtype="float32",
                      rollout=["local"], run_dir="unused", seed=0,
                      memory_mb=1 << 20).finalize()
    backend = create_backend(cfg)
    rng = np.random.default_rng(1)
    seqs = []
    for i in range(64):  # micro-batches of changing shapes: MLX's cache has to be held
        p, c = int(rng.integers(10, 200)), int(rng.integers(10, 250))
        seqs.append(TrainSequence(tuple(int(t) for t in rng.integers(7, 512, p)),
                                  tuple(int(t) for t in rng.integers(7, 512, c)),
                                  (-6.0,) * c, (-1.0) ** i, i // 4))
    backend.memory = None
    backend.update(seqs[:4])  # optimizer state, allocator warm
    probes = []
    real = mlx_memory.probe_peak_bytes
    def spy(b, n, width):
        probes.append((n, width))
        return real(b, n, width)
    mlx_memory.probe_peak_bytes = spy
    mx.clear_cache()  # the warm-up's freed buffers are not the budget's
    trim_free_memory()
    limit = current_rss_bytes() + room_mb * MIB
    if bounded:  # probed at start-up at 128 tokens: the 384-token step probes again
        backend.memory = mlx_memory.MlxUpdateMemory(backend, limit)
    stats = backend.update(seqs)
    print(json.dumps({"peak": stats.peak_rss_bytes, "limit": limit,
                      "micro_batches": stats.micro_batches, "probes": probes,
                      "widest": max(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)}))
""")


def _peak(model_dir, room_mb: int, bounded: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(model_dir), str(room_mb),
                          "1" if bounded else "0"], capture_output=True, text=True,
                         timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_mlx_peak_resident_memory_stays_within_the_budget(tiny_llama_dir):
    """64 sequences of 20-450 tokens: ~300 MB of MLX arrays at once unbounded; bounded to
    48 MiB above the process, the step's peak resident memory (VmHWM: MLX's buffer cache and
    the probes inside the step included, the step being wider than the start-up probe) stays
    under the limit, and no probe holds more than one sequence of the step's widest width
    (rounded up to 32 tokens). (Without the cache held, 1 run in 1 peaked 3 MiB over.)"""
    unbounded = _peak(tiny_llama_dir, 48, bounded=False)
    assert unbounded["peak"] > unbounded["limit"]  # the bound has something to do
    bounded = _peak(tiny_llama_dir, 48, bounded=True)
    assert bounded["micro_batches"] > 1
    assert bounded["peak"] <= bounded["limit"], (bounded, unbounded)
    at = -(-bounded["widest"] // 32) * 32
    assert at > 128
    step_probes = [tuple(p) for p in bounded["probes"]][3:]  # after the start-up's three
    assert step_probes == [(1, at // 2), (2, at // 2), (1, at)]
