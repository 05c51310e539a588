"""Benchmark 4: one demo-shaped GRPO step on each trainer backend, sampling then update.

For each ``--backend`` (default: torch and mlx): load SmolLM2-135M (fp32) with a r16
all-linear LoRA, then per step sample 2 reverse-words prompts x 8 completions x 24 tokens
with ``TrainerBackend.generate`` (``--rollout local``) and run ``TrainerBackend.update`` on
them; prints wall and process-CPU seconds of each phase and the MLX/torch ratio of the step.

    python bench/trainer_step.py [--backend torch --backend mlx] [--steps 2] [--model M]
    python bench/trainer_step.py --backend torch --update-dtype float32 --update-dtype bfloat16
    python bench/trainer_step.py --compare-logits 4
    python bench/trainer_step.py --background-load 1 --steps 5
    python bench/trainer_step.py --multi-turn 5 [--batches /tmp/batches.pkl]

``--profile`` (torch only): one demo-shaped batch, a warm-up update, then one update under
``torch.profiler`` per ``--update-dtype``: CPU seconds by kind of work (products, attention,
casts, the head's log-softmax, elementwise, the optimizer) and the top operators.

``--background-load N`` (torch only): the update alone and beside N busy processes, with
``--threads 0`` (core sharing) and with a fixed thread per core; the loaded / alone ratios.

``--multi-turn N`` (torch only): 16 reverse-words-retry episodes and 16 reverse-words samples,
sampled once, then N updates of each interleaved in one process, padded, packed with the
row-wide mask and packed with attention per segment; the median update seconds per trained
model token and the retry / single-turn ratio (issue 45: <= 1.3x).

``--compare-logits N`` (torch only): sample one demo-shaped batch, then alternate N updates
on it computing the completion logprobs from the final hidden states in chunks
(``grpo_torch.head_logprobs``, the default for plain-head models) and N from the full
(n, C, V) logits (the baseline); prints the median update seconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import time

import numpy as np
from _common import BackgroundLoad, load_average, machine, table

from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.backends.base import TrainSequence, create_backend
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.envs.chat import prompt_ids
from gridrl.trainer.envs.reverse import ReverseWords


def demo_backend(backend_name: str, model: str, update_dtype: str = "float32",
                 threads: int = 0):
    """The demo's trainer backend: ``model`` in fp32 with a r16 all-linear LoRA, local sampler;
    the update in ``update_dtype`` (``--update-dtype``); ``threads`` torch threads (0: torch's
    default)."""
    cfg = TrainConfig(model=model, backend=backend_name, lora_rank=16,
                      lora_alpha=32.0, lr=3e-4, steps=60, max_tokens=24, temperature=1.0,
                      rollout=["local"], run_dir="unused", seed=0,
                      update_dtype=update_dtype, threads=threads).finalize()
    return create_backend(cfg)


def demo_prompts(backend, task: ReverseWords, step: int) -> list[list[int]]:
    """Step ``step``'s 2 reverse-words prompts, each repeated for a group of 8."""
    items = [task.train_item(2 * step + i) for i in range(2)]
    return [prompt_ids(backend.tokenizer, it.messages) for it in items for _ in range(8)]


def sample(backend, prompts: list[list[int]]):
    """16 completions of up to 24 tokens at temperature 1 on the backend's own sampler."""
    return backend.generate(prompts, SamplingConfig(max_tokens=24, temperature=1.0),
                            list(range(16)))


