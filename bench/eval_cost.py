"""Benchmark 5: the trainer's held-out eval, its cost against the eval size and a step.

Loads SmolLM2-135M (fp32) with the demo's r16 all-linear LoRA as the torch trainer backend,
runs one demo-shaped GRPO step (2 prompts x 8 samples x 24 tokens sampled on the same backend,
then the update) so the table can say what an eval costs in steps, builds the demo's task
(reverse-words, 3-4 words) and times ``Evaluator.run`` -- batched greedy decoding of every
held-out prompt on the trainer's own weights, ``--max-tokens`` new tokens -- for each
``--sizes`` (default 16, 64, 280), best of ``--repeats``, with every prompt prefilled whole
(``shared_prefix=False``, the eval before) and with the prompts' common prefix (the system
prompt) prefilled once, alternating; checks that both give the same score and examples.

    python bench/eval_cost.py [--sizes 16 --sizes 64 --sizes 280] [--repeats 2] [--model M]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import machine, table

from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.backends.base import TrainSequence, create_backend
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.envs.chat import prompt_ids
from gridrl.trainer.envs.reverse import ReverseWords
from gridrl.trainer.evaluation import Evaluator


def step_seconds(backend, task: ReverseWords, repeats: int) -> float:
    """Best wall seconds of one demo-shaped step: sample 2 x 8 x 24 tokens, then update."""
    best = float("inf")
    for step in range(repeats):
        items = [task.train_item(2 * step + i) for i in range(2)]
        prompts = [prompt_ids(backend.tokenizer, it.messages) for it in items for _ in range(8)]
        start = time.perf_counter()
        results = backend.generate(prompts, SamplingConfig(max_tokens=24, temperature=1.0),
                                   list(range(16)))
        adv = np.random.default_rng(step).standard_normal(16)
        backend.update([TrainSequence(tuple(p), tuple(r.token_ids), tuple(r.logprobs),
                                      float(a), i // 8)
                        for i, (p, r, a) in enumerate(zip(prompts, results, adv, strict=True))])
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, action="append")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24, help="the demo's")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    sizes = args.sizes or [16, 64, 280]
    cfg = TrainConfig(model=args.model, backend="torch", lora_rank=16, lora_alpha=32.0,
                      lr=3e-4, steps=60, max_tokens=args.max_tokens, rollout=["local"],
                      run_dir="unused", seed=0).finalize()
    backend = create_backend(cfg)
    try:
        step = step_seconds(backend, ReverseWords(seed=0, min_words=3, max_words=4),
                            args.repeats)
        rows = []
        for size in sizes:
            task = ReverseWords(seed=0, min_words=3, max_words=4, eval_size=size)
            seconds: dict[bool, list[float]] = {False: [], True: []}
            results = {}
            for _ in range(args.repeats):
                for shared in (False, True):
                    evaluator = Evaluator(backend, task, max_tokens=args.max_tokens,
                                          shared_prefix=shared)
                    results[shared] = evaluator.run(policy_version=1)
                    seconds[shared].append(results[shared].seconds)
            same = all(getattr(results[False], k) == getattr(results[True], k)
                       for k in ("score", "exact", "examples"))
            plain, fast = min(seconds[False]), min(seconds[True])
            rows.append([str(size), f"{results[True].score:.3f}",
                         f"{results[True].stderr:.3f}", f"{plain:.2f}", f"{fast:.2f}",
                         f"{plain / fast:.2f}x", f"{fast / size * 1e3:.0f}",
                         f"{plain / step:.2f}", f"{fast / step:.2f}",
                         "yes" if same else "NO"])
            print(rows[-1], flush=True)
    finally:
        backend.close()
    print(machine())
    print(f"one demo-shaped step (sample 2 x 8 x 24 tokens + update), best of {args.repeats}: "
          f"{step:.2f} s; eval: greedy, {args.max_tokens} new tokens, best of {args.repeats}")
    print(table(rows, ["eval prompts", "score", "stderr", "eval s, whole prompts",
                       "eval s, shared prefix", "speed-up", "ms / prompt (shared)",
                       "eval / step (whole)", "eval / step (shared)", "same results"]))


if __name__ == "__main__":
    main()
