"""Helpers shared by the benchmarks: machine description, services as subprocesses, tables."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def machine() -> str:
    """One line: CPU model, cores, memory, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, ValueError):
        pass
    import torch

    return (f"{cpu} ({cpu_flags()}), {os.cpu_count()} cores{mem}, torch {torch.__version__}")


def read_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` read bandwidth in GB/s: torch sum over a ``size_mb`` fp32 tensor."""
    import torch

    x = torch.ones(size_mb * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def matmul_gflops(dtype: str = "float32", size: int = 1536, repeats: int = 5) -> float:
    """Best-of-``repeats`` GFLOP/s of one large square matrix product (compute-bound: ~the
    machine's FMA peak for ``dtype`` through torch's GEMM, all cores)."""
    import torch

    a = torch.randn(size, size).to(getattr(torch, dtype))
    b = torch.randn(size, size).to(getattr(torch, dtype))
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best / 1e9



def decode_compute_bound(flops: dict[str, float], dtype: str, params: int) -> float:
    """Tokens/s the products of one decode step allow: ``flops`` (GFLOP/s by dtype, from
    :func:`matmul_gflops`) over 2 FLOPs a parameter. bfloat16 weights may be multiplied in
    float32 arithmetic (the AVX2 kernels do: a CPU without bf16 instructions measures ~1
    GFLOP/s of bf16 GEMM), so the faster of the two arithmetics bounds them."""
    return max(flops[dtype], flops["float32"]) * 1e9 / (2 * params)

class Proc:
    """A gridrl service subprocess started with --ready-file; stopped with SIGTERM. Its
    scratch directory (ready file, log) is removed when it stops; a service that fails to
    start raises with the log's tail."""

    def __init__(self, argv: list[str], name: str, timeout: float = 300, env: dict | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        ready = self.dir / "ready.json"
        self.log = self.dir / "log.txt"
        self.proc = subprocess.Popen([str(BIN / argv[0]), *argv[1:], "--ready-file", str(ready)],
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log.read_text()[-3000:]
                self.stop()
                raise RuntimeError(f"{name} did not start:\n{log}")
            time.sleep(0.2)
        info = json.loads(ready.read_text())
        self.address = info["address"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Channels:
    """How the benchmark talks to the nodes it starts: plaintext, or with ``secure`` as across
    machines (mutual TLS, the node accepting a trainer credential; certificates and tokens made
    for the run, removed by :meth:`close`).

    ``node_flags`` go on each ``gridrl-rollout serve``; ``security`` is what the benchmark
    dials with (``gridrl.common.rpc.channel.dial(address, channels.security)``).
    """

    def __init__(self, secure: bool) -> None:
        self.secure = secure
        self.node_flags: list[str] = []
        self.security = None
        self._dir: Path | None = None
        if secure:
            from gridrl.common.security.certs import local_identities
            from gridrl.common.security.policy import Security
            from gridrl.common.security.tls import TlsFiles
            from gridrl.common.security.tokens import read_token_file

            self._dir = Path(tempfile.mkdtemp(prefix="bench-credentials-"))
            ids = local_identities(self._dir, {"node": None, "bench": "trainer"})
            self.node_flags = ids["node"].server_flags()
            me = ids["bench"]
            self.security = Security(tls=TlsFiles(str(me.cert), str(me.key), str(me.ca)),
                                     token=read_token_file(me.token))

    def describe(self) -> str:
        return ("mutual TLS, trainer-scoped bearer token" if self.secure
                else "plaintext, no credential (loopback)")

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def resident_mb(pid: int) -> tuple[float, float]:
    """(resident set size now, its peak so far) of process ``pid`` in MB (10^6 bytes), from
    /proc (Linux; (nan, nan) elsewhere)."""
    values = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024 / 1e6
    except (OSError, ValueError):
        pass
    return values.get("VmRSS", float("nan")), values.get("VmHWM", float("nan"))


def runtime_floor_mb(imports: str) -> float:
    """Resident MB of a fresh interpreter after ``imports`` (Python statements): what a
    service's libraries cost before it loads a model."""
    code = f"{imports}\nimport os\nprint(open(f'/proc/{{os.getpid()}}/status').read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300).stdout
    for line in out.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


class BackgroundLoad:
    """``busy`` processes that each keep one core busy (a pure-Python loop, the kind of load an
    owner's compile or notebook puts on a shared box) while the ``with`` block runs; each also
    ends by itself after ``limit_s``, so none outlives a bench that crashed.

        with BackgroundLoad(1):
            ...  # measured with one core busy
    """

    def __init__(self, busy: int, limit_s: float = 1800.0) -> None:
        self.busy, self.limit_s = busy, limit_s
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> BackgroundLoad:
        code = (f"import time\nend = time.monotonic() + {float(self.limit_s)!r}\n"
                "while time.monotonic() < end:\n    sum(range(1000))\n")
        self.procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.busy)]
        time.sleep(0.5 if self.busy else 0)  # let them get going
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


def load_average() -> str:
    """The 1-minute load average and the core count, e.g. "load 0.42 on 2 cores"."""
    try:
        one = Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        one = "?"
    return f"load {one} on {os.cpu_count()} cores"


def cpu_flags() -> str:
    """The CPU features that decide gridrl's fast paths, as /proc/cpuinfo names them
    (avx2, avx512f, avx512_bf16, amx_bf16, ...): "none of them" where absent."""
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile",
              "avx_ne_convert")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in wanted if f in have) or "none of them"
    except OSError:
        pass
    return "unknown"


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain-text table (also valid Markdown)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *map(line, rows)])