def sequences(prompts, results, seed: int) -> list[TrainSequence]:
    """The samples as training sequences with standard-normal advantages (groups of 8)."""
    adv = np.random.default_rng(seed).standard_normal(len(prompts))
    return [TrainSequence(tuple(p), tuple(r.token_ids), tuple(r.logprobs), float(a), i // 8)
            for i, (p, r, a) in enumerate(zip(prompts, results, adv, strict=True))]


def measure(backend_name: str, steps: int, model: str, update_dtype: str = "float32"
            ) -> list[dict]:
    """Per step: sample and update wall/CPU seconds on ``backend_name``, and the mismatch KL
    between the (float32) sampler and the update's logprobs."""
    backend = demo_backend(backend_name, model, update_dtype)
    task = ReverseWords(seed=0, min_words=3, max_words=4)
    rows = []
    try:
        for step in range(steps):
            prompts = demo_prompts(backend, task, step)
            w0, c0 = time.perf_counter(), time.process_time()
            results = sample(backend, prompts)
            w1, c1 = time.perf_counter(), time.process_time()
            stats = backend.update(sequences(prompts, results, step))
            w2, c2 = time.perf_counter(), time.process_time()
            rows.append({"backend": backend_name, "update dtype": update_dtype,
                         "step": step + 1,
                         "sample s": round(w1 - w0, 2), "sample cpu s": round(c1 - c0, 2),
                         "update s": round(w2 - w1, 2), "update cpu s": round(c2 - c1, 2),
                         "step s": round(w2 - w0, 2), "mismatch kl": f"{stats.mismatch_kl:.1e}"})
            print(rows[-1], flush=True)
    finally:
        backend.close()
    return rows


def update_beside_load(steps: int, model: str, busy: int) -> None:
    """Update seconds per step of the torch trainer alone and beside ``busy`` processes that
    each keep a core busy (:class:`_common.BackgroundLoad`): with ``--threads 0`` (the cores
    others leave free, re-decided between micro-batches, 4 micro-batches a step) and with a
    fixed thread count per core (what ``--threads 0`` did before); the median after step 1
    of each, and the loaded / alone ratios."""
    cores = os.cpu_count() or 1
    task = ReverseWords(seed=0, min_words=3, max_words=4)
    rows, medians = [], {}
    for threads, load in ((0, 0), (0, busy), (cores, 0), (cores, busy)):
        backend = demo_backend("torch", model, threads=threads)
        backend.update_cfg = dataclasses.replace(backend.update_cfg, micro_batch_size=4)
        prompts = demo_prompts(backend, task, 0)
        seqs = sequences(prompts, sample(backend, prompts), 0)
        times = []
        try:
            with BackgroundLoad(load):
                for step in range(steps):
                    t0 = time.perf_counter()
                    stats = backend.update(seqs)
                    times.append(time.perf_counter() - t0)
                    print({"threads": threads or "0 (shared)", "busy": load, "step": step + 1,
                           "update s": round(times[-1], 2), "ended with": stats.threads,
                           "load": load_average()}, flush=True)
        finally:
            backend.close()
        medians[(threads, load)] = float(np.median(times[1:] or times))
        rows.append([f"{threads} ({'shared' if not threads else 'fixed'})", str(load),
                     f"{medians[(threads, load)]:.2f}"])
    print(table(rows, ["--threads", "busy cores", "median update s (after step 1)"]))
    for threads in (0, cores):
        print(f"--threads {threads}: beside {busy} busy / alone = "
              f"{medians[(threads, busy)] / medians[(threads, 0)]:.2f}x")


def retry_sequences(backend, step: int) -> list[TrainSequence]:
    """Step ``step``'s 16 reverse-words-retry episodes (2 prompts x 8, two turns of up to 24
    tokens each, the environment's feedback between them), sampled on the backend's own
    sampler, as training sequences (prompt + every turn, the loss mask on the model's tokens)
    with standard-normal advantages."""
    from gridrl.trainer.envs import episode
    from gridrl.trainer.envs.reverse import ReverseWordsRetry
    from gridrl.trainer.envs.source import EpisodeSource
    from gridrl.trainer.local import LocalRollout

    env = ReverseWordsRetry(seed=0)
    source = EpisodeSource(env, backend.tokenizer, LocalRollout(backend, version=lambda: 0),
                           episode.EpisodeLimits(max_turns=2, max_tokens=24))
    items = [env.train_item(2 * step + i) for i in range(2)]
    groups, _ = source.generate(items, SamplingConfig(max_tokens=24, temperature=1.0),
                                group_size=8, seed=step)
    prompts = source.prompt_ids(items)
    adv = np.random.default_rng(step).standard_normal(16)
    samples = [(b, s) for b, g in enumerate(groups) for s in g.samples]
    return [TrainSequence(tuple(prompts[b]), tuple(s.token_ids), tuple(s.logprobs), float(a), b,
                          loss_mask=None if s.loss_mask is None else tuple(s.loss_mask))
            for (b, s), a in zip(samples, adv, strict=True)]


#: --multi-turn's update paths: name -> UpdateConfig settings
MULTI_TURN_PATHS = {
    "padded": {"pack": False},
    "packed, dense mask": {"pack": True, "segment_attention": False},
    "packed, per segment": {"pack": True, "segment_attention": True},
}


def multi_turn(repeats: int, model: str, batches_file: str | None = None) -> None:
    """Update seconds per trained model token of reverse-words-retry (16 two-turn episodes)
    against reverse-words (16 one-turn samples), both sampled once on the demo backend, then
    ``repeats`` updates of each, interleaved in one process (so a load that comes and goes hits
    both alike), on each of :data:`MULTI_TURN_PATHS`: padded (the shared-prefix KV cache and
    right-padded completions), packed with the row-wide block-diagonal mask, packed with
    attention per segment (``UpdateConfig.segment_attention``); prints the median seconds per
    token of each and the retry / single-turn ratios (issue 45's goal: <= 1.3x)."""
    backend = demo_backend("torch", model)
    if batches_file and os.path.exists(batches_file):
        with open(batches_file, "rb") as f:
            batches = pickle.load(f)
        print(f"batches read from {batches_file}", flush=True)
    else:
        task = ReverseWords(seed=0, min_words=3, max_words=4)
        prompts = demo_prompts(backend, task, 0)
        batches = {"reverse-words": sequences(prompts, sample(backend, prompts), 0),
                   "reverse-words-retry": retry_sequences(backend, 0)}
        if batches_file:
            with open(batches_file, "wb") as f:
                pickle.dump(batches, f)
    for name, seqs in batches.items():
        trained = sum(s.trained_tokens for s in seqs)
        forwarded = sum(len(s.completion_ids) for s in seqs)
        widest = max(len(s.completion_ids) for s in seqs)
        print({"batch": name, "sequences": len(seqs), "trained model tokens": trained,
               "completion tokens (env included)": forwarded,
               "completion slots padded": len(seqs) * widest,
               "prompt tokens": sum(len(s.prompt_ids) for s in seqs),
               "distinct prompt tokens": sum(len(p) for p in {s.prompt_ids for s in seqs})},
              flush=True)
    base = backend.update_cfg
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(repeats + 1):  # round 0: warm-up, not counted
            for path, settings in MULTI_TURN_PATHS.items():
                backend.update_cfg = dataclasses.replace(base, **settings)
                for name, seqs in batches.items():
                    t0 = time.perf_counter()
                    stats = backend.update(seqs)
                    dt = time.perf_counter() - t0
                    print({"round": r, "batch": name, "update": path, "update s": round(dt, 3),
                           "s per 1k trained tokens": round(1000 * dt / stats.tokens, 3),
                           "micro-batches": stats.micro_batches, "load": load_average()},
                          flush=True)
                    if r:
                        times.setdefault((name, path), []).append(dt / stats.tokens)
    finally:
        backend.close()
    rows = [[name, path, str(len(v)), " ".join(f"{1000 * x:.2f}" for x in v),
             f"{1000 * float(np.median(v)):.2f}"] for (name, path), v in times.items()]
    print(table(rows, ["batch", "update", "runs", "s per 1k trained model tokens",
                       "median"]))

    def median(name: str, path: str) -> float:
        return float(np.median(times[(name, path)]))

    for path in MULTI_TURN_PATHS:
        ratio = median("reverse-words-retry", path) / median("reverse-words", path)
        print(f"{path}: reverse-words-retry / reverse-words, update s per trained model "
              f"token = {ratio:.2f}x (goal <= 1.3x)")
    for name in batches:
        for path in list(MULTI_TURN_PATHS)[1:]:
            print(f"{name}: {path} / padded = "
                  f"{median(name, path) / median(name, 'padded'):.2f}x")


def compare_logits(repeats: int, model: str) -> None:
    """Median update seconds with the fused head against full logits, alternating."""
    backend = demo_backend("torch", model)
    head = backend.policy.head_weight
    if head is None:
        raise SystemExit(f"{model} has no plain output head: nothing to compare")
    try:
        prompts = demo_prompts(backend, ReverseWords(seed=0, min_words=3, max_words=4), 0)
        seqs = sequences(prompts, sample(backend, prompts), 0)
        backend.update(seqs)  # warm-up
        times: dict[str, list[float]] = {"full logits (baseline)": [], "hidden + head_logprobs": []}
        for _ in range(repeats):
            for name in times:
                backend.policy.head_weight = head if name.startswith("hidden") else None
                t0 = time.perf_counter()
                backend.update(seqs)
                times[name].append(time.perf_counter() - t0)
    finally:
        backend.policy.head_weight = head
        backend.close()
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"{sum(len(s.completion_ids) for s in seqs)} completion tokens, 2 prompts x 8")
    print(table([[k, f"{med[k]:.2f}", " ".join(f"{t:.2f}" for t in v)]
                 for k, v in times.items()], ["logprobs from", "median update s", "each"]))
    base, fused = med["full logits (baseline)"], med["hidden + head_logprobs"]
    print(f"hidden + head_logprobs / full logits: {fused / base:.2f}x")


