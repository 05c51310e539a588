"""Load on one torch rollout node: concurrent Generate clients, the queue bound, and the node's
memory over many adapter pushes.

1. Concurrency: 1, 4, 16, 64 clients (``--levels``), each sending ``--requests`` Generate
   calls back to back (n 1, ``--max-tokens`` tokens, temperature 1, no stop: every call
   decodes all its tokens). Per level: completion tokens/s over the level's wall time, p50 /
   p99 latency of a call, refusals. The baseline is the 1-client row (the speed-up column
   divides by it).
2. The bound: bursts of clients released at once, each with one call, at and beyond
   ``capacity + max_queue`` (the node's ``--capacity`` sequences decode, ``--max-queue``
   requests wait, the rest are refused with RESOURCE_EXHAUSTED naming ``--max-queue``). Prints
   the smallest burst that got a refusal and the refusal's message.
3. Memory: ``--pushes`` PushAdapter calls of a rank-4 all-linear LoRA (a new version each, the
   node keeping its default 8 on disk), sampling the node's resident set size every 10
   pushes. Prints the least-squares slope over pushes 100..end (MB per 100 pushes; the first
   100 warm up allocators) against the RSS at push 100, and "flat" when the slope is under
   ``--flat-mb`` MB per 100 pushes.

    python bench/load.py                      # tiny random llama (seconds)
    python bench/load.py --model smollm2-135m-instruct --levels 1,4,16 --pushes 200

The node is a ``gridrl-rollout serve`` subprocess (its own process: its RSS is its own).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import Proc, machine, resident_mb, table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``xs``, nearest rank."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def slope_per_100(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (push, MB) points, in MB per 100 pushes."""
    xs, ys = [p for p, _ in points], [m for _, m in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def run_clients(stub, clients: int, requests: int, max_tokens: int, prompt: list[int],
                timeout: float) -> dict:
    """``clients`` threads released together, each making ``requests`` Generate calls.

    Returns:
        wall seconds, completion tokens, per-call latencies (s) of accepted calls, refused
        calls (RESOURCE_EXHAUSTED) with one message, and other errors by code.
    """
    import grpc

    from gridrl.v1 import common_pb2, rollout_pb2

    barrier = threading.Barrier(clients + 1)
    lock = threading.Lock()
    out = {"tokens": 0, "latencies": [], "refused": 0, "message": "", "errors": {}}

    def client(i: int) -> None:
        barrier.wait()
        for j in range(requests):
            request = rollout_pb2.GenerateRequest(
                prompt_token_ids=prompt, request_id=f"c{i}-{j}",
                sampling=common_pb2.SamplingParams(n=1, max_tokens=max_tokens, temperature=1.0,
                                                   seed=i * 100_003 + j))
            t = time.perf_counter()
            try:
                response = stub.Generate(request, timeout=timeout)
            except grpc.RpcError as e:
                with lock:
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        out["refused"] += 1
                        out["message"] = out["message"] or e.details()
                    else:
                        out["errors"][e.code().name] = out["errors"].get(e.code().name, 0) + 1
                continue
            elapsed = time.perf_counter() - t
            with lock:
                out["latencies"].append(elapsed)
                out["tokens"] += sum(len(s.token_ids) for s in response.samples)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    out["wall"] = time.perf_counter() - start
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="model id, alias or directory (default: a tiny random llama)")
    ap.add_argument("--levels", default="1,4,16,64", help="concurrent clients, comma-separated")
    ap.add_argument("--requests", type=int, default=8, help="calls per client per level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--capacity", type=int, default=64, help="the node's --capacity")
    ap.add_argument("--max-queue", type=int, default=128, help="the node's --max-queue")
    ap.add_argument("--bursts", default=None,
                    help="burst sizes for the bound (default: capacity+max_queue x 0.5, 1, "
                         "1.5, 2)")
    ap.add_argument("--pushes", type=int, default=1000)
    ap.add_argument("--flat-mb", type=float, default=1.0,
                    help="slope (MB per 100 pushes) under which RSS counts as flat")
    ap.add_argument("--threads", type=int, default=1,
                    help="the node's --threads (0: torch's default; 1 decodes the tiny model "
                         "fastest on a shared 2-core machine)")
    args = ap.parse_args()

    from gridrl.adapters import build_manifest, read_dir
    from gridrl.common.rpc.channel import dial
    from gridrl.common.transport import push_requests
    from gridrl.models import resolve_model
    from gridrl.models.testing import make_tiny_llama
    from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

    work = Path(tempfile.mkdtemp(prefix="bench-load-"))
    model_dir = (str(resolve_model(args.model)) if args.model
                 else str(make_tiny_llama(work / "tiny-llama")))
    label = args.model or "tiny random llama (2 layers, hidden 64)"
    from engine_helpers import make_peft_adapter  # tests/: random LoRA, r 4, all linear

    adapter = make_peft_adapter(Path(model_dir), work / "adapter", seed=0)
    files = read_dir(adapter)
    adapter_bytes = sum(len(b) for b in files.values())
    node = Proc(["gridrl-rollout", "serve", "--backend", "torch", "--model", model_dir,
                 "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                 "--adapter-root", str(work / "adapters"), "--capacity", str(args.capacity),
                 "--max-queue", str(args.max_queue), "--threads", str(args.threads)], "node")
    channel = dial(node.address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    info = stub.GetNodeInfo(rollout_pb2.GetNodeInfoRequest(), timeout=60).info
    prompt = [1 + (7 * i) % (info.base_model.vocab_size - 1) for i in range(16)]
    levels = [int(x) for x in args.levels.split(",")]
    bound = args.capacity + args.max_queue
    bursts = ([int(x) for x in args.bursts.split(",")] if args.bursts
              else [bound // 2, bound, bound + bound // 2, 2 * bound])
    rows, burst_rows, rss = [], [], []
    try:
        run_clients(stub, 2, 2, args.max_tokens, prompt, 300)  # warm-up
        base = None
        for clients in levels:
            r = run_clients(stub, clients, args.requests, args.max_tokens, prompt, 600)
            tps = r["tokens"] / r["wall"]
            base = base or tps
            lat = r["latencies"] or [float("nan")]
            rows.append([str(clients), str(clients * args.requests), f"{tps:.0f}",
                         f"{tps / base:.2f}x", f"{percentile(lat, 0.5) * 1e3:.0f}",
                         f"{percentile(lat, 0.99) * 1e3:.0f}", str(r["refused"]),
                         ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "-"])
            print(f"  {clients} clients: {tps:.0f} tokens/s", flush=True)
        first_refusal, message = None, ""
        for clients in bursts:
            r = run_clients(stub, clients, 1, args.max_tokens, prompt, 600)
            burst_rows.append([str(clients), str(len(r["latencies"])), str(r["refused"]),
                               ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "-"])
            if r["refused"] and first_refusal is None:
                first_refusal, message = clients, r["message"]
            print(f"  burst {clients}: {r['refused']} refused", flush=True)
        base_model = {"model_id": model_dir, "architecture": info.base_model.architecture,
                      "hidden_size": info.base_model.hidden_size,
                      "num_layers": info.base_model.num_layers,
                      "vocab_size": info.base_model.vocab_size,
                      "weights_fingerprint": info.base_model.weights_fingerprint}
        push_start = time.perf_counter()
        for v in range(1, args.pushes + 1):
            manifest = build_manifest(files, name="load", version=v, base_model=base_model,
                                      hash_files=False)
            reply = stub.PushAdapter(push_requests(manifest.to_dict(), files), timeout=120)
            assert reply.serving.version == v, reply
            if v == 1 or v % 10 == 0:
                rss.append((v, resident_mb(node.proc.pid)[0]))
        push_s = time.perf_counter() - push_start
    finally:
        channel.close()
        node.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nbench/load.py — {label}; node: torch, --capacity {args.capacity}, "
          f"--max-queue {args.max_queue}, --threads {args.threads}")
    print(f"machine: {machine()}")
    print(f"\n1. Concurrent Generate clients ({args.requests} calls each, n 1, "
          f"{args.max_tokens} tokens, prompt {len(prompt)} tokens); baseline: the 1-client row")
    print(table(rows, ["clients", "calls", "tokens/s", "vs 1 client", "p50 ms", "p99 ms",
                       "RESOURCE_EXHAUSTED", "other errors"]))
    print(f"\n2. Bursts released at once, one call each (capacity + max_queue = {bound})")
    print(table(burst_rows, ["clients", "served", "RESOURCE_EXHAUSTED", "other errors"]))
    if first_refusal is None:
        print("no burst was refused: the queue bound was not reached")
    else:
        print(f"first refusal at a burst of {first_refusal}: {message!r}")
    steady = [p for p in rss if p[0] >= 100] if args.pushes >= 200 else rss
    slope = slope_per_100(steady) if len(steady) >= 2 else float("nan")
    print(f"\n3. Node RSS over {args.pushes} pushes ({adapter_bytes / 1e6:.2f} MB adapter, "
          f"{push_s / args.pushes * 1e3:.0f} ms a push)")
    print(table([[str(p), f"{m:.1f}"] for p, m in rss if p == 1 or p % 100 == 0],
                ["push", "RSS MB"]))
    print(f"slope over pushes {steady[0][0]}..{steady[-1][0]}: {slope:+.2f} MB per 100 pushes "
          f"(baseline: {steady[0][1]:.1f} MB at push {steady[0][0]}); "
          f"{'flat' if abs(slope) < args.flat_mb else 'NOT flat'} "
          f"(threshold {args.flat_mb} MB per 100 pushes)")


if __name__ == "__main__":
    main()
