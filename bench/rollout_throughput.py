"""Benchmark 1: rollout throughput, one group of 8 x 40 new tokens on the bundled model.

Compares, in one run:
- the baseline: a plain in-process batched decode loop over the transformers model with a KV
  cache (fp32, the loop anyone would write first; ~72 tok/s on the reference 2-core machine);
- the torch rollout node through gRPC (``gridrl-rollout serve``): the lean llama forward in fp32
  (also with a rank-16 all-linear LoRA adapter serving) and bf16, and the transformers forward
  (``--forward transformers``) in fp32 for comparison;
- the MLX rollout node through gRPC (Linux CPU through mlx[cpu] is slow; fewer tokens);
and prints tok/s, the ratio to the baseline, and two ceilings for the batch size and precision
used: the memory-bandwidth bound (every decode step reads all weights once: batch * bandwidth /
weight bytes) and the compute bound (a token costs ~2 FLOPs a parameter: GEMM peak FLOP/s /
(2 * params), the peak measured with a large square product in the same run).

    python bench/rollout_throughput.py [--repeats 3] [--skip-mlx] [--secure]

``--secure``: the nodes serve mutual TLS and check a trainer-scoped credential, as across
machines.

A second table gives each node's resident memory (RSS from /proc: after start-up, after the
decoding above, and its peak) against the bytes of its weights in the dtype it serves: the
ratio RSS / weights, and the same for the model's part, RSS minus the runtime floor (RSS of a
fresh interpreter with the node's libraries imported and the tokenizer loaded, no model).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import (
    Channels,
    Proc,
    machine,
    matmul_gflops,
    read_bandwidth_gbs,
    resident_mb,
    runtime_floor_mb,
    table,
)

PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm."
N, MAX_TOKENS = 8, 40


def baseline_loop(model_dir: str, repeats: int) -> tuple[float, int]:
    """Plain HF loop: prefill the batch, then one forward per token with the KV cache,
    multinomial sampling at temperature 1, stop rows at eos. Returns (best tok/s, params)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"].repeat(N, 1)
    best = 0.0
    for r in range(repeats):
        torch.manual_seed(r)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model(ids, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
            done = torch.zeros(N, dtype=torch.bool)
            produced = 0
            for _ in range(MAX_TOKENS):
                nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1)
                produced += int((~done).sum())
                done |= nxt.squeeze(1) == tok.eos_token_id
                if done.all():
                    break
                out = model(nxt, past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[:, -1]
        best = max(best, produced / (time.perf_counter() - t))
    return best, sum(p.numel() for p in model.parameters())


def save_random_adapter(model_dir: str, out: Path) -> None:
    """A rank-16 LoRA on every linear layer with non-zero B (as after training), peft files."""
    import torch

    from gridrl.trainer.policy import LoraSettings, load_policy

    policy = load_policy(model_dir, lora=LoraSettings(rank=16, alpha=32), seed=0)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    policy.save_adapter(out)


def serve_adapter(address: str, path: str, security=None) -> None:
    """ReloadAdapter(path) on the node: it serves that adapter from then on."""
    from gridrl.common.channel import dial
    from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

    stub = rollout_pb2_grpc.RolloutServiceStub(dial(address, security))
    reply = stub.ReloadAdapter(rollout_pb2.ReloadAdapterRequest(path=path), timeout=120)
    assert reply.serving.name, reply


def node_throughput(address: str, repeats: int, max_tokens: int, n: int = N,
                    security=None) -> tuple[float, float]:
    """Generate through gRPC; returns (best tok/s, mean completion length)."""
    from gridrl.common.channel import dial
    from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    stub = rollout_pb2_grpc.RolloutServiceStub(dial(address, security))
    req = rollout_pb2.GenerateRequest(
        prompt_text=PROMPT, apply_chat_template=True,
        sampling=common_pb2.SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0))
    stub.Generate(req, timeout=600)  # warm-up
    best, lengths = 0.0, []
    for r in range(repeats):
        req.sampling.seed = r + 1
        t = time.perf_counter()
        resp = stub.Generate(req, timeout=600)
        dt = time.perf_counter() - t
        tokens = sum(len(s.token_ids) for s in resp.samples)
        lengths.append(tokens / n)
        best = max(best, tokens / dt)
    return best, statistics.mean(lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-mlx", action="store_true")
    ap.add_argument("--mlx-tokens", type=int, default=8, help="new tokens per MLX sample")
    ap.add_argument("--secure", action="store_true",
                    help="mutual TLS and a scoped credential, as across machines")
    args = ap.parse_args()
    channels = Channels(args.secure)

    from gridrl.models import resolve_model

    model_dir = str(resolve_model("smollm2-135m-instruct"))
    bw = read_bandwidth_gbs()
    flops = {dtype: matmul_gflops(dtype) for dtype in ("float32", "bfloat16")}
    base, params = baseline_loop(model_dir, args.repeats)
    rows = [["plain HF loop (in-process)", "float32", f"{base:.1f}", "1.00x", "", "", ""]]

    def bound(dtype_bytes: int) -> float:
        return N * bw * 1e9 / (params * dtype_bytes)

    def compute_bound(dtype: str) -> float:
        return flops[dtype] * 1e9 / (2 * params)

    adapter_root = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    memory: list[list[str]] = []
    try:
        measure_nodes(model_dir, adapter_root, args, base, bound, compute_bound, rows, channels,
                      Memory(model_dir, params, memory))
    finally:
        channels.close()
        shutil.rmtree(adapter_root, ignore_errors=True)
    print(f"machine: {machine()}; read bandwidth {bw:.1f} GB/s; GEMM peak "
          f"{flops['float32']:.0f} GFLOP/s float32, {flops['bfloat16']:.0f} bfloat16; "
          f"model {params / 1e6:.1f} M params")
    print(f"workload: 1 group of n={N} x up to {MAX_TOKENS} new tokens, temperature 1; best of "
          f"{args.repeats}; channel: {channels.describe()}")
    print(table(rows, ["engine", "dtype", "tok/s", "vs plain loop", "bandwidth bound tok/s",
                       "compute bound tok/s", "of the lower"]))
    print("\nresident memory (MB = 10^6 bytes); runtime floor: libraries and tokenizer, no model")
    print(table(memory, ["node", "weights MB", "runtime floor MB", "RSS after start-up",
                         "after decoding", "peak", "RSS / weights (start-up, after)",
                         "(RSS - floor) / weights"]))


#: what each kind of node imports before it loads a model
FLOOR_IMPORTS = {
    "torch": "import torch, transformers, peft, grpc\n"
             "import gridrl.rollout.server, gridrl.engine.backends.torch\n",
    "mlx": "import mlx.core, mlx_lm, transformers, grpc\n"
           "import gridrl.rollout.server, gridrl.engine.backends.mlx\n",
}


class Memory:
    """Collects the resident-memory rows: one per node, read from /proc/<pid>/status."""

    def __init__(self, model_dir: str, params: int, rows: list[list[str]]) -> None:
        self.model_dir, self.params, self.rows = model_dir, params, rows
        self._floor: dict[str, float] = {}

    def floor(self, backend: str) -> float:
        if backend not in self._floor:
            self._floor[backend] = runtime_floor_mb(
                FLOOR_IMPORTS[backend] + "from transformers import AutoTokenizer\n"
                f"AutoTokenizer.from_pretrained({self.model_dir!r})")
        return self._floor[backend]

    def add(self, label: str, backend: str, nbytes: int, started: float, pid: int) -> None:
        """One row for the node ``pid`` that had ``started`` MB resident after start-up."""
        after, peak = resident_mb(pid)
        weights = self.params * nbytes / 1e6
        floor = self.floor(backend)
        self.rows.append([label, f"{weights:.0f}", f"{floor:.0f}", f"{started:.0f}",
                          f"{after:.0f}", f"{peak:.0f}",
                          f"{started / weights:.2f}x, {after / weights:.2f}x",
                          f"{(started - floor) / weights:.2f}x, {(after - floor) / weights:.2f}x"])


def measure_nodes(model_dir: str, adapter_root: Path, args: argparse.Namespace, base: float,
                  bound, compute_bound, rows: list[list[str]], channels: Channels,
                  memory: Memory) -> None:
    """Start each node configuration in turn and add its rows to ``rows`` and ``memory``."""
    save_random_adapter(model_dir, adapter_root / "r16")
    for forward, dtype, nbytes, adapter in (("lean", "float32", 4, False),
                                            ("lean", "float32", 4, True),
                                            ("lean", "bfloat16", 2, False),
                                            ("transformers", "float32", 4, False)):
        node = Proc(["gridrl-rollout", "serve", "--backend", "torch", "--model", model_dir,
                     "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--dtype", dtype,
                     "--forward", forward, "--capacity", "64",
                     "--adapter-root", str(adapter_root), *channels.node_flags],
                    f"torch-{forward}-{dtype}")
        label = f"torch node via gRPC, {forward} forward" + (", r16 LoRA" if adapter else "")
        try:
            started, _ = resident_mb(node.proc.pid)
            if adapter:
                serve_adapter(node.address, "r16", channels.security)
            tps, mean_len = node_throughput(node.address, args.repeats, MAX_TOKENS,
                                            security=channels.security)
            memory.add(f"torch, {forward} forward, {dtype}" + (", r16 LoRA" if adapter else ""),
                       "torch", nbytes, started, node.proc.pid)
        finally:
            node.stop()
        b, c = bound(nbytes), compute_bound(dtype)
        rows.append([f"{label} (mean {mean_len:.0f} tok/sample)", dtype,
                     f"{tps:.1f}", f"{tps / base:.2f}x", f"{b:.0f}", f"{c:.0f}",
                     f"{tps / min(b, c):.0%}"])
    if not args.skip_mlx:
        node = Proc(["gridrl-rollout", "serve", "--backend", "mlx", "--model", model_dir,
                     "--listen", "127.0.0.1:0", "--metrics-port", "-1", *channels.node_flags],
                    "mlx")
        try:
            started, _ = resident_mb(node.proc.pid)
            tps, mean_len = node_throughput(node.address, 1, args.mlx_tokens,
                                            security=channels.security)
            memory.add("mlx, float32", "mlx", 4, started, node.proc.pid)
        finally:
            node.stop()
        b, c = bound(4), compute_bound("float32")
        rows.append([f"mlx node via gRPC ({args.mlx_tokens} tok/sample)", "float32",
                     f"{tps:.1f}", f"{tps / base:.2f}x", f"{b:.0f}", f"{c:.0f}",
                     f"{tps / min(b, c):.0%}"])


if __name__ == "__main__":
    main()
