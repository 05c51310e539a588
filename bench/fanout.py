"""Adapter fan-out: does the trainer's upload per push grow with the fleet?

Over the network-namespace fleet harness (``tests/netfleet.py``: each process in its own
namespace behind a ``tc tbf``-shaped veth, mutual TLS and credentials on), for 1, 2, 4, 8 and
16 nodes, with adapters of Qwen2.5-0.5B and Qwen2.5-1.5B shape (rank 16 on q/k/v/o/gate/up/
down, float32: 35.2 MB and 73.9 MB), under the ``wifi`` (100 Mbit/s) and ``lan`` (1 Gbit/s)
profiles, it measures per push:

- the time until every node serves version v (``AdapterSync.push`` returns once each node
  answered that it serves it: PushAdapter / FetchAdapter reply after the swap);
- the trainer's egress: the adapter bytes the trainer streamed (``SyncReport.sent_bytes``) and
  what left the trainer's network interface (eth0 ``tx_bytes`` of its namespace: TLS, HTTP/2
  and TCP overhead included);
- the CPU seconds (user + system) the node processes spent per push, over all pushes, and the
  trainer's process per push (median of the measured pushes): at 1 Gbit/s on a box with fewer
  cores than nodes, the nodes' CPU is what sets the time;

with relay fan-out (``--relay``, the default) and, as the baseline, the trainer pushing to every
node (``--no-relay``, how gridrl pushed before). Goal: egress = the adapter once whatever the
node count; 16 nodes within 2x of 1 node's time.

The nodes are *shape-only* rollout nodes (:class:`ShapeOnlyBackend`): the real node server,
adapter manager, store and relay, over a backend that has a model's identity (architecture,
sizes) but no weights. It checks each adapter against that identity, parses it (safetensors
header, every tensor's shape) and serves it as the current adapter; it cannot sample. Sixteen
real 0.5B/1.5B models do not fit this 24 GiB machine; what the bench measures (transfer,
verification, storage, the swap's bookkeeping) does not depend on the weights, except the load
of the LoRA tensors into a live model, which a real node adds once per push (~50 ms for the
bundled model's 19.6 MB, docs/benchmarks.md).

    sudo .venv/bin/python bench/fanout.py [--nodes 1,2,4,8,16] [--shapes 0.5b,1.5b]
                                          [--profiles wifi,lan] [--pushes 2] [--baseline]

Needs root, ``ip`` and ``tc`` (the harness says why it cannot run otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

RANK = 16
PORT = 50051
# Qwen2.5 shapes (config.json of Qwen/Qwen2.5-0.5B and -1.5B): hidden, layers, MLP, key/value
# width (num_key_value_heads x head_dim), vocabulary.
SHAPES: dict[str, dict[str, int]] = {
    "0.5b": {"hidden": 896, "layers": 24, "mlp": 4864, "kv": 128, "vocab": 151936},
    "1.5b": {"hidden": 1536, "layers": 28, "mlp": 8960, "kv": 256, "vocab": 151936},
}


def identity(shape: str):
    from gridrl.models import ModelIdentity

    s = SHAPES[shape]
    return ModelIdentity(model_id=f"Qwen/Qwen2.5-{shape.upper()}-shape", architecture="qwen2",
                         hidden_size=s["hidden"], num_layers=s["layers"], vocab_size=s["vocab"])


def adapter_files(shape: str, seed: int = 0) -> dict[str, bytes]:
    """A peft LoRA adapter of ``shape``: rank 16 on every linear layer, float32, random."""
    import numpy as np
    from safetensors.numpy import save

    s = SHAPES[shape]
    h, kv, mlp = s["hidden"], s["kv"], s["mlp"]
    dims = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (h, mlp), "mlp.up_proj": (h, mlp),
            "mlp.down_proj": (mlp, h)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(s["layers"]):
        for module, (d_in, d_out) in dims.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((RANK, d_in), np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((d_out, RANK), np.float32)
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
              "target_modules": sorted({m.split(".")[1] for m in dims}),
              "base_model_name_or_path": f"Qwen/Qwen2.5-{shape.upper()}", "bias": "none",
              "task_type": "CAUSAL_LM"}
    return {"adapter_config.json": json.dumps(config).encode(),
            "adapter_model.safetensors": save(tensors)}


def _shape_backend(shape: str):
    from gridrl.adapters import build_manifest, check_fits
    from gridrl.engine.contract import AdapterLoadError, Backend

    class ShapeOnlyBackend(Backend):
        """A backend with a model's identity and no weights: it checks and parses adapters and
        serves them as the current one; it cannot sample (Generate fails)."""

        name, adapter_format, device, dtype = "torch", "peft", "cpu", "float32"
        tokenizer, eos_token_ids = None, frozenset()

        def __init__(self) -> None:
            self.identity = identity(shape)
            self.vocab_size = self.identity.vocab_size

        def generate(self, batch, adapter, observer=None):
            raise RuntimeError("a shape-only node cannot sample")

        def load_adapter_files(self, files, key):
            try:
                check_fits(build_manifest(files, infer_local=False, hash_files=False),
                           self.identity)
            except Exception as e:
                raise AdapterLoadError(str(e)) from e
            return key

        def load_adapter(self, directory: Path, key: str):
            from gridrl.adapters import read_dir

            return self.load_adapter_files(read_dir(directory), key)

        def unload_adapter(self, adapter) -> None:
            pass

        def score(self, prompt_ids, completion_ids, sampling, adapter):
            raise RuntimeError("a shape-only node cannot score")

    return ShapeOnlyBackend()


def serve_node(args: argparse.Namespace) -> None:
    """One shape-only rollout node until SIGTERM (run inside the harness's namespace)."""
    import logging

    from gridrl.common.cli import write_ready_file
    from gridrl.common.security.policy import Security
    from gridrl.common.security.tls import TlsFiles
    from gridrl.common.security.tokens import AuthorizedTokens, read_token_file
    from gridrl.rollout.server import NodeConfig, RolloutNode

    logging.basicConfig(level=logging.WARNING)
    security = Security(tls=TlsFiles(args.tls_cert, args.tls_key, args.tls_ca),
                        authorized=AuthorizedTokens(args.authorized_tokens),
                        token=read_token_file(args.auth_token_file))
    node = RolloutNode(_shape_backend(args.shape), NodeConfig(
        listen=args.listen, security=security, adapter_root=Path(args.adapter_root),
        keep_adapters=1, keep_runs=1, metrics_port=-1, max_adapter_bytes=512 << 20)).start()
    write_ready_file(args.ready_file, node.address, node.port, -1)
    node.wait()


def _tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def push(args: argparse.Namespace) -> None:
    """The trainer's side (inside its namespace): pushes to the nodes, prints JSON lines."""
    import logging

    from gridrl.common.security.policy import Security
    from gridrl.common.security.tls import TlsFiles
    from gridrl.common.security.tokens import read_token_file
    from gridrl.trainer.fleet.pool import NodePool
    from gridrl.trainer.fleet.sync import AdapterSync

    logging.basicConfig(level=logging.WARNING)
    security = Security(tls=TlsFiles(args.tls_cert, args.tls_key, args.tls_ca),
                        token=read_token_file(args.auth_token_file))
    nodes = args.nodes.split(",")
    pool = NodePool(master=None, addresses=nodes, model_identity=identity(args.shape),
                    security=security, probe_interval_s=1.0)
    sync = AdapterSync(pool, name=args.name, base_model=identity(args.shape),
                       deadline_s=600, relay=args.relay)
    pool.start()
    pool.wait_for_nodes(len(nodes), 120)
    files = adapter_files(args.shape)
    for version in range(1, args.pushes + 1):
        tx = _tx_bytes()
        cpu = time.process_time()
        report = sync.push(version, files)
        print(json.dumps({"version": version, "seconds": report.seconds,
                          "cpu_s": time.process_time() - cpu,
                          "sent_bytes": report.sent_bytes, "tx_bytes": _tx_bytes() - tx,
                          "synced": len(report.synced), "relayed": len(report.relayed),
                          "skipped": report.skipped}), flush=True)
    sync.close()
    pool.close()


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` used so far."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def run(args: argparse.Namespace) -> None:
    from _common import cpu_flags, machine, table
    from netfleet import Fleet, unavailable_reason

    from gridrl.common.security.minting import mint

    reason = unavailable_reason()
    if reason:
        sys.exit(f"bench/fanout.py needs the network fleet harness: {reason}")
    counts = [int(n) for n in args.nodes.split(",")]
    shapes = args.shapes.split(",")
    sizes = {s: sum(len(b) for b in adapter_files(s).values()) for s in shapes}
    results: list[dict[str, Any]] = []
    script = str(Path(__file__).resolve())
    with tempfile.TemporaryDirectory(prefix="fanout-") as tmp, Fleet(Path(tmp)) as fleet:
        for shape in shapes:
            names = []
            for i in range(max(counts)):  # nodes listen on a fixed port of their own address:
                name = f"{shape.replace('.', '')}n{i}"  # their credential names it
                address = f"{fleet.subnet.network_address + len(fleet.hosts) + 2}:{PORT}"
                mint(fleet.authorized, fleet.keys_dir / f"{name}.token", "node", name,
                     address=address)
                host = fleet.add_host(name, args.profiles.split(",")[0])
                assert f"{host.address}:{PORT}" == address
                argv = ["python", script, "node", "--shape", shape, "--listen", address,
                        "--adapter-root", str(Path(tmp) / f"{name}-adapters"),
                        *fleet.server_flags(name, "node")]
                fleet.spawn(name, argv, timeout_s=300)
                names.append(name)
            fleet.add_host(f"trainer-{shape.replace('.', '')}", args.profiles.split(",")[0])
            trainer = f"trainer-{shape.replace('.', '')}"
            for profile in args.profiles.split(","):
                for host in [*names, trainer]:
                    fleet.set_profile(host, profile)
                for relay in ([True, False] if args.baseline else [True]):
                    for n in counts:
                        if not relay and n > args.baseline_max:
                            continue
                        run_name = f"fan-{shape}-{profile}-{n}-{'relay' if relay else 'push'}"
                        addresses = [f"{fleet.host(x).address}:{PORT}" for x in names[:n]]
                        argv = ["ip", "netns", "exec", fleet.host(trainer).netns,
                                sys.executable, script, "push", "--shape", shape,
                                "--nodes", ",".join(addresses), "--name", run_name,
                                "--pushes", str(args.pushes),
                                "--relay" if relay else "--no-relay",
                                *fleet.client_flags(trainer, "trainer")]
                        pids = [p.proc.pid for p in fleet.procs if p.name in names[:n]]
                        cpu = _cpu_s(pids)
                        out = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
                        cpu = (_cpu_s(pids) - cpu) / args.pushes
                        if out.returncode != 0:
                            raise RuntimeError(f"{run_name}: pusher exited {out.returncode}:\n"
                                               f"{out.stderr[-3000:]}")
                        pushes = [json.loads(line) for line in out.stdout.splitlines()
                                  if line.startswith("{")]
                        measured = pushes[1:] or pushes  # the first push warms channels up
                        row = {"shape": shape, "profile": profile, "nodes": n, "relay": relay,
                               "seconds": statistics.median(p["seconds"] for p in measured),
                               "sent_bytes": statistics.median(p["sent_bytes"] for p in measured),
                               "tx_bytes": statistics.median(p["tx_bytes"] for p in measured),
                               "size": sizes[shape], "node_cpu_s": cpu,
                               "trainer_cpu_s": statistics.median(p["cpu_s"] for p in measured),
                               "skipped": sum(len(p["skipped"]) for p in pushes)}
                        results.append(row)
                        print(json.dumps(row), flush=True)
    print()
    print(f"machine: {machine()}")
    print(f"CPU flags: {cpu_flags()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    rows = []
    for r in results:
        one = next((x for x in results if (x["shape"], x["profile"], x["relay"], x["nodes"])
                    == (r["shape"], r["profile"], r["relay"], 1)), None)  # --nodes without 1
        rows.append([r["shape"], r["profile"], "relay" if r["relay"] else "push to each",
                     str(r["nodes"]), f"{r['seconds']:.2f}",
                     f"{r['seconds'] / one['seconds']:.2f}x" if one else "-",
                     f"{r['sent_bytes'] / r['size']:.2f}", f"{r['tx_bytes'] / r['size']:.2f}",
                     f"{r['node_cpu_s']:.2f}", f"{r['trainer_cpu_s']:.2f}", str(r["skipped"])])
    print(table(rows, ["adapter", "link", "fan-out", "nodes", "s until all serve",
                       "vs 1 node", "sent / size", "eth0 tx / size", "nodes' CPU s / push",
                       "trainer CPU s / push", "skipped"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    node = sub.add_parser("node", help="(internal) a shape-only node")
    pusher = sub.add_parser("push", help="(internal) the trainer's pushes")
    for p in (node, pusher):
        p.add_argument("--shape", choices=sorted(SHAPES), required=True)
        p.add_argument("--tls-cert")
        p.add_argument("--tls-key")
        p.add_argument("--tls-ca")
        p.add_argument("--auth-token-file")
    node.add_argument("--listen", required=True)
    node.add_argument("--adapter-root", required=True)
    node.add_argument("--authorized-tokens", required=True)
    node.add_argument("--ready-file")
    pusher.add_argument("--nodes", required=True)
    pusher.add_argument("--name", required=True)
    pusher.add_argument("--pushes", type=int, default=2)
    pusher.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--nodes", default="1,2,4,8,16", help="node counts, comma-separated")
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--profiles", default="wifi,lan", help="netfleet PROFILES names")
    parser.add_argument("--pushes", type=int, default=2,
                        help="pushes per configuration; the first is a warm-up")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the trainer pushing to every node (--no-relay)")
    parser.add_argument("--baseline-max", type=int, default=16,
                        help="largest node count of the baseline")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    {"node": serve_node, "push": push}.get(args.command, run)(args)


if __name__ == "__main__":
    main()
