"""Benchmark 7: models past 135M -- random-weight models of Qwen2.5-0.5B / 1.5B and
Llama-3.2-1B shapes, built here (no hub), one at a time.

For each ``--model`` shape:
- builds the model in bfloat16 with random weights (std 0.02) and the bundled SmolLM2's
  tokenizer (its ids fit every shape's vocabulary), saves it (safetensors), and a rank-16
  all-linear LoRA adapter of it (peft);
- per node ``--dtype`` (float32, bfloat16): starts a torch rollout node on it and measures one
  group of n = 8 x 40 new tokens (best of ``--repeats``) against the bandwidth bound (batch x
  read bandwidth / weight bytes) and the compute bound (GEMM peak / 2 FLOPs a parameter), the
  node's resident memory after start-up and after decoding against its weight bytes (whole,
  and above the runtime floor: the libraries and tokenizer without a model), the KV-cache
  tokens it advertises, and the time of ``PushAdapter`` of the rank-16 adapter (median of
  ``--pushes``, from bytes in memory to the node serving it);
- the trainer (``--trainer``, instead of the node): the update of one
  reverse-words-retry-shaped step (2 groups x 8 two-turn episodes of random tokens, the loss
  mask on the model's turns; r16 all-linear LoRA) per ``--update-dtype`` and ``--memory-gb``
  budget, each in a subprocess of its own: start-up (load and activation probe), update
  seconds, seconds per trained model token, micro-batches (checkpointed ones), and the
  update's peak RSS against the budget. A budget the model does not fit is refused by the
  trainer itself, and the row says so.

Only one model and one process of size is alive at a time (a 1.5B float32 node is ~6 GB).

    python bench/large_models.py [--model qwen2.5-0.5b] [--model llama-3.2-1b]
                                 [--model qwen2.5-1.5b] [--dtype float32 --dtype bfloat16]
                                 [--repeats 2] [--pushes 3]
    python bench/large_models.py --trainer --model qwen2.5-0.5b [--update-dtype bfloat16]
                                 [--memory-gb 4 --memory-gb 8 --memory-gb 16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (
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

#: the published configurations' shapes (config.json of each model on the hub)
SHAPES = {
    "qwen2.5-0.5b": dict(kind="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                         rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(kind="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                         rms_norm_eps=1e-6, max_position_embeddings=32768),
    "llama-3.2-1b": dict(kind="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
}
N, MAX_TOKENS = 8, 40
# ~40 tokens of the bundled SmolLM2 tokenizer's byte-level BPE (as the model's family reads it)
PROMPT = ("Reverse the order of the words in this sentence, then say how many words it has and "
          "which of them is the longest one: the quick red fox jumps over the lazy brown dog")


def build(shape: str, out: Path) -> int:
    """Write the random-weight model (bfloat16 safetensors), its tokenizer and a r16 LoRA
    adapter under ``out`` (``out / "adapter"``); returns the parameter count."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from gridrl.models import resolve_model

    fields = dict(SHAPES[shape])
    kind = fields.pop("kind")
    # The bundled SmolLM2's byte-level BPE tokenizer (49152 ids, within every shape's vocab):
    # transformers 5 loads a directory's tokenizer as its model type's class (Qwen2Tokenizer
    # for qwen2), which re-reads a word-level tokenizer.json with byte-level rules and finds no
    # token in "w0 w1 ..."; a byte-level BPE reads the same under either class.
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct", progress=False))
    config = AutoConfig.for_model(kind, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **fields)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # never a float32 copy of the whole model
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    peft_model.save_pretrained(out / "adapter")
    del peft_model, model
    return params


def push_ms(address: str, adapter: Path, model_dir: Path, pushes: int) -> tuple[float, float]:
    """Median ms of ``PushAdapter`` of ``adapter``'s files (already in memory) until the node
    serves them, over ``pushes`` versions after a first one; and the adapter's MB."""
    from gridrl.adapters import build_manifest
    from gridrl.common.rpc.channel import dial
    from gridrl.common.transport import push_requests
    from gridrl.v1 import rollout_pb2_grpc

    files = {p.name: p.read_bytes() for p in adapter.iterdir() if p.is_file()}
    stub = rollout_pb2_grpc.RolloutServiceStub(dial(address))
    times = []
    for version in range(1, pushes + 2):
        time.sleep(0.5)  # a training step between syncs
        start = time.perf_counter()
        manifest = build_manifest(files, name="bench", version=version,
                                  base_model={"model_id": str(model_dir)}, hash_files=False)
        reply = stub.PushAdapter(push_requests(manifest.to_dict(), files), timeout=600)
        if version > 1:
            times.append((time.perf_counter() - start) * 1e3)
        assert reply.serving.version == version, reply
    return statistics.median(times), sum(len(b) for b in files.values()) / 1e6


