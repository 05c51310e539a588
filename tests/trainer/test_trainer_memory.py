"""``--memory-mb``: the torch update's micro-batches sized from measured activation costs,
activation checkpointing for a sequence too long alone, the same loss and gradients as the
unbounded update, the peak resident memory within the budget, and budgets that cannot work
refused naming the flag and the least that fits."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from float_bounds import ROUNDING_REL, assert_close_to_largest
from lora_gradients import capture_gradients, random_adapter

from gridrl.common.errors import Kind, StatusError
from gridrl.trainer.backends.base import TrainSequence, create_backend
from gridrl.trainer.backends.memory import (
    ALLOCATOR_SLACK,
    MIB,
    RESERVE_BYTES,
    ActivationCost,
    MemoryBudgetError,
    plan_micro_batches,
    resolve_memory_mb,
)
from gridrl.trainer.config import TrainConfig

VOCAB = 512


def _config(model_dir, **settings) -> TrainConfig:
    base = dict(model=str(model_dir), backend="torch", lora_rank=4, lora_alpha=8.0, lr=1e-2,
                steps=4, max_tokens=8, device="cpu", dtype="float32", rollout=["local"],
                run_dir="unused", seed=0)
    return TrainConfig(**{**base, **settings}).finalize()


# ---------------------------------------------------------------- the planner (pure)

COST = ActivationCost(fixed=0.0, per_token=100.0, probe_width=64)
CHECKPOINTED = ActivationCost(fixed=0.0, per_token=25.0, probe_width=64)


def test_plan_grows_micro_batches_while_they_fit_and_keeps_the_order():
    prompts, completions = [4] * 6, [6] * 6  # width 10: 1000 bytes a sequence (+ slack)
    room = 3 * 1000 * (1 + ALLOCATOR_SLACK)
    plan = plan_micro_batches(range(6), prompts, completions, room, COST, CHECKPOINTED)
    assert plan.chunks == [[0, 1, 2], [3, 4, 5]] and plan.checkpointed == [False, False]
    assert plan.peak_bytes <= room
    capped = plan_micro_batches(range(6), prompts, completions, room, COST, CHECKPOINTED,
                                max_sequences=2)
    assert capped.chunks == [[0, 1], [2, 3], [4, 5]]


def test_plan_counts_the_padded_width_of_a_micro_batch():
    # a long completion widens every row of its micro-batch
    plan = plan_micro_batches([0, 1, 2], [4, 4, 4], [6, 26, 6], 3000 * (1 + ALLOCATOR_SLACK),
                              COST, CHECKPOINTED)
    assert plan.chunks == [[0], [1], [2]]


def test_a_sequence_too_long_alone_is_checkpointed_and_one_too_long_for_that_refused():
    room = 2000 * (1 + ALLOCATOR_SLACK)
    plan = plan_micro_batches([0, 1, 2], [4, 40, 4], [6, 40, 6], room, COST, CHECKPOINTED)
    assert plan.chunks == [[0], [1], [2]] and plan.checkpointed == [False, True, False]
    with pytest.raises(MemoryBudgetError) as e:
        plan_micro_batches([0], [400], [400], room, COST, CHECKPOINTED, base_bytes=5 * MIB)
    need = 5 * MIB + 800 * 25 * (1 + ALLOCATOR_SLACK)
    assert e.value.least_mb == int(np.ceil(need / MIB)) and "--memory-mb" in str(e.value)


def test_memory_mb_zero_is_a_share_of_the_available_memory():
    assert resolve_memory_mb(1234) == 1234
    assert resolve_memory_mb(0) > 0


# ---------------------------------------------------------------- the torch update


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


@pytest.mark.parametrize(("pack", "shared_prefix"), [(True, True), (False, True), (False, False)],
                         ids=["packed", "shared-prefix", "padded"])
def test_bounded_update_gives_the_unbounded_loss_and_gradients(tiny_llama_dir, pack,
                                                              shared_prefix):
    """Room for ~2 short sequences; the long one fits only checkpointed."""
    from gridrl.trainer.backends.torch.memory import UpdateMemory

    seqs = _sequences([(12, 20), (12, 9), (30, 12), (30, 40), (20, 200), (20, 15)])
    results = []
    for bounded in (False, True):
        backend = create_backend(_config(tiny_llama_dir))
        backend.update_cfg = dataclasses.replace(backend.update_cfg, shared_prefix=shared_prefix,
                                                 pack=pack)
        backend.load_adapter_files(random_adapter(backend.adapter_files(), seed=7))
        if bounded:
            probe = UpdateMemory(backend.policy, backend.update_cfg, 1 << 40, width=256,
                                 rss=lambda: 0)
            plain, checkpointed = probe.costs(256)
            room = (plain.bytes(1, 220) + checkpointed.bytes(1, 220)) / 2
            assert plain.bytes(2, 72) < room < plain.bytes(1, 220)
            backend.memory = UpdateMemory(backend.policy, backend.update_cfg,
                                          int(room) + RESERVE_BYTES, width=256, rss=lambda: 0)
        grads = capture_gradients(backend)
        results.append((backend.update(seqs), grads))
        backend.close()
    (want, want_grads), (got, got_grads) = results
    assert want.micro_batches == 1 and want.checkpointed_micro_batches == 0
    assert got.micro_batches >= 3 and got.checkpointed_micro_batches == 1
    assert got.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
    np.testing.assert_allclose(got.per_sequence_mismatch_kl, want.per_sequence_mismatch_kl,
                               rtol=1e-4)
    assert set(got_grads) == set(want_grads) and want_grads
    for key, g in want_grads.items():
        assert np.abs(g).max() > 0, key
        assert_close_to_largest(got_grads[key], g, ROUNDING_REL, str(key))


def test_a_sequence_no_budget_holds_is_refused_at_the_step_naming_the_flag(tiny_llama_dir):
    from gridrl.trainer.backends.torch.memory import UpdateMemory

    backend = create_backend(_config(tiny_llama_dir))
    _, checkpointed = UpdateMemory(backend.policy, backend.update_cfg, 1 << 40,
                                       rss=lambda: 0).costs(256)
    backend.memory = UpdateMemory(backend.policy, backend.update_cfg,
                                  int(checkpointed.bytes(1, 256)) + RESERVE_BYTES + 1,
                                  rss=lambda: 0)
    before = backend.adapter_files()
    with pytest.raises(StatusError) as e:
        backend.update(_sequences([(100, 400), (10, 10)]))
    assert e.value.kind is Kind.RESOURCE_EXHAUSTED and e.value.field == "--memory-mb"
    assert "needs --memory-mb" in e.value.message
    assert backend.adapter_files() == before  # nothing stepped
    backend.close()


def test_a_budget_below_the_weights_is_refused_before_the_model_loads(tiny_llama_dir,
                                                                      monkeypatch):
    from gridrl.trainer.backends.torch import backend as torch_backend

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(torch_backend, "load_policy", never)
    with pytest.raises(StatusError) as e:
        create_backend(_config(tiny_llama_dir, memory_mb=1))
    assert e.value.kind is Kind.INVALID_ARGUMENT and e.value.field == "--memory-mb"
    assert "needs --memory-mb" in e.value.message


def test_a_budget_without_room_for_one_sequence_is_refused_before_step_1(tiny_llama_dir):
    """The least the weights need leaves no room for activations: refused after the load,
    before any step, naming a larger least."""
    from gridrl.trainer.backends.memory import current_rss_bytes

    least = current_rss_bytes() // MIB + 1  # the process as it is, nothing more
    with pytest.raises(StatusError) as e:
        create_backend(_config(tiny_llama_dir, memory_mb=int(least)))
    assert e.value.kind is Kind.INVALID_ARGUMENT and e.value.field == "--memory-mb"
    named = int(e.value.message.split("needs --memory-mb ")[1].split()[0])
    assert named > least


PEAK_SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys
    import numpy as np
    from gridrl.trainer.backends.base import TrainSequence, create_backend
    from gridrl.trainer.backends.memory import MIB, current_rss_bytes
    from gridrl.trainer.backends.torch.memory import UpdateMemory
    from gridrl.trainer.config import TrainConfig

    model_dir, room_mb, bounded = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    cfg = TrainConfig(model=model_dir, backend="torch", lora_rank=4, lora_alpha=8.0,
                      lr=1e-2, steps=4, max_tokens=8, device="cpu", dtype="float32",
                      rollout=["local"], run_dir="unused", seed=0, memory_mb=1 << 20).finalize()
    backend = create_backend(cfg)
    backend.update_cfg = dataclasses.replace(backend.update_cfg, shared_prefix=False)
    rng = np.random.default_rng(0)
    seqs = [TrainSequence(tuple(int(t) for t in rng.integers(7, 512, 128)),
                          tuple(int(t) for t in rng.integers(7, 512, 256)),
                          (-6.0,) * 256, (-1.0) ** i, i // 4) for i in range(64)]
    backend.update(seqs[:4])  # optimizer state, caches, allocator warm
    limit = current_rss_bytes() + room_mb * MIB
    if bounded:
        backend.memory = UpdateMemory(backend.policy, backend.update_cfg, limit)
    else:
        backend.memory = None
    stats = backend.update(seqs)
    print(json.dumps({"peak": stats.peak_rss_bytes, "limit": limit,
                      "micro_batches": stats.micro_batches}))
""")