#: operator name prefixes -> the kind of work they are (first match wins)
KINDS = (("casts", ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone")),
         ("products (mm, linear)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear",
                                    "aten::matmul", "mkldnn", "aten::_mkl")),
         ("attention", ("aten::_scaled_dot_product", "aten::scaled_dot_product",
                        "aten::_flash_attention", "aten::_efficient_attention")),
         ("log-softmax / the head's logprobs", ("aten::_log_softmax", "aten::log_softmax",
                                                "aten::logsumexp", "aten::gather")),
         ("optimizer", ("aten::_foreach", "Optimizer.step", "aten::addcdiv",
                        "aten::lerp", "aten::sqrt")),
         ("elementwise and the rest", ("",)))


def profile(model: str, dtypes: list[str], threads: int = 0) -> None:
    """Where an update's CPU time goes, per update dtype (see the module docstring)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for dtype in dtypes:
        backend = demo_backend("torch", model, dtype, threads)
        try:
            prompts = demo_prompts(backend, ReverseWords(seed=0, min_words=3, max_words=4), 0)
            seqs = sequences(prompts, sample(backend, prompts), 0)
            backend.update(seqs)  # warm-up: the bfloat16 weight copies, allocators
            t0 = time.perf_counter()
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                backend.update(seqs)
            wall = time.perf_counter() - t0
        finally:
            backend.close()
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in events) / 1e6
        kinds = {name: 0.0 for name, _ in KINDS}
        for e in events:
            kind = next(n for n, prefixes in KINDS if e.key.startswith(prefixes))
            kinds[kind] += e.self_cpu_time_total / 1e6
        print(f"\nupdate dtype {dtype}: {wall:.2f} s wall (profiled), {total:.2f} s of "
              f"operator self CPU time, {sum(len(s.completion_ids) for s in seqs)} "
              "completion tokens")
        print(table([[k, f"{v:.2f}", f"{v / total:.0%}"] for k, v in kinds.items()],
                    ["kind", "self CPU s", "share"]))
        top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
        print(table([[e.key, str(e.count), f"{e.self_cpu_time_total / 1e6:.3f}"] for e in top],
                    ["operator", "calls", "self CPU s"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", choices=["torch", "mlx"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--update-dtype", action="append", choices=["float32", "bfloat16"],
                        help="torch: the update's dtype (repeatable; default float32)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of --profile (0: torch's default)")
    parser.add_argument("--profile", action="store_true",
                        help="torch: where one update's time goes, per --update-dtype")
    parser.add_argument("--compare-logits", type=int, default=0, metavar="N",
                        help="torch: alternate N updates with and without the fused head")
    parser.add_argument("--background-load", type=int, default=0, metavar="N",
                        help="torch: update seconds alone and beside N busy processes")
    parser.add_argument("--multi-turn", type=int, default=0, metavar="N",
                        help="torch: N interleaved updates each of reverse-words-retry and "
                             "reverse-words, packed and padded; s per trained model token")
    parser.add_argument("--batches", metavar="PATH",
                        help="--multi-turn: read the two sampled batches from PATH (a pickle) "
                             "when it exists, else sample them and write them there")
    args = parser.parse_args()
    print(machine())
    if args.multi_turn:
        multi_turn(args.multi_turn, args.model, args.batches)
        return
    if args.background_load:
        update_beside_load(max(args.steps, 3), args.model, args.background_load)
        return
    if args.profile:
        profile(args.model, args.update_dtype or ["float32", "bfloat16"], args.threads)
        return
    if args.compare_logits:
        compare_logits(args.compare_logits, args.model)
        return
    rows = [r for b in (args.backend or ["torch", "mlx"])
            for dtype in (args.update_dtype or ["float32"])
            for r in measure(b, args.steps, args.model, dtype)]
    header = list(rows[0])
    print(table([[str(r[k]) for k in header] for r in rows], header))
    last = {r["backend"]: r["step s"] for r in rows if r["update dtype"] == "float32"}
    update = {d: float(np.median([r["update s"] for r in rows if r["backend"] == "torch"
                                  and r["update dtype"] == d and r["step"] > 1]))
              for d in ("float32", "bfloat16")
              if any(r["update dtype"] == d and r["step"] > 1 for r in rows)}
    if len(update) == 2:
        print(f"torch update, bfloat16 / float32 (median after step 1): "
              f"{update['bfloat16'] / update['float32']:.2f}x")
    if {"torch", "mlx"} <= set(last):
        print(f"mlx / torch, last step: {last['mlx'] / last['torch']:.2f}x")


if __name__ == "__main__":
    main()