def node_rows(shape: str, model_dir: Path, params: int, dtype: str, args: argparse.Namespace,
              bw: float, flops: dict[str, float], floor: float) -> list[str]:
    """One node row: start it, decode, push, read its memory."""
    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    nbytes = 4 if dtype == "float32" else 2
    node = Proc(["gridrl-rollout", "serve", "--backend", "torch", "--model", str(model_dir),
                 "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--dtype", dtype,
                 "--adapter-root", str(model_dir / f"node-{dtype}")], f"node-{dtype}",
                timeout=1800)
    try:
        started, _ = resident_mb(node.proc.pid)
        stub = rollout_pb2_grpc.RolloutServiceStub(dial(node.address))
        info = stub.GetNodeInfo(rollout_pb2.GetNodeInfoRequest(), timeout=60).info
        req = rollout_pb2.GenerateRequest(
            prompt_text=PROMPT, sampling=common_pb2.SamplingParams(
                n=N, max_tokens=MAX_TOKENS, temperature=1.0))
        stub.Generate(req, timeout=1800)  # warm-up
        best = 0.0
        for r in range(args.repeats):
            req.sampling.seed = r + 1
            t = time.perf_counter()
            resp = stub.Generate(req, timeout=1800)
            best = max(best, sum(len(s.token_ids) for s in resp.samples)
                       / (time.perf_counter() - t))
        after, peak = resident_mb(node.proc.pid)
        push, adapter_mb = push_ms(node.address, model_dir / "adapter", model_dir, args.pushes)
        how = ""
        for line in node.log.read_text().splitlines():
            if "forward: " in line:
                how = line.split("forward: ", 1)[1].split(";", 1)[0]
    finally:
        node.stop()
    weights = params * nbytes / 1e6
    bound = N * bw * 1e9 / (params * nbytes)
    compute = decode_compute_bound(flops, dtype, params)
    return [shape, dtype, f"{best:.1f}", f"{bound:.0f}", f"{compute:.0f}",
            f"{best / min(bound, compute):.0%}", f"{weights:.0f}", f"{started:.0f}",
            f"{after:.0f} (peak {peak:.0f})",
            f"{after / weights:.2f}x / {(after - floor) / weights:.2f}x",
            str(info.kv_cache_tokens), f"{push:.0f} ({adapter_mb:.0f} MB)", how]


#: reverse-words-retry's token counts (issue 45: 16 two-turn episodes a step, ~550 model and
#: ~950 environment tokens): per episode a prompt, turn 1, the environment's reply, turn 2
EPISODE = dict(prompt=80, turn=17, env=60)


def trainer_update(model_dir: str, update_dtype: str, memory_mb: int) -> dict:
    """In this (child) process: the trainer's update of one reverse-words-retry-shaped step
    (2 groups x 8 two-turn episodes, random tokens, loss mask on the model's turns) under
    ``--memory-mb memory_mb`` and ``--update-dtype``: seconds, micro-batches, peak RSS."""
    import numpy as np

    from gridrl.trainer.backends.base import TrainSequence, create_backend
    from gridrl.trainer.backends.memory import MIB
    from gridrl.trainer.config import TrainConfig

    cfg = TrainConfig(model=model_dir, backend="torch", lora_rank=16, lora_alpha=32.0,
                      lr=3e-4, steps=1, max_tokens=EPISODE["turn"], temperature=1.0,
                      rollout=["local"], run_dir="unused", seed=0, update_dtype=update_dtype,
                      memory_mb=memory_mb).finalize()
    t0 = time.perf_counter()
    backend = create_backend(cfg)  # the load, and the activation probe
    start_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    turn, env = EPISODE["turn"], EPISODE["env"]
    mask = (1,) * turn + (0,) * env + (1,) * turn
    seqs = [TrainSequence(tuple(int(t) for t in rng.integers(100, 40000, EPISODE["prompt"])),
                          tuple(int(t) for t in rng.integers(100, 40000, len(mask))),
                          tuple(-2.0 * m for m in mask), float(rng.standard_normal()), g,
                          loss_mask=mask)
            for g in range(2) for _ in range(8)]
    t0 = time.perf_counter()
    stats = backend.update(seqs)
    update_s = time.perf_counter() - t0
    limit = backend.memory.limit_bytes if backend.memory is not None else 0
    backend.close()
    return {"start_s": start_s, "update_s": update_s, "micro_batches": stats.micro_batches,
            "checkpointed": stats.checkpointed_micro_batches,
            "peak_mb": (stats.peak_rss_bytes or 0) / MIB, "limit_mb": limit / MIB,
            "model_tokens": sum(s.trained_tokens for s in seqs)}


