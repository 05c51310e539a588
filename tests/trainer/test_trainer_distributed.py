"""Data parallelism: two CPU processes on gloo (DDP) give the same adapter as one process on
the same fixed batch."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from gridrl.trainer.backend import TrainSequence, UpdateConfig

STEPS = 2


def _batch() -> list[TrainSequence]:
    g = torch.Generator().manual_seed(7)
    seqs = []
    lengths = [(5, 3), (8, 6), (4, 2), (6, 5), (9, 1), (3, 4), (7, 7), (5, 2)]
    for i, (p, c) in enumerate(lengths):
        prompt = torch.randint(7, 512, (p,), generator=g).tolist()
        comp = torch.randint(7, 512, (c,), generator=g).tolist()
        behaviour = (-torch.rand(c, generator=g) * 4).tolist()
        seqs.append(TrainSequence(tuple(prompt), tuple(comp), tuple(behaviour),
                                  advantage=float(torch.randn(1, generator=g)), group=i // 2))
    return seqs


# Both sides use the padded per-sequence forward: after several Adam steps (which amplify float
# rounding in near-zero gradient entries) an element-wise comparison is only meaningful when the
# two runs compute each sequence's forward the same way. The shared-prefix forward's equality
# with the padded one is tested in test_trainer_update.py; the torchrun CLI test below runs
# the default (shared-prefix) path under DDP.
CFG = dict(temperature=0.9, max_tokens=8, aggregation="token", beta=0.02, max_grad_norm=0.5,
           shared_prefix=False)


def _train(model_dir: str, parallel_factory, micro_batch_size: int,
           seed: int = 0) -> dict[str, torch.Tensor]:
    from gridrl.trainer.policy import LoraSettings, load_policy
    from gridrl.trainer.update import grpo_update, make_optimizer, make_scheduler

    policy = load_policy(model_dir, lora=LoraSettings(rank=4, alpha=8, dropout=0.0), seed=seed)
    parallel = parallel_factory(policy)
    opt = make_optimizer(policy.trainable_parameters(), lr=5e-3)
    sched = make_scheduler(opt, schedule="linear", warmup_steps=1, total_steps=STEPS)
    cfg = UpdateConfig(**CFG, micro_batch_size=micro_batch_size)
    losses, norms = [], []
    for _ in range(STEPS):
        stats = grpo_update(policy, opt, sched, _batch(), cfg, parallel)
        losses.append(stats.loss)
        norms.append(stats.grad_norm)  # pre-clip: catches a wrong DDP gradient scale
    state = policy.adapter_state()
    state["__losses__"] = torch.tensor(losses, dtype=torch.float64)
    state["__grad_norms__"] = torch.tensor(norms, dtype=torch.float64)
    return state


def _gloo_threads() -> list[str]:
    """Names of this process's native threads that belong to gloo (Linux: /proc)."""
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that just ended
            continue
    return sorted(n for n in names if "gloo" in n)


