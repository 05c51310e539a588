"""Benchmark: a rollout node's tokens/s with rows of 1, 2 and 4 adapters in one batch (issue 46).

The torch backend's lean forward on SmolLM2-135M (float32, this CPU), with 4 random rank-16
LoRA adapters on every linear layer (peft's layout, as a trainer pushes them). One batch of
``--rows`` sequences (one prompt per row, sampled at temperature 1, ``--tokens`` new tokens
each, seeds fixed, no stop token) decoded three ways:

- ``one adapter``: every row with adapter 0 (``Backend.generate``) -- the reference;
- ``mixed``: the rows spread over k adapters in one batch (``TorchBackend.generate_mixed``: one
  base product per projection for the batch, one product over the k adapters' factors stacked
  along the rank, each row reading its own -- S-LoRA / Punica batching);
- ``swapping``: what a node did before: one adapter at a time, each adapter's rows a batch of
  their own, one after the other (``Backend.generate_mixed``'s per-group default).

Completion tokens per second (median of ``--repeats`` runs, the three ways interleaved so that
load from other processes hits them alike), and the ratios mixed / one adapter (goal: >= 0.85
at 4 adapters) and mixed / swapping.

    python bench/multi_adapter.py [--rows 8] [--tokens 64] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import cpu_flags, load_average, machine, table


def make_adapters(model_dir: str, root: Path, count: int) -> list[Path]:
    """``count`` random rank-16 LoRAs on every linear layer (peft's layout), one model load."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    out = []
    for i in range(count):
        torch.manual_seed(i)
        for name, p in peft.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(p, std=0.02)
        peft.save_pretrained(str(root / f"a{i}"))
        out.append(root / f"a{i}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()

    import torch

    from gridrl.engine.backends.torch.backend import TorchBackend
    from gridrl.engine.contract import Backend, SamplingConfig, SequenceRequest
    from gridrl.models import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2-135m-instruct", progress=False)
    backend = TorchBackend.from_pretrained(model_dir)
    lean, _ = backend.adapters.lean_factors([])
    with tempfile.TemporaryDirectory() as tmp:
        handles = [backend.load_adapter(path, f"a{i}")
                   for i, path in enumerate(make_adapters(model_dir, Path(tmp), 4))]
    tokenizer = backend.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a short story about the number {i}."}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        for i in range(args.rows)]
    sampling = SamplingConfig(max_tokens=args.tokens, temperature=1.0)
    backend.eos_token_ids = frozenset()  # every row decodes --tokens tokens
    batch = [SequenceRequest(p, sampling, seed=100 + i) for i, p in enumerate(prompts)]

    def timed(fn) -> float:
        t0 = time.perf_counter()
        results = fn()
        seconds = time.perf_counter() - t0
        return sum(len(r.token_ids) for r in results) / seconds

    def spread(k: int) -> list:
        return [handles[i % k] for i in range(args.rows)]

    ways = {"one adapter": lambda: backend.generate(batch, handles[0])}
    for k in (1, 2, 4):
        ways[f"mixed {k}"] = lambda k=k: backend.generate_mixed(batch, spread(k))
        if k > 1:
            ways[f"swapping {k}"] = lambda k=k: Backend.generate_mixed(backend, batch, spread(k))
    timed(ways["one adapter"])  # warm-up
    timed(ways["mixed 4"])
    runs: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(args.repeats):
        for way, fn in ways.items():
            runs[way].append(timed(fn))
    tps = {w: statistics.median(v) for w, v in runs.items()}
    one = tps["one adapter"]
    rows = [["1 (one adapter, generate)", f"{one:.0f}", "1.00", "-"]]
    for k in (1, 2, 4):
        mixed = tps[f"mixed {k}"]
        swap = tps.get(f"swapping {k}")
        rows.append([f"{k} mixed in one batch", f"{mixed:.0f}", f"{mixed / one:.2f}",
                     f"{mixed / swap:.2f}" if swap else "-"])
        if swap:
            rows.append([f"{k} swapping (a batch per adapter)", f"{swap:.0f}",
                         f"{swap / one:.2f}", "1.00"])
    print(f"# multi-adapter batches, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"machine: {machine()}; load {load_average()}; torch threads "
          f"{torch.get_num_threads()}; products: {lean.products}")
    print(f"cpu flags: {cpu_flags()}")
    print(f"SmolLM2-135M float32 lean forward, rank-16 all-linear LoRAs, {args.rows} rows x "
          f"{args.tokens} tokens, temperature 1, median of {args.repeats}")
    print(table(rows, ["adapters in the batch", "tokens/s", "x one adapter",
                       "x swapping"]))


if __name__ == "__main__":
    main()