def _peak(model_dir, room_mb: int, bounded: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(model_dir), str(room_mb),
                          "1" if bounded else "0"], capture_output=True, text=True,
                         timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_resident_memory_stays_within_the_budget(tiny_llama_dir):
    """64 sequences of 384 tokens: ~300 MB of activations at once unbounded; bounded to 64 MiB
    above the process, the step's peak resident memory (VmHWM) stays under the limit."""
    unbounded = _peak(tiny_llama_dir, 64, bounded=False)
    assert unbounded["peak"] > unbounded["limit"]  # the bound has something to do
    bounded = _peak(tiny_llama_dir, 64, bounded=True)
    assert bounded["micro_batches"] > 1
    assert bounded["peak"] <= bounded["limit"], (bounded, unbounded)


def test_the_probe_counts_what_a_block_allocates_not_views_of_weights_it_found():
    """``linear`` decomposes into a transposed view of the weight: that view (and an in-place
    result) allocates nothing, so the probe's fixed part must not hold the model's weights
    again (it did: a 0.5B model's 2.4 GB were counted as one sequence's activations)."""
    import torch

    from gridrl.trainer.backends.torch.memory import LiveTensorBytes

    weight = torch.randn(4096, 1024)  # 16 MiB, alive before the block
    x = torch.randn(8, 1024, requires_grad=True)
    with LiveTensorBytes() as live:
        y = torch.nn.functional.linear(x, weight)  # 8 x 4096 float32: 128 KiB
        y.add_(1.0)
        y.sum().backward()  # x.grad: 32 KiB, plus the backward's ones-like seed
    allocated = y.nelement() * 4 + x.grad.nelement() * 4
    assert allocated <= live.peak <= allocated + y.nelement() * 4


