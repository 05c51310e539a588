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
                                       [--background-load 0 1 2]

``--secure``: the nodes serve mutual TLS and check a trainer-scoped credential, as across
machines. ``--background-load 0 1 2``: everything again with 0, 1 and 2 cores kept busy by
busy loops the bench starts and stops (a box whose owner keeps working); under a load the
float32 lean node also runs with a fixed thread per core (the nodes' former default) beside
its default (one thread per core the others leave free). Each row's mismatch KL is the k3
estimate of KL(node || float32 transformers forward) on its samples: what a float32 trainer
reports for that node (~1e-10 for float32 nodes; 16-bit nodes are flagged above 0.1).

A second table gives each node's resident memory (RSS from /proc: after start-up, after the
decoding above, and its peak) against the bytes of its weights in the dtype it serves: the
ratio RSS / weights, and the same for the model's part, RSS minus the runtime floor (RSS of a
fresh interpreter with the node's libraries imported and the tokenizer loaded, no model).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import (
    BackgroundLoad,
    Channels,
    Proc,
    decode_compute_bound,
    load_average,
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

    from gridrl.trainer.backends.torch.policy import LoraSettings, load_policy

    policy = load_policy(model_dir, lora=LoraSettings(rank=16, alpha=32), seed=0)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    policy.save_adapter(out)


def serve_adapter(address: str, path: str, security=None) -> None:
    """ReloadAdapter(path) on the node: it serves that adapter from then on."""
    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

    stub = rollout_pb2_grpc.RolloutServiceStub(dial(address, security))
    reply = stub.ReloadAdapter(rollout_pb2.ReloadAdapterRequest(path=path), timeout=120)
    assert reply.serving.name, reply


def node_throughput(address: str, repeats: int, max_tokens: int, n: int = N,
                    security=None) -> tuple[float, float, list]:
    """Generate through gRPC; returns (best tok/s, mean completion length, the last call's
    samples)."""
    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    stub = rollout_pb2_grpc.RolloutServiceStub(dial(address, security))
    req = rollout_pb2.GenerateRequest(
        prompt_text=PROMPT, apply_chat_template=True,
        sampling=common_pb2.SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0))
    stub.Generate(req, timeout=600)  # warm-up
    best, lengths, samples = 0.0, [], []
    for r in range(repeats):
        req.sampling.seed = r + 1
        t = time.perf_counter()
        resp = stub.Generate(req, timeout=600)
        dt = time.perf_counter() - t
        tokens = sum(len(s.token_ids) for s in resp.samples)
        lengths.append(tokens / n)
        best = max(best, tokens / dt)
        samples = list(resp.samples)
    return best, statistics.mean(lengths), samples


class Scorer:
    """The float32 trainer's view of a node's samples: teacher-forced logprobs from the
    transformers forward in float32 (what the trainer's update computes), and the mismatch KL
    the trainer reports (k3 estimate of KL(behaviour || trainer), nats a token)."""

    def __init__(self, model_dir: str) -> None:
        from gridrl.engine.backends.torch.backend import TorchBackend

        self.backend = TorchBackend.from_pretrained(model_dir, dtype="float32", lean=False)
        tok = self.backend.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                      add_generation_prompt=True)
        self.prompt = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys")
                           else ids)

    def mismatch_kl(self, samples: list) -> float:
        from gridrl.engine.contract import SamplingConfig
        from gridrl.trainer.grpo.advantages import mismatch_kl_per_sequence

        kls = []
        for s in samples:
            if not s.token_ids:
                continue
            trainer = self.backend.score(self.prompt, list(s.token_ids),
                                         SamplingConfig(max_tokens=len(s.token_ids)), None)
            kls.append(float(mismatch_kl_per_sequence([trainer], [list(s.logprobs)],
                                                      [[1.0] * len(trainer)])[0]))
        return statistics.mean(kls) if kls else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-mlx", action="store_true")
    ap.add_argument("--mlx-tokens", type=int, default=8, help="new tokens per MLX sample")
    ap.add_argument("--secure", action="store_true",
                    help="mutual TLS and a scoped credential, as across machines")
    ap.add_argument("--background-load", type=int, nargs="+", default=[0], metavar="N",
                    help="measure with N cores kept busy by other processes (bounded busy "
                         "loops the bench starts and stops), e.g. 0 1 2")
    args = ap.parse_args()
    channels = Channels(args.secure)

    from gridrl.models import resolve_model

    model_dir = str(resolve_model("smollm2-135m-instruct"))
    bw = read_bandwidth_gbs()
    flops = {dtype: matmul_gflops(dtype) for dtype in ("float32", "bfloat16")}
    scorer = Scorer(model_dir)
    params = sum(p.numel() for p in scorer.backend._hf.parameters())

    def bound(dtype_bytes: int) -> float:
        return N * bw * 1e9 / (params * dtype_bytes)

    def compute_bound(dtype: str) -> float:
        return decode_compute_bound(flops, dtype, params)

    adapter_root = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    memory: list[list[str]] = []
    rows: list[list[str]] = []
    try:
        save_random_adapter(model_dir, adapter_root / "r16")
        for busy in args.background_load:
            with BackgroundLoad(busy):
                # under a load the plain loop's 2-thread team can take minutes a call: once
                base, _ = baseline_loop(model_dir, 1 if busy else args.repeats)
                rows.append([str(busy), "plain HF loop (in-process)", "float32", f"{base:.1f}",
                             "1.00x", "", "", "", ""])
                print(" | ".join(rows[-1]), flush=True)
                measure_nodes(model_dir, adapter_root, args, base, bound, compute_bound, rows,
                              channels, Memory(model_dir, params, memory) if busy == 0 else None,
                              scorer, busy)
                where = load_average()
            rows[-1][0] += f" ({where})"
    finally:
        channels.close()
        shutil.rmtree(adapter_root, ignore_errors=True)
    print(f"machine: {machine()}; read bandwidth {bw:.1f} GB/s; GEMM peak "
          f"{flops['float32']:.0f} GFLOP/s float32, {flops['bfloat16']:.0f} bfloat16; "
          f"model {params / 1e6:.1f} M params")
    print(f"workload: 1 group of n={N} x up to {MAX_TOKENS} new tokens, temperature 1; best of "
          f"{args.repeats}; channel: {channels.describe()}; mismatch KL: k3 estimate of "
          f"KL(node || float32 transformers forward) over the last call's tokens, nats/token")
    print(table(rows, ["busy cores", "engine", "dtype", "tok/s", "vs plain loop (same load)",
                       "bandwidth bound tok/s", "compute bound tok/s", "of the lower",
                       "mismatch KL"]))
    if memory:
        print("\nresident memory (MB = 10^6 bytes); runtime floor: libraries and tokenizer, "
              "no model")
        print(table(memory, ["node", "weights MB", "runtime floor MB", "RSS after start-up",
                             "after decoding", "peak", "RSS / weights (start-up, after)",
                             "(RSS - floor) / weights"]))


