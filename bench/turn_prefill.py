"""Benchmark 12: turn 2 of a multi-turn episode on a torch node, with and without the prefix
cache.

Loads SmolLM2-135M (fp32, lean forward) as a node backend twice, with ``--prefix-cache-mb``'s
cache and without. Turn 1: the ``reverse-words-retry`` prompt of ``--episodes`` items, ``--group``
samples each, ``--max-tokens`` new tokens, ``keep_cache``. Turn 2: each sample's episode so far
(prompt, its sampled ids, the environment's feedback as the chat template's delta) as its own
request. Times, best of ``--repeats``: turn 2's prefill (``max_tokens=1``: prefill and one draw)
and turn 2 whole (``--max-tokens``, greedy), with the cache (a fresh turn 1 before each repeat, so every
repeat starts from what an episode leaves) and without; checks both sample the same tokens.

    python bench/turn_prefill.py [--episodes 2] [--group 8] [--max-tokens 24] [--repeats 3]

Baseline: the same node without the cache (prefills the whole episode again).
"""

from __future__ import annotations

import argparse
import time

from _common import machine, table

from gridrl.engine.backends.torch.backend import TorchBackend
from gridrl.engine.contract import SamplingConfig, SequenceRequest
from gridrl.models import resolve_model
from gridrl.trainer.envs.chat import ChatDelta, prompt_ids
from gridrl.trainer.envs.reverse import ReverseWordsRetry, feedback


def turn_two(backend: TorchBackend, env: ReverseWordsRetry, episodes: int, group: int,
             max_tokens: int) -> list[list[int]]:
    """Turn 1 (kept in the cache) and the prompts of turn 2."""
    tok = backend.tokenizer
    delta = ChatDelta(tok)
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=1.0)
    prompts = []
    for e in range(episodes):
        item = env.train_item(e)
        prompt = prompt_ids(tok, item.messages)
        results = backend.generate([SequenceRequest(prompt, sampling, seed=100 * e + j,
                                                    keep_cache=True) for j in range(group)], None)
        for r in results:
            reply = tok.decode(r.token_ids, skip_special_tokens=True)
            new = [{"role": "user", "content": feedback(reply, item.columns["answer"])}]
            prompts.append(prompt + r.token_ids
                           + delta.append(list(item.messages), r.token_ids,
                                          r.finish_reason == "stop", new))
    return prompts


def timed(backend: TorchBackend, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    """Turn 2, greedy (the cost of a sampled turn; greedy so that the two nodes' tokens can be
    compared: sampled at T=1, a logprob that differs by float rounding (~1e-5 on this model)
    moves a draw across a boundary about once in a few hundred tokens)."""
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=0.0)
    start = time.perf_counter()
    out = backend.generate([SequenceRequest(p, sampling, seed=i) for i, p in enumerate(prompts)],
                           None)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-cache-mb", type=int, default=256)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    env = ReverseWordsRetry(seed=0)
    cold = TorchBackend.from_pretrained(model_dir, dtype="float32")
    warm = TorchBackend.from_pretrained(model_dir, dtype="float32",
                                        prefix_cache_bytes=args.prefix_cache_mb << 20)
    rows = []
    same = True
    for label, budget in (("turn 2 prefill (1 token)", 1), ("turn 2 whole", args.max_tokens)):
        best = {"cold": float("inf"), "warm": float("inf")}
        reused = tokens = 0
        for _ in range(args.repeats):
            warm.prefix_cache.clear()
            prompts = turn_two(warm, env, args.episodes, args.group, args.max_tokens)
            before = warm.prefix_cache.stats.reused_tokens
            s_warm, out_warm = timed(warm, prompts, budget)
            reused = warm.prefix_cache.stats.reused_tokens - before
            tokens = sum(len(p) for p in prompts)
            s_cold, out_cold = timed(cold, prompts, budget)
            same &= [r.token_ids for r in out_warm] == [r.token_ids for r in out_cold]
            best["warm"] = min(best["warm"], s_warm)
            best["cold"] = min(best["cold"], s_cold)
        rows.append([label, str(len(prompts)), str(tokens), str(reused),
                     f"{best['cold']:.3f}", f"{best['warm']:.3f}",
                     f"{best['cold'] / best['warm']:.2f}x"])
        print(" | ".join(rows[-1]), flush=True)
    print(machine())
    print(f"{args.episodes} items x {args.group} samples, {args.max_tokens} new tokens a turn, "
          f"fp32 lean forward, best of {args.repeats}; same tokens with and without the cache: "
          f"{'yes' if same else 'NO'}")
    print(table(rows, ["what", "requests", "turn-2 prompt tokens", "tokens reused",
                       "s, no cache (baseline)", "s, prefix cache", "speed-up"]))


if __name__ == "__main__":
    main()
