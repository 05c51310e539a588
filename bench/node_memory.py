"""Resident memory of one torch rollout node on the bundled model (bench 1's memory rows
alone, without its throughput runs): start ``gridrl-rollout serve`` as bench 1 does, read its
RSS (anonymous / file-backed) and its peak from /proc after start-up (the peak of loading)
and after one Generate of 8 x 40 tokens, against the weight bytes.

    python bench/node_memory.py [--runs 3] [-- extra serve flags, e.g. --forward transformers]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from _common import Proc, resident_mb, table
from rollout_throughput import MAX_TOKENS, PROMPT, N


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("serve_flags", nargs="*")
    args = ap.parse_args()
    from safetensors import safe_open

    from gridrl.common.rpc.channel import dial
    from gridrl.models import resolve_model
    from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    model_dir = str(resolve_model("smollm2-135m-instruct"))
    weights = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names = st.keys()
            weights += 4 * sum(_numel(st.get_slice(k).get_shape()) for k in names)
    rows = []
    for run in range(args.runs):
        node = Proc(["gridrl-rollout", "serve", "--backend", "torch", "--model", model_dir,
                     "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--capacity", "64",
                     *args.serve_flags], f"memory-{run}")
        try:
            started, load_peak = resident_mb(node.proc.pid)
            status = Path(f"/proc/{node.proc.pid}/status").read_text()
            kinds = {k: int(v) * 1024 / 1e6
                     for k, v in re.findall(r"(RssAnon|RssFile):\s+(\d+)", status)}
            stub = rollout_pb2_grpc.RolloutServiceStub(dial(node.address, None))
            stub.Generate(rollout_pb2.GenerateRequest(
                prompt_text=PROMPT, apply_chat_template=True,
                sampling=common_pb2.SamplingParams(n=N, max_tokens=MAX_TOKENS, temperature=1.0,
                                                   seed=1)), timeout=600)
            after, peak = resident_mb(node.proc.pid)
        finally:
            node.stop()
        rows.append([str(run + 1), f"{started:.0f}",
                     f"{kinds.get('RssAnon', 0):.0f} / {kinds.get('RssFile', 0):.0f}",
                     f"{load_peak:.0f}", f"{after:.0f}", f"{peak:.0f}",
                     f"{started / weights * 1e6:.2f}x"])
        print(rows[-1], flush=True)
    print(f"weights: {weights / 1e6:.0f} MB (float32); node flags: {args.serve_flags or '-'}")
    print(table(rows, ["run", "RSS after start-up MB", "anon / file MB",
                       "peak while loading (VmHWM)", "after one Generate", "peak after it",
                       "RSS / weights"]))


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