def _rank_main(rank: int, world: int, store: str, model_dir: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # two ranks on shared cores
    from gridrl.trainer.distributed import DataParallel, init_process_group

    # A FileStore rendezvous: no port to pick in advance (gloo binds its own on port 0).
    init_process_group(torch.device("cpu"), init_method=f"file://{store}", rank=rank,
                       world_size=world, timeout_s=120)
    holder = {}

    def factory(policy):
        holder["p"] = DataParallel(policy, torch.device("cpu"))
        assert holder["p"].local_share([s.group for s in _batch()]) == (
            [0, 1, 4, 5] if rank == 0 else [2, 3, 6, 7])
        return holder["p"]

    # rank 1 draws a different LoRA init: DDP's broadcast of rank 0's parameters must undo it.
    # Two passes of one group each (the first under no_sync), as the one process below runs
    # them: the two then differ only in the order the four groups' gradients are summed.
    state = _train(model_dir, factory, micro_batch_size=2, seed=rank)
    torch.save(state, f"{out}.rank{rank}")
    # close() ends gloo's worker threads while Python runs: a worker still alive when the
    # interpreter finalizes can abort the process as it frees a collective's tensors
    # (DataParallel.close).
    if os.path.isdir("/proc/self/task"):
        assert "pt_gloo_runloop" in _gloo_threads()
    holder["p"].close()
    if os.path.isdir("/proc/self/task"):
        assert _gloo_threads() == [], _gloo_threads()


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process(tiny_llama_dir, tmp_path):
    import torch.multiprocessing as mp

    from gridrl.trainer.distributed import SingleProcess

    out = str(tmp_path / "adapter")
    store = str(tmp_path / "rendezvous")
    mp.spawn(_rank_main, args=(2, store, str(tiny_llama_dir), out), nprocs=2, join=True)
    single = _train(str(tiny_llama_dir), lambda p: SingleProcess(p.model), micro_batch_size=2)
    ranks = [torch.load(f"{out}.rank{r}") for r in range(2)]
    assert set(ranks[0]) == set(single)
    for key, want in single.items():
        assert torch.equal(ranks[0][key], ranks[1][key]), key  # ranks agree exactly
        assert torch.allclose(ranks[0][key], want, atol=2e-6, rtol=1e-4), key
    # the adapter moved: B started at zero
    assert any(v.abs().max() > 0 for k, v in single.items() if "lora_B" in k)


@pytest.mark.slow
def test_torchrun_cli_run_matches_the_single_process_run(tiny_llama_dir, tmp_path):
    """The whole ``gridrl-trainer run`` under ``torchrun --nproc-per-node 2`` (gloo): rank 0
    samples and broadcasts, both ranks train their share; same steps, rewards and adapter as
    one process, and bit for bit the adapter of one process that trains in the ranks' layout
    (``--micro-batch-size 8``: one group a pass): each rank runs one process's passes
    (``PolicyPasses``), its loss scaled by the world size (2, exact), and DDP averages the
    two ranks' gradients (a sum of two, then a halving: exact)."""
    import subprocess

    from safetensors.torch import load_file
    from trainer_runs import BIN, ENV, records, run_args, write_task_files

    data, reward = write_task_files(tmp_path)
    single_dir, ddp_dir = tmp_path / "single", tmp_path / "ddp"
    steps = 6
    single = subprocess.run(run_args(tiny_llama_dir, data, reward, single_dir, steps),
                            capture_output=True, text=True, timeout=300, env=ENV)
    assert single.returncode == 0, single.stderr[-3000:]
    layout_dir = tmp_path / "single-layout"
    layout = subprocess.run(run_args(tiny_llama_dir, data, reward, layout_dir, steps,
                                     micro_batch_size=8),
                            capture_output=True, text=True, timeout=300, env=ENV)
    assert layout.returncode == 0, layout.stderr[-3000:]
    env = {**ENV, "GLOO_SOCKET_IFNAME": "lo"}
    # --standalone: torchrun's rendezvous store binds port 0 and the ranks read its port back
    ddp = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
                          *run_args(tiny_llama_dir, data, reward, ddp_dir, steps)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert ddp.returncode == 0, ddp.stdout[-3000:] + ddp.stderr[-3000:]
    assert ddp.stdout.count("baseline eval") == 1  # rank 0 alone evaluates and prints
    one = [r for r in records(single_dir) if r.get("step")]
    two = [r for r in records(ddp_dir) if r.get("step")]
    assert [r["step"] for r in two] == list(range(1, steps + 1))
    for a, b in zip(one, two, strict=True):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-9), b["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["policy_version"] == a["policy_version"]
    w1 = load_file(single_dir / "adapter" / "adapter_model.safetensors")
    w2 = load_file(ddp_dir / "adapter" / "adapter_model.safetensors")
    assert w1.keys() == w2.keys()
    # Same adapter up to float32 summation order: DDP sums the ranks' gradients in another
    # order than one process, and Adam divides each entry by sqrt(v), so an entry whose gradient
    # is near zero can move by a visible fraction of lr (2e-2 here) while the tensor as a whole
    # agrees to ~1e-5 relative (seen on an AVX2 CPU: one entry of 512 off by 3e-5).
    for k in w1:
        assert torch.linalg.norm(w1[k] - w2[k]) <= 1e-4 * torch.linalg.norm(w1[k]), k
        assert (w1[k] - w2[k]).abs().max() <= 1e-3, k
    w3 = load_file(layout_dir / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(w3[k], w2[k]) for k in w1)
    assert [r["grad_norm"] for r in records(layout_dir) if r.get("step")] == [
        r["grad_norm"] for r in two]