def trainer_rows(shape: str, model_dir: Path, params: int, dtypes: list[str],
                 budgets: list[int]) -> list[list[str]]:
    """Run :func:`trainer_update` in a child process per update dtype and budget (GB; 0: the
    default share) and make their rows (or say why not)."""
    rows = []
    for dtype in dtypes:
        for gb in budgets:
            out = subprocess.run([sys.executable, __file__, "--trainer-step", str(model_dir),
                                  "--update-dtype", dtype, "--memory-mb", str(gb * 1024)],
                                 capture_output=True, text=True, timeout=7200)
            budget = f"{gb} GB" if gb else "default"
            if out.returncode != 0:
                error = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
                rows.append([shape, dtype, budget, f"refused/failed: {error[-1][-200:]}",
                             "", "", "", ""])
                print(rows[-1], flush=True)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append([shape, dtype, budget, f"{r['update_s']:.1f}",
                         f"{r['update_s'] / r['model_tokens'] * 1000:.1f}",
                         f"{r['micro_batches']} ({r['checkpointed']} checkpointed)",
                         f"{r['peak_mb']:.0f} / {r['limit_mb']:.0f}",
                         "yes" if r["peak_mb"] <= r["limit_mb"] else "NO"])
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=sorted(SHAPES),
                    help="shapes to measure, one at a time (default: qwen2.5-0.5b)")
    ap.add_argument("--dtype", action="append", choices=["float32", "bfloat16"],
                    help="node dtypes (default: both)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--trainer", action="store_true",
                    help="the trainer's update instead of the node, per --update-dtype and "
                         "--memory-gb, each in a subprocess")
    ap.add_argument("--update-dtype", action="append", choices=["float32", "bfloat16"],
                    help="trainer: update dtypes (default: both)")
    ap.add_argument("--memory-gb", action="append", type=int,
                    help="trainer: --memory-mb budgets in GB (default: 4, 8, 16)")
    ap.add_argument("--trainer-step", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--memory-mb", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trainer_step:
        print(json.dumps(trainer_update(args.trainer_step, (args.update_dtype or ["float32"])[0],
                                        args.memory_mb)))
        return
    bw = read_bandwidth_gbs()
    flops = {d: matmul_gflops(d) for d in ("float32", "bfloat16")}
    node_table, trainer_table = [], []
    for shape in args.model or ["qwen2.5-0.5b"]:
        work = Path(tempfile.mkdtemp(prefix=f"bench-{shape}-"))
        try:
            t0 = time.perf_counter()
            params = build(shape, work)
            print(f"{shape}: {params / 1e6:.0f} M parameters, built in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            floor = runtime_floor_mb("import torch, transformers, peft, grpc\n"
                                     "import gridrl.rollout.server, "
                                     "gridrl.engine.backends.torch.backend\n"
                                     "from transformers import AutoTokenizer\n"
                                     f"AutoTokenizer.from_pretrained({str(work)!r})")
            if args.trainer:
                trainer_table += trainer_rows(shape, work, params,
                                              args.update_dtype or ["float32", "bfloat16"],
                                              args.memory_gb or [4, 8, 16])
                continue
            for dtype in args.dtype or ["float32", "bfloat16"]:
                node_table.append(node_rows(shape, work, params, dtype, args, bw, flops, floor))
                print(node_table[-1], flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"machine: {machine()}; read bandwidth {bw:.1f} GB/s; GEMM peak "
          f"{flops['float32']:.0f} GFLOP/s float32, {flops['bfloat16']:.0f} bfloat16; "
          f"{load_average()} at the end")
    print(f"node: one group of n={N} x {MAX_TOKENS} new tokens (best of {args.repeats}); "
          f"RSS in MB (10^6 bytes); push: median of {args.pushes} PushAdapter of the r16 "
          "all-linear adapter, bytes in memory -> node serving")
    print(table(node_table, ["model", "node dtype", "tok/s", "bandwidth bound", "compute bound",
                             "of the lower", "weights MB", "RSS start-up", "RSS after decoding",
                             "RSS / weights, (RSS - floor) / weights", "KV-cache tokens",
                             "push ms", "forward"]))
    if trainer_table:
        print(f"\ntrainer: the update of one reverse-words-retry-shaped step (2 groups x 8 "
              f"two-turn episodes: {EPISODE['prompt']} prompt tokens, {EPISODE['turn']} + "
              f"{EPISODE['turn']} model and {EPISODE['env']} environment tokens each; r16 LoRA)"
              " under --memory-mb; peak RSS of the update (VmHWM) against the budget, MiB")
        print(table(trainer_table, ["model", "update dtype", "--memory-mb", "update s",
                                    "ms / model token", "micro-batches", "peak RSS / budget",
                                    "within"]))

if __name__ == "__main__":
    main()
