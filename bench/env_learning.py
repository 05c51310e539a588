"""Benchmark 13: learning on an environment (multi-turn, tools, reasoning-gym), in process.

One process, ``--rollout local``-style: the torch trainer backend with the demo's settings
(SmolLM2-135M fp32, LoRA r16/alpha 32 all-linear, AdamW lr 3e-4, 2 prompts x 8 episodes a
step, temperature 1, clip 0.2), the environment's episodes through
:class:`gridrl.trainer.envs.source.EpisodeSource` over the backend's own sampler, the batch from
:func:`gridrl.trainer.grpo.batch.build_batch` with the environment's reward functions, one
update a step, and the greedy held-out eval (:class:`gridrl.trainer.evaluation.Evaluator`) every
``--eval-every`` steps, first- and second-attempt success apart where the environment reports
them. Prints a line per step and writes ``--out`` (JSON lines: steps and evals).

    python bench/env_learning.py --task reverse-words-retry --seed 0 [--steps 60]
    python bench/env_learning.py --task reasoning-gym:spell_backward \
        --task-params min_word_len=3,max_word_len=4 --seed 0

The trainer's own loop (``gridrl-trainer run --task ...``) is the product; this script is the
measurement, usable before that loop runs environments.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _common import machine

from gridrl.trainer.backends.base import create_backend
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.envs.episode import EpisodeLimits
from gridrl.trainer.envs.loading import make_environment
from gridrl.trainer.envs.source import EpisodeSource
from gridrl.trainer.evaluation import Evaluator
from gridrl.trainer.grpo.batch import build_batch
from gridrl.trainer.local import LocalRollout
from gridrl.trainer.rewards import RewardSet
from gridrl.trainer.rollouts import StepRollouts, group_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="reverse-words-retry")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--task-params", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-tasks", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--max-turns", type=int, default=None)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = TrainConfig(model=args.model, backend="torch", task=args.task,
                      task_params=args.task_params, lora_rank=16, lora_alpha=32.0, lr=args.lr,
                      steps=args.steps, max_tokens=args.max_tokens, eval_tasks=args.eval_tasks,
                      rollout=["local"], run_dir="unused", seed=args.seed,
                      threads=args.threads, prompts_per_step=args.prompts_per_step,
                      group_size=args.group_size).finalize()
    env = make_environment(cfg.task, seed=cfg.seed, eval_size=cfg.eval_tasks,
                           task_params=cfg.task_params)
    backend = create_backend(cfg)
    env.prepare(backend.tokenizer)
    limits = EpisodeLimits(max_turns=args.max_turns or env.max_turns, max_tokens=cfg.max_tokens)
    version = 0
    local = LocalRollout(backend, version=lambda: version)
    source = EpisodeSource(env, backend.tokenizer, local, limits)
    funcs = env.reward_funcs()
    rewards = RewardSet([(n, f) for n, f, _ in funcs], [w for *_, w in funcs])
    evaluator = Evaluator(backend, env, max_tokens=cfg.max_tokens, limits=limits)
    out = Path(args.out or f"env-learning-{cfg.task.replace(':', '-')}-s{cfg.seed}.jsonl")
    log = out.open("w")
    start = time.perf_counter()

    def evaluate(step: int) -> None:
        result = evaluator.run(version)
        record = {"eval_step": step, "score": result.score, "success": result.exact,
                  "stderr": result.stderr, "seconds": time.perf_counter() - start,
                  **result.metrics}
        log.write(json.dumps(record) + "\n")
        log.flush()
        extra = " ".join(f"{k} {v:.3f}" for k, v in result.metrics.items())
        print(f"eval @{step}: score {result.score:.3f} success {result.exact:.3f}"
              f"±{result.stderr:.3f} {extra} ({result.seconds:.0f} s)", flush=True)

    print(machine(), flush=True)
    evaluate(0)
    b = cfg.prompts_per_step
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        items = [env.train_item((step - 1) * b + i) for i in range(b)]
        groups, stats = source.generate(items, group_size=cfg.group_size,
                                        temperature=cfg.temperature,
                                        seed=group_seed(cfg.seed, 1_000_000 + step))
        roll = time.perf_counter() - t0
        batch = build_batch(step, StepRollouts(step=step, groups=groups, generate_s=roll), items,
                            source.prompt_ids(items), lineage={v: v for v in range(version + 1)},
                            bound=0, rewards=rewards, scale_rewards=cfg.scale_rewards,
                            advantage_eps=cfg.advantage_eps)
        loss = None
        if batch.sequences:
            loss = backend.update(batch.sequences).loss
            version += 1
        record = {"step": step, "reward": batch.reward_mean, "solved": batch.solved_fraction,
                  "roll_s": roll, "step_s": time.perf_counter() - t0, "loss": loss,
                  **stats.record(), **{f"reward/{k}": v for k, v in batch.reward_funcs.items()}}
        log.write(json.dumps(record) + "\n")
        log.flush()
        print(f"step {step}: reward {batch.reward_mean:.3f} solved {batch.solved_fraction:.2f} "
              f"turns {stats.turns_mean:.2f} model/env tokens {stats.model_tokens}/"
              f"{stats.env_tokens} {record['step_s']:.1f} s", flush=True)
        if step % args.eval_every == 0 or step == cfg.steps:
            evaluate(step)
    backend.close()
    print(f"{out}: {cfg.steps} steps in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
