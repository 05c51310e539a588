"""Benchmark 2: adapter sync, rank 16 on all linear layers of the bundled model (19.6 MB fp32).

Measures, in one run, the time from the trainer's LoRA weights in memory to the rollout node
serving the new version:
- gridrl's path: serialize in memory (safetensors bytes) -> manifest (no digests) ->
  ``PushAdapter`` stream (1 MiB chunks, the trainer hashing each as it sends it, the digests
  in a trailer) -> node hashes while receiving, checks the fit, loads the LoRA factors
  from memory, swaps between batches -> reply (sent once the new version serves; the node
  stores the files after the reply);
- beside it: peft ``save_pretrained`` to disk and a ``ReloadAdapter`` of that directory on the
  node (the shared-filesystem way, 120-350 ms on the reference machine);
- and the floor: the same bytes over a raw loopback TCP socket (14 ms there).
Goal: <= 100 ms end to end. Pushes are 0.5 s apart, as a trainer's steps space its syncs (the
node writes each push to its store after replying; a push arriving during that write waits
for it).

    python bench/adapter_sync.py [--repeats 5] [--secure]

``--secure`` runs the node and the pushes as across machines: mutual TLS and a trainer-scoped
credential (what TLS costs a push).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _common import Channels, Proc, machine, table


def raw_tcp_ms(payload: bytes, repeats: int) -> list[float]:
    """Send ``payload`` over a loopback socket and wait for the receiver's 1-byte ack."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def receive() -> None:
        for _ in range(repeats):
            conn, _ = server.accept()
            with conn:
                n = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "big")
                got = 0
                while got < n:
                    got += len(conn.recv(1 << 20))
                conn.sendall(b"k")

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(len(payload).to_bytes(8, "big") + payload)
            c.recv(1)
        times.append((time.perf_counter() - start) * 1e3)
    t.join()
    server.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--secure", action="store_true",
                    help="mutual TLS and a scoped credential, as across machines")
    args = ap.parse_args()
    channels = Channels(args.secure)

    import torch

    from gridrl.adapters import build_manifest
    from gridrl.common.rpc.channel import dial
    from gridrl.common.transport import push_requests
    from gridrl.models import resolve_model
    from gridrl.trainer.backends.torch.policy import LoraSettings, load_policy
    from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

    model_dir = str(resolve_model("smollm2-135m-instruct"))
    policy = load_policy(model_dir, lora=LoraSettings(rank=16, alpha=32), seed=0)
    from gridrl.common.rpc.server import freeze_long_lived

    freeze_long_lived()  # as the trainer CLI does once its policy is loaded
    params = policy.trainable_parameters()
    n_params = sum(p.numel() for p in params)
    base_model = {"model_id": model_dir, "architecture": policy.identity.architecture,
                  "hidden_size": policy.identity.hidden_size,
                  "num_layers": policy.identity.num_layers,
                  "vocab_size": policy.identity.vocab_size}
    adapter_root = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    node = Proc(["gridrl-rollout", "serve", "--backend", "torch", "--model", model_dir,
                 "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                 "--adapter-root", str(adapter_root), *channels.node_flags], "node")
    stub = rollout_pb2_grpc.RolloutServiceStub(dial(node.address, channels.security))
    grpc_ms, phases, disk_ms, sizes = [], [], [], 0
    files_ms, manifest_ms = [], []
    try:
        for v in range(1, args.repeats + 2):
            with torch.no_grad():  # a new policy version: every LoRA weight changes
                for p in params:
                    p.add_(torch.randn_like(p) * 1e-3)
            time.sleep(0.5)  # a training step between syncs
            start = time.perf_counter()
            files = policy.adapter_files()
            t_files = time.perf_counter()
            manifest = build_manifest(files, name="bench", version=v, base_model=base_model,
                                      hash_files=False)  # as the trainer: digests in the trailer
            t_manifest = time.perf_counter()
            reply = stub.PushAdapter(push_requests(manifest.to_dict(), files), timeout=60)
            elapsed = (time.perf_counter() - start) * 1e3
            assert reply.serving.version == v, reply
            sizes = sum(len(b) for b in files.values())
            if v > 1:  # the first push warms up allocators and the channel
                grpc_ms.append(elapsed)
                phases.append(reply.timings)
                files_ms.append((t_files - start) * 1e3)
                manifest_ms.append((t_manifest - t_files) * 1e3)
        for v in range(args.repeats):
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn_like(p) * 1e-3)
            start = time.perf_counter()
            target = adapter_root / f"disk-{v}"
            policy.model.save_pretrained(str(target))
            reply = stub.ReloadAdapter(rollout_pb2.ReloadAdapterRequest(path=target.name),
                                       timeout=60)
            disk_ms.append((time.perf_counter() - start) * 1e3)
    finally:
        node.stop()
        channels.close()
        shutil.rmtree(adapter_root, ignore_errors=True)
    tcp = raw_tcp_ms(files["adapter_model.safetensors"], args.repeats)

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs):.0f} (min {min(xs):.0f}, max {max(xs):.0f})"

    print(f"machine: {machine()}")
    print(f"adapter: rank 16, all linear layers, {n_params:,} parameters, {sizes / 1e6:.1f} MB "
          f"over the wire; {args.repeats} repeats, median (min, max) in ms; channel: "
          f"{channels.describe()}")
    rows = [
        ["PushAdapter: trainer memory -> node serving", ms(grpc_ms), f"{statistics.median(grpc_ms) / statistics.median(tcp):.1f}x"],
        ["  of which trainer serialize (safetensors bytes)", ms(files_ms), ""],
        ["  of which trainer manifest (no digests)", ms(manifest_ms), ""],
        ["  of which node receive", ms([p.receive_s * 1e3 for p in phases]), ""],
        ["  of which node verify (sha256 while receiving, fit)", ms([p.verify_s * 1e3 for p in phases]), ""],
        ["  of which node apply (load LoRA factors, swap)", ms([p.apply_s * 1e3 for p in phases]), ""],
        ["save_pretrained + ReloadAdapter(path)", ms(disk_ms), f"{statistics.median(disk_ms) / statistics.median(tcp):.1f}x"],
        ["raw loopback TCP, same bytes", ms(tcp), "1.0x"],
    ]
    print(table(rows, ["path", "ms", "vs raw TCP"]))
    goal = statistics.median(grpc_ms)
    print(f"goal <= 100 ms end to end: {'met' if goal <= 100 else 'NOT met'} ({goal:.0f} ms)")


if __name__ == "__main__":
    main()
