"""Benchmark 6: the fused CPU kernels against oneDNN, product by product, on this CPU.

For SmolLM2-135M's four fused projections per layer (q/k/v 576 -> 960, o 576 -> 576, gate/up
576 -> 2 x 1536 with SwiGLU, down 1536 -> 576) at decode batches of 1-64 rows and a prefill
of 976 rows (16 prompts of 61 tokens): microseconds a call of the kernel
(``cpu_kernels.DecodeKernels.linear``, built with ``GRIDRL_CPU_KERNELS=1``) and of oneDNN's
prepacked product (the path the lean forward falls back to), and the ratio kernel / oneDNN;
and the kernel on bfloat16 weights (widened to float32 as they are read: half the bytes) against
the float32 kernel. Then the race :func:`gridrl.engine.backends.torch.cpu_kernels.race` runs
at load time by default, and what it decides here for float32 and bfloat16 weights.

    python bench/decode_kernels.py [--rows 1 8 16 64 976] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from _common import machine, table

SHAPES = {"qkv": (960, 576, False), "o": (576, 576, False), "gate_up": (3072, 576, True),
          "down": (576, 1536, False)}


def per_call_us(fn: Callable[[], object], budget_s: float = 0.5) -> float:
    """Best-of-5 microseconds a call, each round as many calls as fit in budget_s / 5."""
    fn()
    t0 = time.perf_counter()
    fn()
    calls = max(1, int(budget_s / 5 / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 976])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    os.environ["GRIDRL_CPU_KERNELS"] = "1"
    import torch

    from gridrl.engine.backends.torch import cpu_kernels
    from gridrl.engine.backends.torch.projection import Projection

    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine(), f"| {torch.get_num_threads()} torch threads")
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit(f"kernels unavailable: {cpu_kernels.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    with torch.inference_mode():
        for m in args.rows:
            for name, (n, k, swiglu) in SHAPES.items():
                w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
                packed = cpu_kernels.pack_weight(w, swiglu=swiglu)
                half = cpu_kernels.pack_weight(w, swiglu=swiglu, dtype=torch.bfloat16)
                fallback = Projection(w, swiglu=swiglu)  # oneDNN-prepacked on x86
                k_us = per_call_us(lambda x=x, packed=packed, n=n, swiglu=swiglu:
                                   kernels.linear(x, packed, n, swiglu=swiglu))
                o_us = per_call_us(lambda x=x, fallback=fallback: fallback(x))
                h_us = per_call_us(lambda x=x, half=half, n=n, swiglu=swiglu:
                                   kernels.linear(x, half, n, swiglu=swiglu))
                gbs = w.numel() * 4 / k_us / 1e3
                rows_out.append([m, name, f"{k_us:.0f}", f"{o_us:.0f}", f"{k_us / o_us:.2f}",
                                 f"{gbs:.1f}", f"{h_us:.0f}", f"{h_us / k_us:.2f}"])
        races = {dtype: cpu_kernels.race(kernels, dtype=dtype)
                 for dtype in (torch.float32, torch.bfloat16)}
    print(table(rows_out, ["rows", "product", "kernel us", "oneDNN us", "kernel / oneDNN",
                           "kernel GB/s (float32)", "kernel bf16 weights us",
                           "bf16 / float32 kernel"]))
    for dtype, (kernel_s, other_s) in races.items():
        other = cpu_kernels.fallback_name(dtype)
        verdict = "kernels" if kernel_s <= cpu_kernels.KERNEL_HANDICAP * other_s else other
        print(f"load-time race, {str(dtype)[6:]} weights (cpu_kernels.RACE_SHAPES): kernels "
              f"{kernel_s * 1e3:.2f} ms, {other} {other_s * 1e3:.2f} ms (kernels unless > "
              f"{cpu_kernels.KERNEL_HANDICAP}x) -> by default the lean forward uses {verdict}")


if __name__ == "__main__":
    main()