#: what each kind of node imports before it loads a model
FLOOR_IMPORTS = {
    "torch": "import torch, transformers, peft, grpc\n"
             "import gridrl.rollout.server, gridrl.engine.backends.torch.backend\n",
    "mlx": "import mlx.core, mlx_lm, transformers, grpc\n"
           "import gridrl.rollout.server, gridrl.engine.backends.mlx.backend\n",
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


#: the node configurations measured: (forward, dtype, weight bytes, LoRA adapter, threads);
#: threads 0 is the node's default (one per core that other processes leave free).
NODES = (("lean", "float32", 4, False, 0), ("lean", "float32", 4, True, 0),
         ("lean", "bfloat16", 2, False, 0), ("transformers", "float32", 4, False, 0))


def products_line(log: str) -> str:
    """How the node's start-up line says its products run ("fused C kernel", ...)."""
    for line in log.splitlines():
        if "forward: lean (" in line:
            return line.split("forward: lean (", 1)[1].split(" products)", 1)[0].split(
                " model, ", 1)[-1]
    return ""


def measure_nodes(model_dir: str, adapter_root: Path, args: argparse.Namespace, base: float,
                  bound, compute_bound, rows: list[list[str]], channels: Channels,
                  memory: Memory | None, scorer: Scorer, busy: int) -> None:
    """Start each node configuration in turn and add its rows to ``rows`` and ``memory``.
    Under a background load, also the float32 lean node with a fixed thread per core (what
    every node ran before it shared its cores)."""
    configs = list(NODES)
    if busy:
        configs.insert(1, ("lean", "float32", 4, False, len(os.sched_getaffinity(0))))
    for forward, dtype, nbytes, adapter, threads in configs:
        node = Proc(["gridrl-rollout", "serve", "--backend", "torch", "--model", model_dir,
                     "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--dtype", dtype,
                     "--forward", forward, "--capacity", "64", "--threads", str(threads),
                     "--adapter-root", str(adapter_root), *channels.node_flags],
                    f"torch-{forward}-{dtype}")
        label = f"torch node via gRPC, {forward} forward" + (", r16 LoRA" if adapter else "")
        if threads:
            label += f", {threads} threads fixed"
        try:
            started, _ = resident_mb(node.proc.pid)
            if adapter:
                serve_adapter(node.address, "r16", channels.security)
            tps, mean_len, samples = node_throughput(node.address, args.repeats, MAX_TOKENS,
                                                     security=channels.security)
            if memory is not None:
                memory.add(f"torch, {forward} forward, {dtype}"
                           + (", r16 LoRA" if adapter else ""), "torch", nbytes, started,
                           node.proc.pid)
            how = products_line(node.log.read_text())
        finally:
            node.stop()
        kl = scorer.mismatch_kl(samples) if not adapter else float("nan")
        b, c = bound(nbytes), compute_bound(dtype)
        rows.append([str(busy), f"{label} (mean {mean_len:.0f} tok/sample)"
                     + (f" [{how}]" if how else ""), dtype, f"{tps:.1f}", f"{tps / base:.2f}x",
                     f"{b:.0f}", f"{c:.0f}", f"{tps / min(b, c):.0%}",
                     "" if adapter else f"{kl:.1e}"])
        print(" | ".join(rows[-1]), flush=True)  # as it goes: a long run keeps what it measured
    if not args.skip_mlx and not busy:
        node = Proc(["gridrl-rollout", "serve", "--backend", "mlx", "--model", model_dir,
                     "--listen", "127.0.0.1:0", "--metrics-port", "-1", *channels.node_flags],
                    "mlx")
        try:
            started, _ = resident_mb(node.proc.pid)
            tps, mean_len, _ = node_throughput(node.address, 1, args.mlx_tokens,
                                               security=channels.security)
            if memory is not None:
                memory.add("mlx, float32", "mlx", 4, started, node.proc.pid)
        finally:
            node.stop()
        b, c = bound(4), compute_bound("float32")
        rows.append([str(busy), f"mlx node via gRPC ({args.mlx_tokens} tok/sample)", "float32",
                     f"{tps:.1f}", f"{tps / base:.2f}x", f"{b:.0f}", f"{c:.0f}",
                     f"{tps / min(b, c):.0%}", ""])


if __name__ == "__main__":
    main()
