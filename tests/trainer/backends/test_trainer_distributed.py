"""Data parallelism: two CPU processes on gloo (DDP) take the same steps as one process on
the same fixed batch."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from float_bounds import ROUNDING_REL, assert_tensors_close_to_largest, assert_within, max_abs

from gridrl.trainer.backends.base import TrainSequence, UpdateConfig

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


# Both sides use the padded per-sequence forward, so the two differ only in the order the
# groups' gradients are summed. The shared-prefix forward's equality with the padded one is
# tested in test_trainer_update.py; the torchrun CLI test below runs the default
# (shared-prefix) path under DDP.
CFG = dict(temperature=0.9, max_tokens=8, aggregation="token", beta=0.02, max_grad_norm=0.5,
           shared_prefix=False)


def _train(model_dir: str, parallel_factory, micro_batch_size: int, seed: int = 0,
           replay: list[dict] | None = None) -> list[dict]:
    """``STEPS`` updates; per step the LoRA weights before it (``weights``), the gradients
    AdamW got (``grads``, after the clip), the loss and the pre-clip norm, and after the last
    step ``final``: the weights. With ``replay`` (another run's steps), every step after the
    first starts from that run's weights: each step's gradients are then comparable to float32
    rounding, where after an AdamW step they would not be (an entry whose gradient is within
    rounding of zero moves by +-lr depending on the summation order)."""
    from gridrl.trainer.backends.torch.policy import LoraSettings, load_policy
    from gridrl.trainer.backends.torch.update import grpo_update, make_optimizer, make_scheduler

    policy = load_policy(model_dir, lora=LoraSettings(rank=4, alpha=8, dropout=0.0), seed=seed)
    params = policy.trainable_parameters()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-zero B, drawn per seed: A has a gradient at the first step too
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02, generator=gen)
    parallel = parallel_factory(policy)
    opt = make_optimizer(params, lr=5e-3)
    sched = make_scheduler(opt, schedule="linear", warmup_steps=1, total_steps=STEPS)
    cfg = UpdateConfig(**CFG, micro_batch_size=micro_batch_size)
    clipped: list[torch.Tensor] = []

    def record(optimizer, args, kwargs):
        clipped[:] = [p.grad.detach().clone() for p in params]

    opt.register_step_pre_hook(record)
    steps = []
    for k in range(STEPS):
        if replay is not None and k > 0:
            with torch.no_grad():
                for p, w in zip(params, replay[k]["weights"], strict=True):
                    p.copy_(w)
        weights = [p.detach().clone() for p in params]
        stats = grpo_update(policy, opt, sched, _batch(), cfg, parallel)
        steps.append({"weights": weights, "grads": list(clipped), "loss": stats.loss,
                      "grad_norm": stats.grad_norm})  # pre-clip: catches a wrong DDP scale
    steps.append({"final": [p.detach().clone() for p in params]})
    return steps


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
    from gridrl.trainer.backends.torch.distributed import DataParallel, init_process_group

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
    steps = _train(model_dir, factory, micro_batch_size=2, seed=rank)
    torch.save(steps, f"{out}.rank{rank}")
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

    from gridrl.trainer.backends.torch.distributed import SingleProcess

    out = str(tmp_path / "adapter")
    store = str(tmp_path / "rendezvous")
    mp.spawn(_rank_main, args=(2, store, str(tiny_llama_dir), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.rank{r}") for r in range(2)]
    # the ranks agree exactly at every step (DDP broadcast rank 0's weights at the start,
    # rank 1's own draw undone, and both step on the same all-reduced gradients)
    for a, b in zip(*ranks, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert (all(map(torch.equal, a[key], b[key])) if isinstance(a[key], list)
                    else a[key] == b[key]), key
    # one process on the same batch, each step from the weights the ranks started it from
    single = _train(str(tiny_llama_dir), lambda p: SingleProcess(p.model), micro_batch_size=2,
                    replay=ranks[0])
    assert all(map(torch.equal, single[0]["weights"], ranks[0][0]["weights"]))  # rank 0's init
    for k, (want, got) in enumerate(zip(single[:STEPS], ranks[0][:STEPS], strict=True)):
        assert_tensors_close_to_largest(got["grads"], want["grads"], ROUNDING_REL,
                                        f"step {k} gradient")
        # float64 sums of float32 per-pass losses and a norm of the gradients above
        assert got["loss"] == pytest.approx(want["loss"], rel=ROUNDING_REL, abs=1e-7), k
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=ROUNDING_REL), k
    assert all(max_abs(g) > 0 for g in single[0]["grads"])  # A and B both learn
    assert not any(map(torch.equal, ranks[0][-1]["final"], ranks[0][0]["weights"]))  # moved


@pytest.mark.slow
def test_torchrun_cli_run_matches_the_single_process_run(tiny_llama_dir, tmp_path):
    """The whole ``gridrl-trainer run`` under ``torchrun --nproc-per-node 2`` (gloo): rank 0
    samples and broadcasts, both ranks train their share; bit for bit the steps, rewards,
    gradient norms and adapter of one process that trains in the ranks' layout
    (``--micro-batch-size 8``: one group a pass): each rank runs one process's passes
    (``PolicyPasses``), its loss scaled by the world size (2, exact), and DDP averages the
    two ranks' gradients (a sum of two, then a halving: exact). Against one process in the
    default layout the first step samples the same completions from the same adapter and
    its gradient norm agrees to float32 rounding; later steps start from weights that AdamW
    moved apart by +-lr in entries whose gradient was within rounding of zero (the layouts
    sum in different orders), so they are not compared (the layouts' gradients are, in
    test_trainer_update.py's micro-batch test)."""
    import subprocess

    from safetensors.torch import load_file
    from trainer_runs import BIN, ENV, records, run_args, write_task_files

    data, reward = write_task_files(tmp_path)
    single_dir, ddp_dir = tmp_path / "single", tmp_path / "ddp"
    steps = 6
    single = subprocess.run(run_args(tiny_llama_dir, data, reward, single_dir, 1),
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
    two = [r for r in records(ddp_dir) if r.get("step")]
    same_layout = [r for r in records(layout_dir) if r.get("step")]
    assert [r["step"] for r in two] == list(range(1, steps + 1))
    for key in ("step", "reward_mean", "grad_norm", "policy_version"):
        assert [r[key] for r in same_layout] == [r[key] for r in two], key
    w2 = load_file(ddp_dir / "adapter" / "adapter_model.safetensors")
    w3 = load_file(layout_dir / "adapter" / "adapter_model.safetensors")
    assert w2.keys() == w3.keys() and all(torch.equal(w3[k], w2[k]) for k in w2)
    (one,) = [r for r in records(single_dir) if r.get("step")]
    assert one["reward_mean"] == two[0]["reward_mean"]  # the same completions were sampled
    assert one["policy_version"] == two[0]["policy_version"]
    assert_within(abs(two[0]["grad_norm"] - one["grad_norm"]), ROUNDING_REL * one["grad_norm"],
                  "step 1 gradient norm")