# ---------------------------------------------------------------- out of memory anyway

ALLOCATOR_REFUSAL = ("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                     "268435456 bytes. Error code 12 (Cannot allocate memory)")


def _refuse_at(micro_batch: int, calls: list[int] | None = None):
    def hook(k: int) -> None:
        if calls is not None:
            calls.append(k)
        if k == micro_batch:
            raise RuntimeError(ALLOCATOR_REFUSAL)
    return hook


def test_an_allocation_failure_in_the_update_names_the_setting_and_leaves_the_weights(
        tiny_llama_dir, monkeypatch):
    from gridrl.trainer.backends.memory import UpdateOutOfMemory, is_out_of_memory
    from gridrl.trainer.backends.torch import update as torch_update
    from gridrl.trainer.backends.torch.memory import UpdateMemory

    assert is_out_of_memory(RuntimeError(ALLOCATOR_REFUSAL)) and is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    seqs = _sequences([(12, 20), (12, 9), (30, 12), (30, 40)])
    backend = create_backend(_config(tiny_llama_dir, micro_batch_size=2))
    backend.memory = None  # no plan (a CUDA trainer's case): --micro-batch-size is the setting
    before = backend.adapter_files()
    calls: list[int] = []
    # the second micro-batch fails: the first one's gradients are already accumulated
    monkeypatch.setattr(torch_update, "before_micro_batch", _refuse_at(1, calls))
    with pytest.raises(UpdateOutOfMemory) as e:
        backend.update(seqs)
    assert calls == [0, 1]
    assert e.value.setting == "--micro-batch-size" and e.value.weights_untouched
    assert "lower --micro-batch-size (now 2" in str(e.value) and "try 1" in str(e.value)
    assert isinstance(e.value.__cause__, RuntimeError)
    assert backend.adapter_files() == before  # nothing stepped
    assert all(p.grad is None for p in backend.policy.trainable_parameters())
    assert not backend.optimizer.state  # AdamW's moments untouched too
    # with a --memory-mb plan, that is the setting to lower
    backend.memory = UpdateMemory(backend.policy, backend.update_cfg, 1 << 40, rss=lambda: 0)
    with pytest.raises(UpdateOutOfMemory) as e:
        backend.update(seqs)
    assert e.value.setting == "--memory-mb" and f"now {1 << 20} MiB" in str(e.value)
    assert backend.adapter_files() == before
    # the next step, with memory to spare, trains
    monkeypatch.setattr(torch_update, "before_micro_batch", None)
    assert backend.update(seqs).micro_batches >= 1
    assert backend.adapter_files() != before
    # a failure in the optimizer step says the weights may be half stepped
    monkeypatch.setattr(backend.optimizer, "step", lambda: (_ for _ in ()).throw(
        MemoryError()))
    with pytest.raises(UpdateOutOfMemory) as e:
        backend.update(seqs)
    assert not e.value.weights_untouched and "half stepped" in str(e.value)
    backend.close()


OUT_OF_MEMORY_RUN = textwrap.dedent("""
    import sys
    from gridrl.trainer.backends.torch import update

    refusal = sys.argv.pop(1)
    updates = []

    def refuse_in_step_3(micro_batch):
        if micro_batch == 0:
            updates.append(micro_batch)
        if len(updates) == 3:
            raise RuntimeError(refusal)

    update.before_micro_batch = refuse_in_step_3
    from gridrl.trainer.cli import main

    sys.argv[0] = "gridrl-trainer"
    main()
""")


@pytest.mark.slow
def test_a_run_out_of_memory_keeps_its_checkpoint_and_names_the_setting(tiny_llama_dir,
                                                                       tmp_path):
    """``gridrl-trainer run`` whose third update's allocation fails: exit 1 naming
    --memory-mb (the planned budget is what to lower), the two finished steps checkpointed
    (the weights were untouched), and ``--resume`` continues from there."""
    from trainer_runs import BIN, ENV, run_args, write_task_files
    from trainer_runs import records as read_records

    data, reward = write_task_files(tmp_path)
    run_dir = tmp_path / "run"
    args = run_args(tiny_llama_dir, data, reward, run_dir, steps=4, checkpoint_every=100,
                    eval_every=100, metrics_port=-1)
    failed = subprocess.run([sys.executable, "-c", OUT_OF_MEMORY_RUN, ALLOCATOR_REFUSAL,
                             *args[1:]], capture_output=True, text=True, timeout=600, env=ENV)
    out = failed.stdout + failed.stderr
    assert failed.returncode == 1, out[-3000:]
    assert "the update ran out of memory: lower --memory-mb" in out, out[-3000:]
    assert "--micro-batch-size" in out
    assert [r["step"] for r in read_records(run_dir) if r.get("step")] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000002"
    resumed = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--resume", str(run_dir),
                              "--steps", "3", "--listen", "127.0.0.1:0", "--metrics-port",
                              "-1"], capture_output=True, text=True, timeout=600, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_records(run_dir) if r.get("step")] == [1, 2, 3]


def test_the_budget_keeps_room_for_the_optimizers_step(tiny_llama_dir):
    """AdamW's first step allocates two moments per LoRA parameter after the micro-batches'
    peak (a 0.5B model's bounded update peaked 25 MiB over a 4 GB budget without this): the
    budget holds them back until they exist, and one parameter-sized set of temporaries
    always."""
    from gridrl.trainer.backends.torch.memory import UpdateMemory

    backend = create_backend(_config(tiny_llama_dir))
    lora = sum(p.numel() * p.element_size() for p in backend.policy.trainable_parameters())
    memory = UpdateMemory(backend.policy, backend.update_cfg, 1 << 40, width=64, rss=lambda: 0,
                          optimizer=backend.optimizer)
    assert memory.optimizer_reserve_bytes() == 3 * lora
    backend.update(_sequences([(12, 8), (12, 6)]))
    assert memory.optimizer_reserve_bytes() == lora  # the moments are resident now
    assert UpdateMemory(backend.policy, backend.update_cfg, 1 << 40, width=64,
                        rss=lambda: 0).optimizer_reserve_bytes() == 0
    backend.close()
