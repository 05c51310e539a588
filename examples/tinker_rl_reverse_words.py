"""An RL loop written against the official Tinker SDK, trained on gridrl: reverse-words with
GRPO-style group advantages and Tinker's ``importance_sampling`` loss.

    gridrl-trainer serve-api &                        # the trainer (+ --rollout nodes)
    TINKER_BASE_URL=http://127.0.0.1:8100 TINKER_API_KEY=tml-local \\
        python examples/tinker_rl_reverse_words.py --out runs/tinker-rl.json

Each step: sample a group of completions per prompt from the sampling client (processed
behaviour logprobs), grade them, ``forward_backward`` with ``importance_sampling``,
``optim_step``, save the weights and get the next sampling client. Every ``--eval-every`` steps
a greedy held-out eval (128 phrases, the eval of ``gridrl-trainer run``). The defaults are
``gridrl-trainer run``'s (2 prompts x 8, lr 3e-4, LoRA r16, AdamW betas (0.9, 0.999), gradient
clip 1.0, 24 new tokens), and the advantage of each token is the group advantage divided by
(completion length x sequences), the per-sequence mean GRPO uses, so the two runs compare
step for step. Figures: docs/benchmarks.md (``bench/tinker_facade.py``).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import tinker
from tinker import types

from gridrl.trainer.envs.chat import prompt_ids
from gridrl.trainer.envs.reverse import ReverseWords


def evaluate(sampler, tokenizer, task, prompts, max_tokens: int) -> float:
    """Mean reward of greedy completions of the held-out prompts."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [sampler.sample(types.ModelInput.from_ints(p), 1, params) for p in prompts]
    texts = [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True)
             for f in futures]
    items = task.eval_items()
    scores = task.score([i.prompt for i in items], texts, answer=[i.columns["answer"] for i in items])
    return float(np.mean(scores))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-tasks", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the per-step record here (JSON)")
    args = ap.parse_args(argv)

    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model=args.model, rank=args.rank,
                                                   seed=args.seed).result()
    tokenizer = training.get_tokenizer()
    task = ReverseWords(seed=args.seed, eval_size=args.eval_tasks)
    eval_prompts = [prompt_ids(tokenizer, i.messages) for i in task.eval_items()]
    adam = types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8,
                            grad_clip_norm=1.0)
    B, G = args.prompts_per_step, args.group_size
    sampler = training.save_weights_and_get_sampling_client().result()
    record: dict = {"args": vars(args), "steps": [],
                    "evals": [[0, evaluate(sampler, tokenizer, task, eval_prompts,
                                           args.max_tokens)]]}
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        items = [task.train_item((step - 1) * B + i) for i in range(B)]
        prompts = [prompt_ids(tokenizer, item.messages) for item in items]
        params = [types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0,
                                       seed=step * 1000 + i) for i in range(B)]
        groups = [sampler.sample(types.ModelInput.from_ints(p), G, params[i])
                  for i, p in enumerate(prompts)]
        data, rewards_all = [], []
        for item, prompt, group in zip(items, prompts, groups, strict=True):
            seqs = group.result().sequences
            texts = [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in seqs]
            rewards = np.array(task.score([item.prompt] * G, texts,
                                          answer=[item.columns["answer"]] * G))
            rewards_all += rewards.tolist()
            advantages = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)
            for seq, adv in zip(seqs, advantages, strict=True):
                tokens, n, k = prompt + seq.tokens, len(prompt) - 1, len(seq.tokens)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:],
                                    "logprobs": [0.0] * n + list(seq.logprobs),
                                    "advantages": [0.0] * n + [adv / (k * B * G)] * k}))
        fwd_bwd = training.forward_backward(data, "importance_sampling")
        optim = training.optim_step(adam)
        fwd_bwd.result(), optim.result()
        sampler = training.save_weights_and_get_sampling_client().result()
        record["steps"].append({"step": step, "seconds": time.perf_counter() - start,
                                "reward_mean": float(np.mean(rewards_all))})
        if step % args.eval_every == 0 or step == args.steps:
            score = evaluate(sampler, tokenizer, task, eval_prompts, args.max_tokens)
            record["evals"].append([step, score])
            print(f"step {step}: reward {np.mean(rewards_all):.3f}, eval {score:.3f}", flush=True)
    service.close("success").result()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
